"""Patcher for the sparkforge mod fix-qwen35-tp4-marlin (stdlib only).

Problem (seed 000): in the Gated DeltaNet (linear attention) block of Qwen3-Next
and Qwen3.5, `in_proj_ba` has 2 * num_v_heads output features (128 for
Qwen3.5-397B). Sharded over TP=4 a rank holds 32 of them, and Marlin kernels
(GPTQ/AWQ/AutoRound INT4) need at least 64 (MIN_THREAD_N), so the model fails to
load. Fix: when a quantized in_proj_ba would hold fewer than 64 output features
per rank, build it as a ReplicatedLinear (full weight on every rank) and cut this
rank's features out of the output in forward().

How the edit is made, for every file in TARGETS:
  * every construction of in_proj_ba (`self.in_proj_ba = <Linear>(...)`, or
    `return <Linear>(...)` inside `def create_ba_proj`) where <Linear> is
    ColumnParallelLinear or MergedColumnParallelLinear gets wrapped:
    `<Linear>(kw=...)` -> `_sf_build_in_proj_ba(<Linear>, kw=...)`. The original
    keyword arguments are untouched, and the builder returns the original layer
    unchanged unless the replicated one is needed;
  * one helper block (between the marker lines below) is inserted right before
    the top-level class that holds the first construction.
The sites are found with the `ast` module, so the edit does not depend on line
numbers. Anything unexpected (no construction site in the required file, an
in_proj_ba built some other way, positional arguments, a half-applied file)
raises ValueError naming the file and what was not found.
"""

from __future__ import annotations

import ast

TARGETS = [
    "vllm/model_executor/models/qwen3_next.py",
    "vllm/model_executor/models/qwen3_5.py",
]

# Files that must contain at least one in_proj_ba construction. The others may
# have none (vLLM 0.17.x: Qwen3.5 inherits the constructor from Qwen3-Next).
REQUIRED = {"vllm/model_executor/models/qwen3_next.py"}

MARK_BEGIN = "# >>> sparkforge mod fix-qwen35-tp4-marlin >>>"
MARK_END = "# <<< sparkforge mod fix-qwen35-tp4-marlin <<<"
BUILDER = "_sf_build_in_proj_ba"
LINEAR_CLASSES = ("ColumnParallelLinear", "MergedColumnParallelLinear")

