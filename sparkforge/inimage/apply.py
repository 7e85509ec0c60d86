"""The applier: one mod against one tree gives one result (applied, already, failed), and a mod's
files are written only once every edit of it has succeeded. Used by the image build and check-mods."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from .contract import CheckState, ModKind, ModState, Result
from .files import one_entry_each, plan_files
from .patch import check_patch, plan_patch
from .patcher import PATCHER_TIMEOUT, literal_targets, plan_patcher
from .paths import ModFailure, asset, check_folder, inside, parts, read_file
from .run import VERIFY_TIMEOUT, python
from .seam import ModDoc


def check_paths(spec: ModDoc, folder: Path) -> None:
    """Refuse, before anything is read, every path of a mod spec that could leave its root."""
    check_folder(folder)
    for what, rel in (("patch", spec.patch), ("patcher", spec.patcher)):
        if rel:
            asset(folder, rel, what)
    for i, item in enumerate(spec.files):
        asset(folder, item.src, f"files[{i}].src")
    one_entry_each(spec, [tuple(parts(item.dest, f"files[{i}].dest", absolute_ok=True))
                          for i, item in enumerate(spec.files)])
    for i, check in enumerate(spec.verify):
        if check.file is not None:
            parts(check.file, f"verify[{i}].file", absolute_ok=True)


def check_static(spec: ModDoc, folder: Path) -> None:
    """Every refusal that needs no target tree (paths, the patch as git reads it, a literal TARGETS), before a build."""
    check_paths(spec, folder)
    if spec.kind == ModKind.PATCH and spec.patch:
        check_patch(read_file(asset(folder, spec.patch, "patch"), spec.patch))
    if spec.kind == ModKind.PATCHER and spec.patcher:
        for rel in literal_targets(asset(folder, spec.patcher, "patcher")):
            parts(rel, "patcher TARGETS entry")


def _named(rel: str | None, kind: ModKind) -> str:
    """The file a patch or patcher mod names; its kind says it has one."""
    if not rel:
        raise ModFailure(f"kind {kind.value} names no {kind.value} file")
    return rel


def write_all(writes: dict[Path, bytes], modes: dict[Path, int] | None = None) -> None:
    """Write every file to a temporary sibling first, then rename them all into place."""
    staged: list[tuple[Path, Path]] = []
    try:
        for target, body in writes.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
            mode = (modes or {}).get(target)
            if mode is None:
                mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
            os.chmod(name, mode)
            staged.append((Path(name), target))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, target in staged:
        os.replace(tmp, target)


def apply_mod(spec: ModDoc, folder: Path, root: Path, *, patcher_timeout: float = PATCHER_TIMEOUT) -> Result:
    """Apply one mod to the tree at root: applied, already applied, or failed (nothing written)."""
    modes: dict[Path, int] | None = None
    try:
        check_paths(spec, folder)
        if spec.kind == ModKind.PATCH:
            state, writes = plan_patch(read_file(asset(folder, _named(spec.patch, spec.kind), "patch")), root)
        elif spec.kind == ModKind.PATCHER:
            state, writes = plan_patcher(asset(folder, _named(spec.patcher, spec.kind), "patcher"), root,
                                         patcher_timeout)
        else:
            state, writes, modes = plan_files(spec, folder, root)
        if state == ModState.APPLIED:
            write_all(writes, modes)
        return Result(spec.name, state)
    except ModFailure as exc:
        return Result(spec.name, ModState.FAILED, str(exc))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return Result(spec.name, ModState.FAILED, f"{type(exc).__name__}: {exc}")


Check = tuple[str, CheckState, str]  # (what was checked, its state, the detail: why it failed or was skipped)


def verify_mod(spec: ModDoc, root: Path, *, in_image: bool, limit: float = VERIFY_TIMEOUT) -> list[Check]:
    """(check, ok|failed|skipped, detail) of each of a mod's verify checks; a python check has limit seconds."""
    out: list[Check] = []
    for i, check in enumerate(spec.verify):
        if check.python is not None:
            out.append(_verify_python(check.python, check.needs, root, in_image, limit))
            continue
        if check.file is None or check.contains is None:
            out.append((f"verify[{i}]", CheckState.FAILED, "a check is a file and what it contains, or python"))
            continue
        label = f"{check.file} contains {check.contains!r}"
        try:
            target = inside(root, check.file, f"verify[{i}].file", absolute_ok=True)
        except ModFailure as exc:
            out.append((label, CheckState.FAILED, str(exc)))
            continue
        if not target.is_file():
            out.append((label, CheckState.FAILED, f"{check.file} not found"))
        elif check.contains in read_file(target).decode("utf-8", errors="replace"):
            out.append((label, CheckState.OK, ""))
        else:
            out.append((label, CheckState.FAILED, "string not found"))
    return out


def _verify_python(code: str, needs: tuple[str, ...], root: Path, in_image: bool, limit: float) -> Check:
    label = f"python: {code}"
    if not in_image:
        return label, CheckState.SKIPPED, "runs only inside a built image"
    missing = [n for n in needs if importlib.util.find_spec(n) is None]
    if missing:
        return label, CheckState.SKIPPED, f"needs {', '.join(missing)}, not installed here"
    ok, _, tail = python(code, limit=limit, what="the check", cwd=root)
    return label, CheckState.OK if ok else CheckState.FAILED, tail


def component_root(component: str) -> Path:
    """Where an installed component's tree is rooted: the folder that holds its package."""
    if component == "image":
        return Path("/")
    spec = importlib.util.find_spec(component.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModFailure(f"component {component!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent
