"""What a GPU runs of a file's device code: CUDA's compatibility rule, and per kernel, which kernels
the code a GPU cannot run holds that no code it runs holds (coverage). Stdlib only; kernels.py
records and checks with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .fatbin import (ARCH_SPECIFIC, FAMILY, FLAG_COMPRESSED, UNKNOWN, DeviceCode, Entry, FatbinError, Target,
                     open_device_code, sort_key)

GPU_RE = re.compile(r"\A([0-9]+)\.([0-9])\Z")


def parse_gpu(gpu: str) -> tuple[int, int]:
    m = GPU_RE.match(gpu)
    if not m:
        raise ValueError(f"not a compute capability: {gpu!r} (write it as 12.1)")
    return int(m.group(1)), int(m.group(2))


def runs_on(target: Target, gpu: str) -> bool:
    """Whether a GPU of compute capability `gpu` ("12.1") can run this piece of device code.

    CUDA's compatibility rules (CUDA C++ Programming Guide, "Binary Compatibility" and "Feature
    Set Compiler Targets"): a cubin runs on its own arch; a plain cubin also on later minors of the
    same major; a family cubin (sm_120f) on later minors of its major too; an arch-specific one
    (sm_120a) only on its own arch. PTX is JIT-compiled for its own and every later arch, except
    arch-specific PTX (own arch only) and family PTX (its family only). A target whose kind could
    not be read counts only for its own arch."""
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


def _cover_order(entries: list[Entry], runnable: list[int], blocked: list[int]) -> list[int]:
    """The order in which to read what a GPU runs until it holds every kernel of what it cannot run:
    first the entries of the containers that hold the blocked code (nvcc writes one container per
    compiled file, so the same kernels for other archs sit beside them), uncompressed before
    compressed, then file order."""
    containers = {entries[i].container for i in blocked}
    return sorted(runnable, key=lambda i: (entries[i].container not in containers,
                                           bool(entries[i].flags & FLAG_COMPRESSED), i))


def coverage(code: DeviceCode, gpus: list[str]) -> dict[str, dict[str, Any]]:
    """Per GPU, the kernels that code of the GPU's major holds and no code the GPU runs holds.

    The answer per GPU: `kernels` (how many kernels the code of its major that it cannot run holds,
    None if unknown), `missing` (how many of them no code it runs holds), `examples` (two of those
    names, shortest first), `only_in` (the targets that hold them) and `unread` (targets of its
    major whose kernel names could not be read, which leaves the answer open). Only the entries of
    code a GPU cannot run, and what it runs until that covers them, are decompressed. Raises
    FatbinError for an entry that cannot be decoded."""
    entries = code.entries
    names: dict[int, frozenset[str] | None] = {}

    def names_of(i: int) -> frozenset[str] | None:
        if i not in names:
            names[i] = code.kernel_names(entries[i])
        return names[i]

    loadable = [i for i, e in enumerate(entries) if not e.relocatable]
    out: dict[str, dict[str, Any]] = {}
    for gpu in gpus:
        major = parse_gpu(gpu)[0]
        runnable = [i for i in loadable if runs_on(entries[i].target, gpu)]
        can = set(runnable)
        blocked = [i for i in loadable if entries[i].target.arch // 10 == major and i not in can]
        answer: dict[str, Any] = {"kernels": None, "missing": 0, "examples": [], "only_in": [], "unread": []}
        out[gpu] = answer
        if not blocked:
            continue  # every piece of code of its major runs: nothing of that major is out of reach
        wanted: set[str] = set()
        unread = set()
        for i in blocked:
            found = names_of(i)
            if found is None:
                unread.add(entries[i].target.name)
            else:
                wanted |= found
        covered: set[str] = set()
        runnable_unread = False
        for i in _cover_order(entries, runnable, blocked):
            if not wanted - covered:
                break
            found = names_of(i)
            if found is None:
                unread.add(entries[i].target.name)
                runnable_unread = True
            else:
                covered |= found
        lacking = set() if runnable_unread else wanted - covered
        answer.update(unread=sorted(unread), kernels=None if unread else len(wanted), missing=len(lacking),
                      examples=sorted(lacking, key=lambda n: (len(n), n))[:2],
                      only_in=sorted({entries[i].target.name for i in blocked if (names[i] or frozenset()) & lacking}))
    return out


def read_extension(path: Path, gpus: list[str]) -> tuple[list[Target], list[Target], dict[str, dict[str, Any]]] | None:
    """The targets of an ELF file (the loadable and the relocatable ones) and their per-kernel
    coverage of each GPU, or None without device code. Raises FatbinError for an ELF file that
    cannot be read."""
    code = open_device_code(path)
    if code is None:
        return None
    with code:
        loadable = sorted({e.target for e in code.entries if not e.relocatable}, key=sort_key)
        relocatable = sorted({e.target for e in code.entries if e.relocatable}, key=sort_key)
        try:
            return loadable, relocatable, coverage(code, gpus)
        except MemoryError:
            raise FatbinError("out of memory reading its kernel names") from None
