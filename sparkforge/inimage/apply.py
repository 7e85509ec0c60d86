"""The applier: one mod against one tree gives one result (applied, already, failed), and a mod's
files are written only once every edit of it has succeeded. Used by the image build and check-mods."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .contract import CheckState, ModKind, ModState, Result
from .files import plan_files
from .patch import check_patch, plan_patch
from .patcher import PATCHER_TIMEOUT, literal_targets, plan_patcher
from .paths import ModFailure, asset, check_folder, inside, parts, read_file


def check_paths(spec: dict, folder: Path) -> None:
    """Refuse, before anything is read, every path of a mod spec that could leave its root."""
    check_folder(folder)
    for field in ("patch", "patcher"):
        if spec.get(field):
            asset(folder, spec[field], field)
    dests: dict[tuple[str, ...], int] = {}
    files = spec.get("files") or []
    for i, item in enumerate(files):
        asset(folder, item["src"], f"files[{i}].src")
        dest = tuple(parts(item["dest"], f"files[{i}].dest", absolute_ok=True))
        if dest in dests:
            first = dests[dest]
            raise ModFailure(f"files[{first}].dest ({files[first]['dest']}) and files[{i}].dest ({item['dest']}) name "
                             "one file; each file of a mod has one entry")
        dests[dest] = i
    for i, check in enumerate(spec.get("verify") or []):
        if check.get("file") is not None:
            parts(check["file"], f"verify[{i}].file", absolute_ok=True)


def check_static(spec: dict, folder: Path) -> None:
    """Every refusal that needs no target tree, so that the config stage can make it before any build:
    the spec's paths, the patch as git reads it (its file names, hunk counts, and nothing but text changes),
    a patcher's TARGETS when they are a literal."""
    check_paths(spec, folder)
    if spec.get("kind") == ModKind.PATCH.value and spec.get("patch"):
        check_patch(read_file(asset(folder, spec["patch"], "patch"), spec["patch"]))
    if spec.get("kind") == ModKind.PATCHER.value and spec.get("patcher"):
        for rel in literal_targets(asset(folder, spec["patcher"], "patcher")):
            parts(rel, "patcher TARGETS entry")


def write_all(writes: dict[Path, bytes], modes: dict[Path, int] | None = None) -> None:
    """Write every file to a temporary sibling first, then rename them all into place."""
    staged: list[tuple[Path, Path]] = []
    try:
        for target, body in writes.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
            mode = (modes or {}).get(target)
            if mode is None:
                mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
            os.chmod(tmp, mode)
            staged.append((Path(tmp), target))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, target in staged:
        os.replace(tmp, target)


def apply_mod(spec: dict, folder: Path, root: Path, *, patcher_timeout: float = PATCHER_TIMEOUT) -> Result:
    """Apply one mod to the tree at root: applied, already applied, or failed (nothing written)."""
    name = spec["name"]
    try:
        check_paths(spec, folder)
        modes = None
        if spec["kind"] == ModKind.PATCH.value:
            state, writes = plan_patch(read_file(asset(folder, spec["patch"], "patch")), root)
        elif spec["kind"] == ModKind.PATCHER.value:
            state, writes = plan_patcher(asset(folder, spec["patcher"], "patcher"), root, patcher_timeout)
        elif spec["kind"] == ModKind.FILES.value:
            state, writes, modes = plan_files(spec, folder, root)
        else:
            raise ModFailure(f"unknown kind {spec['kind']!r}")
        if state == ModState.APPLIED:
            write_all(writes, modes)
        return Result(name, state)
    except ModFailure as exc:
        return Result(name, ModState.FAILED, str(exc))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return Result(name, ModState.FAILED, f"{type(exc).__name__}: {exc}")


def verify_mod(spec: dict, root: Path, *, in_image: bool) -> list[tuple[str, CheckState, str]]:
    """Run a mod's verify checks: (check, ok|failed|skipped, detail) for each."""
    out = []
    for i, check in enumerate(spec.get("verify", [])):
        if check.get("python") is not None:
            out.append(_verify_python(check, root, in_image))
            continue
        label = f"{check['file']} contains {check['contains']!r}"
        try:
            target = inside(root, check["file"], f"verify[{i}].file", absolute_ok=True)
        except ModFailure as exc:
            out.append((label, CheckState.FAILED, str(exc)))
            continue
        if not target.is_file():
            out.append((label, CheckState.FAILED, f"{check['file']} not found"))
        elif check["contains"] in read_file(target).decode("utf-8", errors="replace"):
            out.append((label, CheckState.OK, ""))
        else:
            out.append((label, CheckState.FAILED, "string not found"))
    return out


def _verify_python(check: dict, root: Path, in_image: bool) -> tuple[str, CheckState, str]:
    label = f"python: {check['python']}"
    if not in_image:
        return label, CheckState.SKIPPED, "runs only inside a built image"
    missing = [n for n in check.get("needs", []) if importlib.util.find_spec(n) is None]
    if missing:
        return label, CheckState.SKIPPED, f"needs {', '.join(missing)}, not installed here"
    proc = subprocess.run([sys.executable, "-c", check["python"]], capture_output=True, text=True, cwd=root)
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return label, CheckState.OK if proc.returncode == 0 else CheckState.FAILED, tail


def component_root(component: str) -> Path:
    """Where an installed component's tree is rooted: the folder that holds its package."""
    if component == "image":
        return Path("/")
    spec = importlib.util.find_spec(component.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModFailure(f"component {component!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent
