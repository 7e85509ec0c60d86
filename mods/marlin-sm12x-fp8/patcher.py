"""Patcher for the sparkforge mod marlin-sm12x-fp8 (stdlib only).

Marlin's W4A8-FP8 path (VLLM_MARLIN_INPUT_DTYPE=fp8) is gated on compute
capability 8.9 or exactly 12.0, in the Python selector and in both CUDA
kernels' host code. GB10 is 12.1, so it is refused there although the FP8
kernels are built for SM12x. This patcher widens each gate from "exactly 12.0"
to "any 12.x":

  * csrc/quantization/marlin/marlin.cu and csrc/moe/marlin_moe_wna16/ops.cu:
    `major_capability * 10 + minor_capability == 120` -> `major_capability == 12`;
  * vllm/model_executor/layers/quantization/utils/marlin_utils.py:
    `current_platform.is_device_capability(120)` ->
    `current_platform.is_device_capability_family(120)`;

and the error messages say SM12x instead of SM120.

Each file is in one of three states: the exact-12.0 gate (edited here), this
mod's edit (marked), or upstream's own SM12x gate (left alone; vLLM 0.22.0
fixed the Python selector and the MoE kernel, 0.23.0 the dense kernel). When
every file already has upstream's gate, the mod is not needed and fails saying
so, rather than report success for an edit it did not make.
"""

from __future__ import annotations

MARK = "sparkforge mod marlin-sm12x-fp8"

KERNEL_OLD = (
    "            major_capability * 10 + minor_capability == 120,\n"
    '        "Marlin W4A8-FP8 only support SM89 or SM120 device (It is slower than "\n'
)
KERNEL_NEW = (
    f"            major_capability == 12,  // {MARK}: any SM12x (GB10 is SM121)\n"
    '        "Marlin W4A8-FP8 only support SM89 or SM12x device (It is slower than "\n'
)
KERNEL_UPSTREAM = "            major_capability == 12,\n"

SELECTOR_OLD = (
    "        ) and not current_platform.is_device_capability(120):\n"
    "            raise ValueError(\n"
    '                "Marlin W4A8-FP8 only support SM89 or SM120 device "\n'
)
SELECTOR_NEW = (
    f"        ) and not current_platform.is_device_capability_family(120):  # {MARK}\n"
    "            raise ValueError(\n"
    '                "Marlin W4A8-FP8 only support SM89 or SM12x device "\n'
)
SELECTOR_UPSTREAM = "        ) and not current_platform.is_device_capability_family(120):\n"

# path -> (old text, new text, upstream's own fix)
EDITS = {
    "csrc/quantization/marlin/marlin.cu": (KERNEL_OLD, KERNEL_NEW, KERNEL_UPSTREAM),
    "csrc/moe/marlin_moe_wna16/ops.cu": (KERNEL_OLD, KERNEL_NEW, KERNEL_UPSTREAM),
    "vllm/model_executor/layers/quantization/utils/marlin_utils.py": (
        SELECTOR_OLD, SELECTOR_NEW, SELECTOR_UPSTREAM),
}
TARGETS = list(EDITS)


def _state(path: str, text: str) -> str:
    """'old', 'ours' or 'upstream'; ValueError when the gate is in none of these forms."""
    old, new, upstream = EDITS[path]
    count_old, count_new = text.count(old), text.count(new)
    if count_old == 1 and count_new == 0 and MARK not in text:
        return "old"
    if count_old == 0 and count_new == 1:
        return "ours"
    if count_old == 0 and MARK not in text and text.count(upstream) == 1:
        return "upstream"
    raise ValueError(
        f"{path}: the W4A8-FP8 capability gate is not in a known form "
        f"(exact-SM120 gate found {count_old} times, this mod's edit {count_new} times)"
    )


def is_applied(sources: dict[str, str]) -> bool:
    try:
        states = [_state(path, sources[path]) for path in TARGETS]
    except ValueError:
        return False
    return "old" not in states and "ours" in states


def transform(sources: dict[str, str]) -> dict[str, str]:
    states = {path: _state(path, sources[path]) for path in TARGETS}
    if all(s == "upstream" for s in states.values()):
        raise ValueError(
            "not needed: this vLLM already accepts any SM12x for Marlin W4A8-FP8 in "
            + ", ".join(TARGETS)
        )
    result = {}
    for path, state in states.items():
        old, new, _ = EDITS[path]
        result[path] = sources[path].replace(old, new) if state == "old" else sources[path]
    return result
