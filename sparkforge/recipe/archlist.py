"""What a TORCH_CUDA_ARCH_LIST gives a GB10 once vLLM's CMake has filtered it.

vLLM's CMakeLists.txt intersects the list with the toolkit's archs, then with each kernel's own; a kernel left with
none is dropped silently, and the image fails at run time ("no kernel image is available"). This re-states vLLM
0.30.0's `cuda_archs_loose_intersection` and the generic and SM12x-only kernel lists under CUDA 13 (NGC 26.xx):
`12.1a` gives sm_120 and sm_120f (both run on a 12.1); `12.0a;12.1a` gives sm_120a, which does not.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from ..inimage.fatbin import Target
from ..inimage.kernels import runs_on

if TYPE_CHECKING:
    from .plan import Plan

# vLLM 0.30.0, CMakeLists.txt, CUDA_SUPPORTED_ARCHS for CUDA >= 13.0 (and < 13.4; 13.4 adds 10.7).
SUPPORTED_CUDA13 = ("7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "11.0", "12.0")
# vLLM 0.30.0, the list of each SM12x-only kernel under CUDA >= 13.0 (CUTLASS scaled_mm, FP4, MoE data, Marlin,
# DSV3 fused A GEMM, qutlass SM120).
SM12X_KERNELS = ("12.0f",)

_SUFFIX = re.compile(r"[af]\Z")


def _version(arch: str) -> tuple[int, int]:
    """As CMake's VERSION_* comparisons read '12.1a': the numbers, the suffix ignored."""
    major, minor = _SUFFIX.sub("", arch).split(".")
    return int(major), int(minor)


def loose_intersection(src: list[str], tgt: list[str]) -> list[str]:
    """vLLM 0.30.0's cuda_archs_loose_intersection(OUT, SRC, TGT), step by step."""
    ptx = list(dict.fromkeys(a.removesuffix("+PTX") for a in src if a.endswith("+PTX")))
    src = list(dict.fromkeys(a.removesuffix("+PTX") for a in src))
    tgt = list(tgt)
    out: list[str] = []
    # An a/f source whose base arch is a target, exactly.
    for arch in list(src):
        if _SUFFIX.search(arch) and _SUFFIX.sub("", arch) in tgt:
            src.remove(arch)
            tgt.remove(_SUFFIX.sub("", arch))
            out.append(arch)
    # Then an a/f source against a suffixed target; a family source against any target of its major.
    for arch in [arch for arch in src if _SUFFIX.search(arch)]:
        src.remove(arch)
        base = _SUFFIX.sub("", arch)
        found = next((base + suffix for suffix in "af" if base + suffix in tgt), None)
        if found is None and arch.endswith("f"):
            found = next((target for target in tgt if target.split(".")[0] == base.split(".")[0]), None)
        if found is not None:
            tgt.remove(found)
            out.append(found)
    # A suffixed target whose base arch is a source keeps its suffix.
    for target in list(tgt):
        if _SUFFIX.search(target) and _SUFFIX.sub("", target) in src:
            tgt.remove(target)
            src.remove(_SUFFIX.sub("", target))
            out.append(target)
    # Every other target takes the highest source at or below it, of its major unless that source is PTX.
    src.sort(key=_version)
    for target in tgt:
        best = None
        for arch in src:
            if _version(arch) > _version(target):
                break
            if arch in ptx or _version(arch)[0] == _version(target)[0]:
                best = arch
        if best:
            out.append(best)
    return [a + "+PTX" if a in ptx else a for a in dict.fromkeys(out)]


def cuda_archs(arch_list: str) -> list[str]:
    """The archs vLLM 0.30.0's generic kernels are built for under CUDA 13, from TORCH_CUDA_ARCH_LIST."""
    wanted = sorted(dict.fromkeys(a.removesuffix("+PTX") for a in arch_list.split(";")), key=_version)
    return loose_intersection(list(SUPPORTED_CUDA13), wanted)


def _runs(archs: list[str], gpu: str) -> bool:
    for arch in archs:
        plain = arch.removesuffix("+PTX")
        number = plain.replace(".", "")
        if runs_on(Target.parse(f"sm_{number}"), gpu) or (plain != arch and runs_on(Target.parse(f"compute_{number}"), gpu)):
            return True
    return False


def sm12x_warnings(arch_list: str, gpus: tuple[str, ...]) -> list[str]:
    """Why this arch list cannot give a listed SM12x GPU vLLM 0.30.0's kernels under CUDA 13 (empty when it can)."""
    generic = cuda_archs(arch_list)
    sm12x = loose_intersection(list(SM12X_KERNELS), generic)
    out = []
    for gpu in (listed for listed in gpus if listed.startswith("12.")):
        missing = [what for what, archs in (("generic kernels", generic), ("SM12x kernels", sm12x))
                   if not _runs(archs, gpu)]
        if missing:
            built = f"generic kernels for {';'.join(generic) or 'nothing'}, SM12x kernels for {';'.join(sm12x) or 'nothing'}"
            out.append(f"TORCH_CUDA_ARCH_LIST={arch_list} gives GPU {gpu} no {' and no '.join(missing)} "
                       f"under vLLM 0.30.0's CMake with CUDA 13 ({built})")
    return out


def plan_warnings(plan: Plan) -> list[str]:
    """`show`'s warnings for a plan of vLLM 0.30.0 or later (0.17.0 gives plain sm_120 for both lists, lacking the
    step that keeps a suffixed target's suffix; releases in between were not read)."""
    try:
        if Version(plan.vllm.version) < Version("0.30.0"):
            return []
    except InvalidVersion:
        return []
    return sm12x_warnings(plan.build.torch_cuda_arch_list, plan.gpus)
