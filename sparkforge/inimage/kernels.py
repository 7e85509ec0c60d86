"""Which GPUs an image's CUDA extensions can run on, from what their fat binaries hold (fatbin.py).

Stdlib only: the image runs `python3 -I -B /opt/sparkforge/inimage kernels scan ROOT... --out FILE`, then
`... kernels check --home /opt/sparkforge`; the host imports it for the rule and the record. The targets alone
do not say whether a GPU runs an extension (vLLM's `_C` holds some SM12x kernels only as `sm_120a`, which a 12.1
cannot run), so per GPU the scan also finds the kernels of its major that no code it runs holds (coverage.py).
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from collections.abc import Collection

from .contract import GpuCoverage, KernelExtension, KernelRecord
from .coverage import parse_gpu, read_extension, usable
from .coverage import runs_on as runs_on  # the rule, re-exported: kernels.runs_on for the host too
from .fatbin import FatbinError, Target


def _is_library(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def library_files(root: Path) -> list[Path]:
    """Regular files named *.so or *.so.N under root, links not followed (no file twice)."""
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            if _is_library(name) and stat.S_ISREG(path.lstat().st_mode):
                found.append(path)
    return found


def distribution_files(name: str) -> list[Path] | None:
    """The shared libraries an installed Python distribution put on disk (None when not installed)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = [Path(str(dist.locate_file(item))) for item in dist.files or () if _is_library(item.name)]
    return sorted(path for path in paths if path.is_file() and not path.is_symlink())


def exempt(path: str, not_needed: Collection[str]) -> bool:
    """Whether the recipe says no listed GPU needs an extension, named by its file name up to the first dot."""
    return Path(path).name.split(".", 1)[0] in not_needed


def _read(path: Path, gpus: list[str]) -> KernelExtension | None:
    """One file's entry of the record (a file that cannot be read: with the reason), None without device code."""
    try:
        return read_extension(path, gpus)
    except (FatbinError, OSError, MemoryError, IndexError, struct.error, OverflowError) as exc:
        # The reader checks every size before use; the last three are the net under those checks.
        reason = (str(exc) if isinstance(exc, FatbinError) else exc.strerror or str(exc) if isinstance(exc, OSError)
                  else f"malformed device code ({type(exc).__name__})")
        return KernelExtension(str(path), (), (), error=" ".join(reason.split()))


def scan(paths: list[Path], gpus: list[str], not_needed: list[str] | tuple[str, ...] = (),
         dists: dict[str, list[Path]] | None = None) -> KernelRecord:
    """The kernel record of these files for these GPUs (files without device code only counted); `not_needed`
    is the recipe's kernels_not_needed, `dists` the files of each distribution whose extensions are counted."""
    read = [_read(path, gpus) for path in dict.fromkeys(paths)]
    extensions = [ext for ext in read if ext is not None]
    with_code = {e.path for e in extensions}
    counts = {name: sum(str(p) in with_code for p in dict.fromkeys(files)) for name, files in (dists or {}).items()}
    return KernelRecord(tuple(extensions), len(read) - len(extensions), tuple(gpus), tuple(sorted(not_needed)), counts)


