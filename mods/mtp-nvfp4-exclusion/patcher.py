"""Patcher for the sparkforge mod mtp-nvfp4-exclusion (stdlib only).

ModelOpt NVFP4 checkpoints of Qwen3-Next and Qwen3.5 keep their MTP
(multi-token prediction) head in BF16, but the exclude list in their
quantization config names only some of its modules: `mtp.fc` is missing. vLLM
then builds mtp.fc as an NVFP4 layer and cannot load the BF16 weight, so MTP
speculative decoding fails. The edit: in `is_layer_excluded` of
quantization/modelopt.py, a layer whose prefix starts with "mtp." is also
excluded when some exclude pattern starts with "mtp." (the checkpoint left its
MTP head unquantized).

How: the body of `def is_layer_excluded(self, prefix)` (exactly one in the
file, found with `ast`) must end in `return False`; the check is inserted just
before that line, so every earlier rule keeps deciding first.

When upstream forces mtp.fc unquantized itself for modelopt_fp4 in the MTP
model (Qwen3.5 from vLLM 0.20.0, Qwen3-Next from 0.25.0; seen in
models/qwen3_next_mtp.py), the mod is not needed and fails saying so.
"""

from __future__ import annotations

import ast

MODELOPT = "vllm/model_executor/layers/quantization/modelopt.py"
NEXT_MTP = "vllm/model_executor/models/qwen3_next_mtp.py"
TARGETS = [MODELOPT, NEXT_MTP]

MARK = "# sparkforge mod mtp-nvfp4-exclusion"
UPSTREAM_FIX = 'quant_config.get_name() == "modelopt_fp4"'

BLOCK = [
    f"{MARK}: a checkpoint that excludes part of its",
    "# MTP head (a pattern starting with 'mtp.') keeps all of it unquantized;",
    "# mtp.fc is BF16 there but missing from the exclude list.",
    'if prefix.startswith("mtp.") and any(',
    '    pattern.startswith("mtp.") for pattern in self.exclude_modules',
    "):",
    "    return True",
    "",
]


def _final_return(text: str) -> ast.Return:
    """The `return False` that ends is_layer_excluded; ValueError naming what is missing."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"{MODELOPT}: cannot parse ({exc})") from None
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "is_layer_excluded"]
    if len(found) != 1:
        raise ValueError(f"{MODELOPT}: expected one def is_layer_excluded, found {len(found)}")
    func = found[0]
    params = [a.arg for a in func.args.args]
    if params != ["self", "prefix"]:
        raise ValueError(f"{MODELOPT}: is_layer_excluded takes {params}, expected ['self', 'prefix']")
    last = func.body[-1]
    if not (isinstance(last, ast.Return) and isinstance(last.value, ast.Constant) and last.value.value is False):
        raise ValueError(f"{MODELOPT}: is_layer_excluded does not end in `return False` (line {last.lineno})")
    return last


def is_applied(sources: dict[str, str]) -> bool:
    return sources[MODELOPT].count(MARK) == 1


def transform(sources: dict[str, str]) -> dict[str, str]:
    text = sources[MODELOPT]
    if MARK in text:
        raise ValueError(f"{MODELOPT}: partly patched already (marker found {text.count(MARK)} times)")
    if UPSTREAM_FIX in sources[NEXT_MTP]:
        raise ValueError(
            f"not needed: {NEXT_MTP} already builds mtp.fc unquantized for modelopt_fp4 "
            "(as Qwen3.5's MTP does from vLLM 0.20.0)"
        )
    ret = _final_return(text)
    lines = text.splitlines(keepends=True)
    indent = " " * ret.col_offset
    block = "".join((indent + line if line else "") + "\n" for line in BLOCK)
    lines.insert(ret.lineno - 1, block)
    new = "".join(lines)
    try:
        ast.parse(new)
    except SyntaxError as exc:
        raise ValueError(f"{MODELOPT}: patched text does not parse ({exc})") from None
    return {MODELOPT: new, NEXT_MTP: sources[NEXT_MTP]}
