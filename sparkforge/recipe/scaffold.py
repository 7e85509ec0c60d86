"""A patch mod written by hand: `mod new NAME --variant V` makes mods/NAME/mod.yaml and build/mod-src/NAME, a git
work tree of the pristine source; `mod save NAME` writes NAME.patch from `git diff` against it.

git runs without the user's or the system's configuration, within a time limit, and through an index of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from collections.abc import Callable

from .. import inimage
from ..errors import BuildError, ConfigError, Hint
from ..files import write_atomic
from ..inimage.paths import asset
from ..inimage.proc import CommandError, TimedOut, run
from .config import mod_yaml_text, read_text, read_yaml
from .layout import PROJECT_ROOT, Layout
from .plan import Plan, rehash
from .planner import load_fitting_mod
from .remote import check_diff, verify_check
from .fields import NAME_RE, specifier_error
from .sources import scratch_copy

WORK_ROOT = PROJECT_ROOT / "build" / "mod-src"
META = "sparkforge-mod.json"  # in the work tree's .git: what the tree is, for `mod save`
GIT_TIMEOUT = 600.0  # seconds for one git command on a whole vLLM tree (about 3000 files)
# What running Python in the tree leaves: never part of a patch. Every other new file is, also one that the
# source's own .gitignore names (a file dropped without a word would be a patch that does less than shown).
_BYTECODE = (":(exclude)*.py[co]", ":(exclude)*/__pycache__/*", ":(exclude)__pycache__/*")
_EMPTY_VERIFY = re.compile(r"^verify:[ \t]*\[\][^\n]*$", re.MULTILINE)


@dataclass(frozen=True)
class WorkTree:
    """The work tree of a local mod: which mod, variant and component it is for, and its pristine commit."""

    mod: str
    variant: str
    component: str
    source: str  # what the tree is, as check-mods names it: "vllm 0.17.0 (PyPI)"
    path: Path
    pristine: str  # the commit the patch is written against: the source as fetched, with `applied` on it
    applied: str = ""  # the variant's mods applied before this one, in the build's order ("" for none)


@dataclass(frozen=True)
class SavedPatch:
    """What `mod save` wrote: the patch, the files it changes, and the verify check it filled in (if any)."""

    patch: Path
    files: tuple[str, ...]
    verify: dict[str, str] | None


def check_new(mods_dir: Path, name: str, versions: str, work_root: Path = WORK_ROOT) -> None:
    """Refuse, before anything is fetched, a name that is not one or is taken, and a bad version range."""
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a mod name (lowercase letters, digits and '-')", field="NAME")
    for taken in (mods_dir / name, work_root / name):
        if taken.exists() or taken.is_symlink():
            raise ConfigError("already exists: choose another name, or remove it", path=taken)
    if problem := specifier_error(versions):
        raise ConfigError(problem, field="--versions")


def new_local_mod(mods_dir: Path, name: str, *, variant: str, component: str, phase: str, versions: str,
                  tree: Path, source: str, work_root: Path = WORK_ROOT,
                  earlier: Callable[[Path], str] | None = None) -> WorkTree:
    """Write mods/NAME/mod.yaml and the work tree of `tree` (a pristine cached source); all or nothing. `earlier`
    applies the mods the build applies before this one and names them, so the patch fits where the build is."""
    check_new(mods_dir, name, versions, work_root)
    text = _mod_yaml(name, component=component, phase=phase, versions=versions, source=source, work=work_root / name)
    work_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=work_root))
    folder = mods_dir / name
    try:
        copy = scratch_copy(tree, staging / "tree")
        _git(copy, "init", "--quiet")
        _git(copy, "add", "--all", "--force", ".")  # every pristine file, also those its .gitignore names
        _git(copy, "commit", "--quiet", "--no-verify", "--allow-empty", "-m", f"{source}, as fetched (pristine)")
        applied = earlier(copy) if earlier is not None else ""
        if applied:
            _git(copy, "add", "--all", "--force", ".")
            _git(copy, "commit", "--quiet", "--no-verify", "--allow-empty", "-m",
                 f"with the mods {variant} applies before this one: {applied}")
        pristine = _git(copy, "rev-parse", "HEAD").decode().strip()
        work = WorkTree(name, variant, component, source, work_root / name, pristine, applied)
        (copy / ".git" / META).write_text(json.dumps({k: v for k, v in asdict(work).items() if k != "path"}) + "\n")
        folder.mkdir(parents=True)  # fails when it appeared meanwhile: nothing of another is touched
        try:
            (folder / "mod.yaml").write_text(text, encoding="utf-8")
            os.replace(copy, work.path)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return work


def _mod_yaml(name: str, *, component: str, phase: str, versions: str, source: str, work: Path) -> str:
    """mod.yaml of a new local mod: each required field, with what it means."""
    shown = work.relative_to(Path.cwd()) if work.is_relative_to(Path.cwd()) else work
    where = ("the installed package: the folder that holds vllm/ (site-packages in the image)" if phase == "install"
             else "the source tree before the compile: the checkout's root (setup.py, csrc/, vllm/)")
    return f"""\
# A patch mod, made by `mod new` against {source}. Every field below is required.
# Edit the pristine source in {shown} (a git work tree), then run `mod save {name}`:
# it writes {name}.patch from `git diff` there and checks the mod as check-mods does.
name: {name}  # the mod's name, the same as its folder's
summary: "(one line: what the patch changes)"  # one line, shown in tables
description: |  # what it changes and why this image needs it; where the facts come from
  (Say what the patch changes, why, and which release source was read.)
component: {component}  # what it patches: vllm, image, or a component of the variant
targets:
  versions: {json.dumps(versions)}  # the releases it is known to apply to (PEP 440); check-mods --matrix tries others