HELPER = '''# >>> sparkforge mod fix-qwen35-tp4-marlin >>>
# Added by the sparkforge mod fix-qwen35-tp4-marlin. A quantized in_proj_ba with
# fewer than 64 output features per TP rank cannot run on Marlin kernels
# (MIN_THREAD_N = 64), e.g. Qwen3.5-397B at TP=4: 128 / 4 = 32. Such a layer is
# built replicated (full weight on every rank) and forward() returns exactly the
# features the sharded layer would have returned on this rank.
from vllm.distributed import (
    get_tensor_model_parallel_rank as _sf_tp_rank,
    get_tensor_model_parallel_world_size as _sf_tp_world_size,
)
from vllm.logger import init_logger as _sf_init_logger
from vllm.model_executor.layers.linear import ReplicatedLinear as _SfReplicatedLinear
from vllm.model_executor.parameter import (
    BlockQuantScaleParameter as _SfBlockQuantScaleParameter,
    PerTensorScaleParameter as _SfPerTensorScaleParameter,
)

_sf_logger = _sf_init_logger(__name__)
_SF_MARLIN_MIN_THREAD_N = 64
_SF_BUILDER_KWARGS = {
    "input_size",
    "output_size",
    "output_sizes",
    "bias",
    "quant_config",
    "prefix",
}


class _SfReplicatedBAProj(_SfReplicatedLinear):
    """in_proj_ba kept whole on every TP rank; forward() returns this rank's part.

    output_sizes are the logical shards of the sharded layer it replaces
    ([2 * num_v_heads] for ColumnParallelLinear or a single-shard merged layer,
    [num_v_heads, num_v_heads] for the b/a merged layer). The sharded layer gives
    rank r the r-th 1/tp_size slice of every logical shard, concatenated; the
    same slices are cut out of the full output here.
    """

    def __init__(self, input_size, output_sizes, bias, quant_config, prefix,
                 tp_rank, tp_size):
        # ReplicatedLinear takes self.output_sizes as output_partition_sizes, so
        # quant methods see the same logical shards as with the merged layer.
        self.output_sizes = [int(s) for s in output_sizes]
        super().__init__(
            input_size,
            sum(self.output_sizes),
            bias=bias,
            quant_config=quant_config,
            prefix=prefix,
        )
        self.sf_tp_rank = tp_rank
        self.sf_tp_size = tp_size
        self._sf_whole_loaded = set()

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        if loaded_shard_id is None:
            # A fused checkpoint tensor: it holds the whole layer.
            return super().weight_loader(param, loaded_weight)
        if (
            isinstance(loaded_shard_id, bool)
            or not isinstance(loaded_shard_id, int)
            or not 0 <= loaded_shard_id < len(self.output_sizes)
        ):
            raise ValueError(
                f"{self.prefix}: unexpected shard id {loaded_shard_id!r} for "
                f"output sizes {self.output_sizes}"
            )
        if isinstance(param, _SfBlockQuantScaleParameter):
            raise NotImplementedError(
                f"{self.prefix}: block-quantized scales are not supported by the "
                "replicated in_proj_ba (sparkforge mod fix-qwen35-tp4-marlin)"
            )
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            offset = sum(self.output_sizes[:loaded_shard_id])
            size = self.output_sizes[loaded_shard_id]
            if getattr(param, "packed_dim", None) == output_dim:
                if hasattr(param, "adjust_shard_indexes_for_packing"):
                    size, offset = param.adjust_shard_indexes_for_packing(
                        shard_size=size, shard_offset=offset
                    )
                else:
                    size //= param.pack_factor
                    offset //= param.pack_factor
                    tile = getattr(param, "marlin_tile_size", None)
                    if tile:
                        size *= tile
                        offset *= tile
            target = param.data.narrow(output_dim, offset, size)
            if tuple(target.shape) != tuple(loaded_weight.shape):
                raise ValueError(
                    f"{self.prefix}: shard {loaded_shard_id} has shape "
                    f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(loaded_weight)
            return None
        if isinstance(param, _SfPerTensorScaleParameter):
            # One scale per logical shard; no TP slicing involved.
            param.load_merged_column_weight(
                loaded_weight=loaded_weight, shard_id=loaded_shard_id
            )
            return None
        # A tensor without an output dim (e.g. g_idx): every shard must carry
        # the same values, or the replicated layer cannot represent it.
        if id(param) not in self._sf_whole_loaded:
            super().weight_loader(param, loaded_weight)
            self._sf_whole_loaded.add(id(param))
            return None
        if not torch.equal(param.data, loaded_weight.to(param.data.device)):
            raise ValueError(
                f"{self.prefix}: shards {self.output_sizes} disagree on a tensor "
                "without an output dim; cannot load it replicated"
            )
        return None

    def _sf_rank_part(self, full):
        parts = []
        start = 0
        for size in self.output_sizes:
            per_rank = size // self.sf_tp_size
            parts.append(full.narrow(-1, start + self.sf_tp_rank * per_rank, per_rank))
            start += size
        if len(parts) == 1:
            return parts[0].contiguous()
        return torch.cat(parts, dim=-1)

    def forward(self, x):
        result = super().forward(x)
        if isinstance(result, tuple):
            output, output_bias = result
            if output_bias is not None:
                output_bias = self._sf_rank_part(output_bias)
            return self._sf_rank_part(output), output_bias
        return self._sf_rank_part(result)


def _sf_build_in_proj_ba(linear_cls, **kwargs):
    """Build in_proj_ba: the original layer, or the replicated one if needed."""
    if "output_sizes" in kwargs:
        output_sizes = [int(s) for s in kwargs["output_sizes"]]
    else:
        output_sizes = [int(kwargs["output_size"])]
    tp_size = _sf_tp_world_size()
    if (
        tp_size <= 1
        or kwargs.get("quant_config") is None
        or set(kwargs) - _SF_BUILDER_KWARGS
        or any(size % tp_size for size in output_sizes)
        or sum(output_sizes) // tp_size >= _SF_MARLIN_MIN_THREAD_N
    ):
        return linear_cls(**kwargs)
    _sf_logger.info_once(
        "sparkforge fix-qwen35-tp4-marlin: in_proj_ba has %d output features per "
        "rank at TP=%d (< %d); keeping it replicated on every rank",
        sum(output_sizes) // tp_size,
        tp_size,
        _SF_MARLIN_MIN_THREAD_N,
    )
    return _SfReplicatedBAProj(
        input_size=kwargs["input_size"],
        output_sizes=output_sizes,
        bias=kwargs.get("bias", True),
        quant_config=kwargs["quant_config"],
        prefix=kwargs.get("prefix", ""),
        tp_rank=_sf_tp_rank(),
        tp_size=tp_size,
    )
# <<< sparkforge mod fix-qwen35-tp4-marlin <<<
'''