def verdict(ext: KernelExtension, gpu: str) -> tuple[str, str]:
    """(state, what the table shows) of one extension on one GPU: `ok` (the best cubin it runs), `jit` (PTX only,
    `JIT compute_NN`), `relocatable` (nothing loaded from this file), `none`, `missing` (kernels only in code
    it cannot run), `partial` (code of its major it cannot run, with unreadable kernel names), `unreadable`."""
    if ext.error:
        return "unreadable", "unreadable"
    targets = [Target.parse(n) for n in ext.cubins + ext.ptx]
    if not targets and ext.relocatable:
        return "relocatable", "relocatable only"
    ok = usable(targets, gpu)
    if not ok:
        return "none", "NONE"
    blocked = [t for t in targets if t.arch // 10 == parse_gpu(gpu)[0] and not runs_on(t, gpu)]
    cov = ext.coverage.get(gpu)
    if cov is not None and cov.missing:
        return "missing", f"{cov.missing} missing"
    if blocked and (cov is None or cov.unread):
        return "partial", "partial?"
    if ok[0].kind == "ptx":
        return "jit", f"JIT {ok[0].name}"
    return "ok", ok[0].name


RUNS = ("ok", "jit", "relocatable")  # the states in which a GPU runs (or needs nothing of) an extension


def verdicts(ext: KernelExtension, gpus: list[str] | tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Per GPU, verdict(ext, gpu)."""
    return {gpu: verdict(ext, gpu) for gpu in gpus}


def _problem(ext: KernelExtension, gpu: str, state: str) -> str:
    """The one-line reason an extension fails a GPU."""
    cov = ext.coverage.get(gpu) or GpuCoverage()
    if state == "none":
        return f"no kernel for GPU {gpu} (it holds {', '.join(ext.cubins + ext.ptx)})"
    if state == "missing":
        examples = ", ".join(n if len(n) <= 100 else n[:97] + "..." for n in cov.examples)
        return (f"GPU {gpu} cannot run {cov.missing} kernels, which exist only in "
                f"{', '.join(cov.only_in)} (e.g. {examples})")
    blocked = [t.name for t in map(Target.parse, ext.cubins + ext.ptx)
               if t.arch // 10 == parse_gpu(gpu)[0] and not runs_on(t, gpu)]
    why = (f"the kernel names of {', '.join(cov.unread)} cannot be read" if cov.unread
           else "its kernels were not read for this GPU")
    return (f"GPU {gpu} may lack kernels: it cannot run {', '.join(blocked)}, and {why}")


def _runs(gpu: str, state: str, label: str, ext: KernelExtension) -> str:
    """What a GPU runs of an extension that passes, for the check's detail."""
    if state == "jit":
        return f"{gpu}: {label.removeprefix('JIT ')} PTX only, compiled by the driver at first start"
    if state == "relocatable":
        return f"{gpu}: nothing to load (only relocatable code: {', '.join(ext.relocatable)})"
    return f"{gpu}: {label}"


def check(record: KernelRecord, gpus: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(check, ok|failed|skipped, detail) per extension for gpus (default: the record's own)."""
    checks = []
    gpus = list(record.gpus) if gpus is None else gpus
    if not gpus:
        return [("kernels: GPUs to check", "skipped", "the plan lists no GPUs")]
    counts = record.dists
    if "vllm" in counts and not counts["vllm"]:
        checks.append(("kernels: vllm's extensions", "failed",
                       "vllm installed no extension with device code, yet the plan lists GPU "
                       f"{', '.join(gpus)} (a CPU-only vLLM; a recipe says `gpus: []` for that)"))
    for ext in record.extensions:
        path = ext.path
        if ext.error:
            checks.append((f"kernels {path}", "failed", f"cannot read its device code: {ext.error}"))
            continue
        runs = verdicts(ext, gpus)
        problems = [_problem(ext, g, state) for g, (state, _) in runs.items() if state not in RUNS]
        if problems and exempt(path, record.not_needed):
            checks.append((f"kernels {path}", "skipped",
                           "; ".join(problems) + "; not needed: listed in the recipe's kernels_not_needed"))
        elif problems:
            checks.append((f"kernels {path}", "failed", "; ".join(problems)))
        else:
            checks.append((f"kernels {path}", "ok", "; ".join(_runs(g, *runs[g], ext) for g in runs)))
    per_dist = "".join(f"; {name}: {n}" for name, n in sorted(counts.items()))
    checks.append(("kernels: extensions checked", "ok",
                   f"{len(record.extensions)} with device code, {record.without_device_code} without, "
                   f"for GPU {', '.join(gpus)}{per_dist}"))
    return checks


def check_home(home: Path, gpus: list[str] | None = None) -> list[tuple[str, str, str]]:
    """The checks of the kernels record under home against gpus (default: the record's own)."""
    path = home / "record" / "kernels.json"
    try:
        record = KernelRecord.from_json(path.read_bytes(), str(path))
        gpus = list(gpus or []) or list(record.gpus)
        for gpu in gpus:
            parse_gpu(gpu)
    except FileNotFoundError as exc:
        return [("kernels record present", "failed", str(exc))]
    except (OSError, ValueError) as exc:  # ContractError is a ValueError: the record's own line
        return [("kernels record readable", "failed", str(exc))]
    return check(record, gpus)
