"""What a GPU runs of a file's device code: CUDA's compatibility rule, and the kernels it cannot run (stdlib only)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from .contract import GpuCoverage, KernelExtension
from .fatbin import ARCH_SPECIFIC, FAMILY, FLAG_COMPRESSED, UNKNOWN, DeviceCode, FatbinError, Target, open_device_code

GPU_RE = re.compile(r"\A([0-9]+)\.([0-9])\Z")


def parse_gpu(gpu: str) -> tuple[int, int]:
    m = GPU_RE.match(gpu)
    if not m:
        raise ValueError(f"not a compute capability: {gpu!r} (write it as 12.1)")
    return int(m.group(1)), int(m.group(2))


def runs_on(target: Target, gpu: str) -> bool:
    """Whether a GPU of compute capability `gpu` ("12.1") can run this device code, by CUDA's rule (Programming
    Guide, "Binary Compatibility" and "Feature Set Compiler Targets")."""
    major, minor = parse_gpu(gpu)
    cc = major * 10 + minor
    t_major, t_minor = divmod(target.arch, 10)
    if target.arch == cc:
        return True
    if target.variant in (ARCH_SPECIFIC, UNKNOWN):
        return False
    if target.kind == "cubin" or target.variant == FAMILY:
        return t_major == major and t_minor <= minor
    return target.arch <= cc  # plain PTX


def usable(targets: list[Target], gpu: str) -> list[Target]:
    """The targets a GPU of this capability can run: cubins first, then PTX it must JIT."""
    ok = [t for t in targets if runs_on(t, gpu)]
    return sorted(ok, key=lambda t: (t.kind != "cubin", -t.arch))


def coverage(code: DeviceCode, gpus: list[str]) -> dict[str, GpuCoverage]:
    """Per GPU, the kernels that code of its major holds and no code it runs holds (read only as far as needed)."""
    entries = code.entries

    @functools.cache
    def names_of(i: int) -> frozenset[str] | None:
        return code.kernel_names(entries[i])

    loadable = [i for i, e in enumerate(entries) if not e.relocatable]
    out: dict[str, GpuCoverage] = {}
    for gpu in gpus:
        major = parse_gpu(gpu)[0]
        runnable = [i for i in loadable if runs_on(entries[i].target, gpu)]
        blocked = [i for i in loadable if entries[i].target.arch // 10 == major and not runs_on(entries[i].target, gpu)]
        if not blocked:
            out[gpu] = GpuCoverage()  # every piece of code of its major runs: nothing of that major is out of reach
            continue
        wanted: set[str] = set().union(*(names_of(i) or () for i in blocked))
        unread = {entries[i].target.name for i in blocked if names_of(i) is None}
        # What it runs is read until it covers the blocked code: the blocked code's containers first (nvcc writes
        # one per compiled file, so its kernels for other archs sit there), uncompressed first.
        containers = {entries[i].container for i in blocked}
        covered: set[str] = set()
        runnable_unread = False
        for i in sorted(runnable, key=lambda i: (entries[i].container not in containers,
                                                 bool(entries[i].flags & FLAG_COMPRESSED), i)):
            if not wanted - covered:
                break
            found = names_of(i)
            if found is None:
                unread.add(entries[i].target.name)
                runnable_unread = True
            else:
                covered |= found
        lacking = set() if runnable_unread else wanted - covered
        out[gpu] = GpuCoverage(None if unread else len(wanted), len(lacking),
                               tuple(sorted(lacking, key=lambda n: (len(n), n))[:2]),
                               tuple(sorted({entries[i].target.name for i in blocked
                                             if (names_of(i) or frozenset()) & lacking})),
                               tuple(sorted(unread)))
    return out


def read_extension(path: Path, gpus: list[str]) -> KernelExtension | None:
    """An ELF file's entry of the kernel record: its targets and coverage per GPU; None without device code."""
    code = open_device_code(path)
    if code is None:
        return None
    with code:
        loadable = sorted({e.target for e in code.entries if not e.relocatable})
        relocatable = sorted({e.target for e in code.entries if e.relocatable})
        if not (loadable or relocatable):
            return None
        try:
            per_gpu = coverage(code, gpus)
        except MemoryError:
            raise FatbinError("out of memory reading its kernel names") from None
    return KernelExtension(str(path), tuple(t.name for t in loadable if t.kind == "cubin"),
                           tuple(t.name for t in loadable if t.kind == "ptx"), tuple(t.name for t in relocatable),
                           per_gpu)