def _is_self_in_proj_ba(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "in_proj_ba"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _scan(path: str, text: str):
    """Return (raw_sites, wrapped_sites, toplevel_nodes).

    raw_sites: ast.Call nodes that construct in_proj_ba with a plain
    ColumnParallelLinear / MergedColumnParallelLinear; wrapped_sites: the same
    places already going through the builder. Raises ValueError on anything
    this patcher does not understand.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"{path}: cannot parse ({exc})") from None
    raw, wrapped = [], []

    def classify(call: ast.AST, where: str) -> None:
        if not isinstance(call, ast.Call):
            raise ValueError(f"{path}: {where} is not a call (line {call.lineno})")
        func = call.func
        if isinstance(func, ast.Name) and func.id in LINEAR_CLASSES:
            if call.args:
                raise ValueError(
                    f"{path}: {where} at line {call.lineno} uses positional "
                    "arguments; expected keyword arguments only"
                )
            raw.append(call)
        elif isinstance(func, ast.Name) and func.id == BUILDER:
            wrapped.append(call)
        elif (
            isinstance(func, ast.Attribute)
            and func.attr == "create_ba_proj"
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
        ):
            pass  # delegates to a create_ba_proj factory, handled there
        else:
            raise ValueError(
                f"{path}: {where} at line {call.lineno} is not a "
                f"{' / '.join(LINEAR_CLASSES)} call"
            )

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            _is_self_in_proj_ba(t) for t in node.targets
        ):
            classify(node.value, "self.in_proj_ba = ...")
        elif isinstance(node, ast.AnnAssign) and _is_self_in_proj_ba(node.target):
            raise ValueError(f"{path}: annotated in_proj_ba assignment not expected")
        elif isinstance(node, ast.FunctionDef) and node.name == "create_ba_proj":
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            if len(returns) != 1 or returns[0].value is None:
                raise ValueError(
                    f"{path}: def create_ba_proj (line {node.lineno}) does not "
                    "end in a single `return <Linear>(...)`"
                )
            classify(returns[0].value, "create_ba_proj's return")
    return raw, wrapped, tree.body


def _file_state(path: str, text: str) -> str:
    """'none' (no site), 'raw', 'wrapped' or 'mixed'."""
    raw, wrapped, _ = _scan(path, text)
    has_marker = MARK_BEGIN in text and MARK_END in text
    if not raw and not wrapped:
        return "wrapped" if has_marker else "none"
    if raw and not wrapped and MARK_BEGIN not in text:
        return "raw"
    if wrapped and not raw and has_marker:
        return "wrapped"
    return "mixed"


def is_applied(sources: dict[str, str]) -> bool:
    states = {}
    for path in TARGETS:
        try:
            states[path] = _file_state(path, sources[path])
        except ValueError:
            return False
    if any(s in ("raw", "mixed") for s in states.values()):
        return False
    return all(states[p] == "wrapped" for p in REQUIRED)


def _patch_text(path: str, text: str) -> str:
    raw, wrapped, body = _scan(path, text)
    if wrapped or MARK_BEGIN in text or MARK_END in text:
        raise ValueError(f"{path}: partly patched already (builder or marker present)")
    lines = text.splitlines(keepends=True)
    # Wrap the constructor calls, bottom-up so earlier positions stay valid.
    for call in sorted(raw, key=lambda c: (c.lineno, c.col_offset), reverse=True):
        name = call.func.id
        i, col = call.func.lineno - 1, call.func.col_offset
        line = lines[i]
        if line[col:col + len(name) + 1] != name + "(":
            raise ValueError(f"{path}: expected `{name}(` at line {i + 1}, col {col}")
        rest = line[col + len(name) + 1:]
        sep = " " if rest.strip() else ""
        lines[i] = line[:col] + f"{BUILDER}({name},{sep}" + rest
    # Insert the helper before the top-level class holding the first site.
    first = min(raw, key=lambda c: c.lineno)
    holder = None
    for node in body:
        if (
            isinstance(node, ast.ClassDef)
            and node.lineno <= first.lineno <= node.end_lineno
        ):
            holder = node
            break
    if holder is None:
        raise ValueError(
            f"{path}: the in_proj_ba construction at line {first.lineno} is not "
            "inside a top-level class"
        )
    start = min([holder.lineno] + [d.lineno for d in holder.decorator_list]) - 1
    lines.insert(start, HELPER + "\n\n")
    return "".join(lines)


def transform(sources: dict[str, str]) -> dict[str, str]:
    result = {}
    for path in TARGETS:
        text = sources[path]
        raw, wrapped, _ = _scan(path, text)
        if not raw:
            if wrapped or MARK_BEGIN in text:
                raise ValueError(f"{path}: partly patched already (builder or marker present)")
            if path in REQUIRED:
                raise ValueError(
                    f"{path}: no in_proj_ba construction found (expected "
                    "`self.in_proj_ba = ColumnParallelLinear(...)` / "
                    "`MergedColumnParallelLinear(...)`, or `return "
                    "MergedColumnParallelLinear(...)` in def create_ba_proj)"
                )
            result[path] = text
            continue
        new = _patch_text(path, text)
        try:
            ast.parse(new)
        except SyntaxError as exc:
            raise ValueError(f"{path}: patched text does not parse ({exc})") from None
        result[path] = new
    return result