phase: {phase}  # install: {where}
kind: patch  # a unified diff, applied by `git apply`; the others are patcher (Python) and files (drop-in)
patch: {name}.patch  # written by `mod save`; its paths are relative to the tree's root: a/vllm/...
verify: []  # checks that the patch took effect; while this is [], `mod save` writes one (a line the patch adds)
"""


def read_work_tree(name: str, work_root: Path = WORK_ROOT) -> WorkTree:
    """The work tree `mod new` made for mod `name`; one line when there is none."""
    path = work_root / name
    meta = path / ".git" / META
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a mod name (lowercase letters, digits and '-')", field="NAME")
    if not meta.is_file():
        raise ConfigError(f"no work tree of mod {name} here", path=path,
                          hint=Hint("make one with", ("mod", "new", name, "--variant", "VARIANT")))
    try:
        data = json.loads(read_text(meta))
        return WorkTree(data["mod"], data["variant"], data["component"], data["source"], path, data["pristine"],
                        str(data.get("applied") or ""))
    except (ValueError, KeyError, TypeError):
        raise ConfigError("is not what `mod new` wrote; make the work tree again", path=meta) from None


def save_patch(mods_dir: Path, work: WorkTree) -> SavedPatch:
    """Write mods/NAME/NAME.patch from the work tree's changes (and, for `verify: []`, one check), or nothing."""
    meta = mods_dir / work.mod / "mod.yaml"
    data = read_yaml(meta)
    if not isinstance(data, dict):
        raise ConfigError("mod.yaml must be a YAML mapping", path=meta)
    patch = data.get("patch")
    if data.get("kind") != "patch" or not isinstance(patch, str):
        raise ConfigError("`mod save` writes the patch of a patch mod that names its file (kind: patch, patch: "
                          "FILE)", path=meta, field="patch")
    diff = _diff(work)
    if not diff:
        raise ConfigError(f"no change since the pristine source yet: edit the files there, then run `mod save "
                          f"{work.mod}` again", path=work.path)
    try:
        files = tuple(fp.path for fp in check_diff(diff))
    except inimage.ModFailure as exc:
        raise ConfigError(f"git diff holds what a patch mod cannot do: {exc}", path=work.path) from None
    text, check = read_text(meta), None
    if data.get("verify") == []:
        check = verify_check(diff, work.component)
        if check is None:
            raise ConfigError("the patch adds and removes no line a check could look for; write a verify check "
                              "by hand", path=meta, field="verify")
        data["verify"] = [check]
        line = "verify:\n  - {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in check.items()) + "}"
        text, found = _EMPTY_VERIFY.subn(lambda m: line, text, count=1)
        if not found:
            raise ConfigError("has no check, and no `verify: []` line for `mod save` to fill in: write one by hand",
                              path=meta, field="verify")
    mod_yaml_text(data, meta)  # the mod as it will be, checked against the schema before anything is written
    try:
        target = asset(mods_dir / work.mod, patch, "patch")
    except inimage.ModFailure as exc:
        raise ConfigError(str(exc), path=meta, field="patch") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, diff)
    if check is not None:
        write_atomic(meta, text.encode("utf-8"))
    return SavedPatch(target, files, check)


def _diff(work: WorkTree) -> bytes:
    """`git diff` of the tree as it is now (new files too) against its pristine commit, a/ b/ prefixed."""
    fd, index = tempfile.mkstemp(prefix="index.", dir=work.path / ".git")
    os.close(fd)
    try:
        env = {"GIT_INDEX_FILE": index}
        _git(work.path, "read-tree", work.pristine, env=env)
        _git(work.path, "add", "--all", "--force", "--", ".", *_BYTECODE, env=env)  # every new file but bytecode
        return _git(work.path, "diff", "--cached", "--no-renames", "--no-color", "--no-ext-diff", "--no-textconv",
                    "--src-prefix=a/", "--dst-prefix=b/", work.pristine, env=env)
    finally:
        Path(index).unlink(missing_ok=True)


def _git(tree: Path, *args: str, env: dict[str, str] | None = None) -> bytes:
    """One git command in tree, without the user's or the system's git configuration; its output."""
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tree), "LC_ALL": "C",
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
               "GIT_AUTHOR_NAME": "sparkforge", "GIT_AUTHOR_EMAIL": "sparkforge@localhost",
               "GIT_COMMITTER_NAME": "sparkforge", "GIT_COMMITTER_EMAIL": "sparkforge@localhost", **(env or {})}
    command = ["git", "-c", "init.defaultBranch=pristine", "-c", "core.autocrlf=false", "-c", "core.safecrlf=false",
               "-C", str(tree), *args]
    try:
        proc = run(command, what=f"git {args[0]}", capture_output=True, env=environ, timeout=GIT_TIMEOUT,
                   stdin=subprocess.DEVNULL)
    except TimedOut:
        raise BuildError(f"git {args[0]} gave no answer within {GIT_TIMEOUT:.0f}s", path=tree, field="git") from None
    except CommandError:
        raise BuildError("git is not installed here; a local mod's work tree needs it", field="git") from None
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit code {proc.returncode}"]
        raise BuildError(f"git {args[0]} failed: {why[-1]}", path=tree, field="git")
    return proc.stdout


def with_mod(plan: Plan, layout: Layout, name: str) -> Plan:
    """The plan with mod `name` (one no recipe lists yet) after its own mods, checked as a recipe's mods are."""
    if any(m.name == name for m in plan.mods):
        return plan
    mod = load_fitting_mod(layout.mods_dir, name, plan.vllm, plan.components, Path(plan.recipe_files[0]))
    return rehash(replace(plan, mods=(*plan.mods, mod)))
