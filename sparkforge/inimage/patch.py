"""Patch mods, applied by `git apply` itself on a private copy of the files the patch names.

Both directions are asked (`git apply --check` and `git apply -R --check`): when only the forward one
takes the patch, it is applied; when only the reverse one does, it was applied already; when neither
does, it fails with git's own words. When both do (git looks for a hunk's context away from its line
too), the direction whose hunks stand nearer their own lines wins; a diff without context is decided
by its hunks (pure insertions are already there when the reverse takes them, pure deletions are still
to do when the forward does); anything else is refused as ambiguous rather than guessed. git runs in a
temporary folder holding copies of the named files only (regular files, confined to the tree),
with no repository above it and no user or system configuration, within a time limit; the tree
itself is written only once git has succeeded, by the applier's all-or-nothing writer.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from .contract import ModState
from .diff import FilePatch, parse_diff, zero_context
from .paths import ModFailure, inside, read_file

GIT_TIMEOUT = 60.0  # seconds for each run of git apply


def plan_patch(diff: bytes, root: Path, *, timeout: float = GIT_TIMEOUT) -> tuple[ModState, dict[Path, bytes]]:
    """Decide the state of a diff against root and compute the new file contents (nothing written)."""
    patches = parse_diff(diff)
    if len({fp.prefixed for fp in patches}) > 1:
        raise ModFailure("some file names of the diff carry the a/ b/ prefixes and some not")
    targets = {fp.path: inside(root, fp.path, "patch header") for fp in patches}
    for fp in patches:
        if not fp.create and not targets[fp.path].exists():
            raise ModFailure(f"{fp.path}: file to patch not found")
    flags = [f"-p{1 if patches[0].prefixed else 0}"] + (["--unidiff-zero"] if zero_context(patches) else [])
    with tempfile.TemporaryDirectory(prefix="sparkforge-patch-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        before = _copy_in(targets, work)
        (Path(tmp) / "mod.patch").write_bytes(diff)
        run = _git(Path(tmp), timeout)
        forward = run(["apply", "--check", "-v", *flags, "../mod.patch"])
        reverse = run(["apply", "-R", "--check", "-v", *flags, "../mod.patch"])
        if forward.returncode != 0:
            if reverse.returncode == 0:
                return ModState.ALREADY, {}
            raise ModFailure(_reason(forward.stderr, patches, tmp))
        if reverse.returncode == 0 and _both_ways(patches, forward.stderr, reverse.stderr) == ModState.ALREADY:
            return ModState.ALREADY, {}
        applied = run(["apply", *flags, "../mod.patch"])
        if applied.returncode != 0:
            raise ModFailure(_reason(applied.stderr, patches, tmp))
        found = {p.relative_to(work).as_posix() for p in work.rglob("*") if not p.is_dir()}
        if found - set(targets):  # git read a section the headers above do not show: apply none of it
            raise ModFailure(f"git apply changed files the diff's headers do not name: {sorted(found - set(targets))}")
        writes = {}
        for rel, target in targets.items():
            copy = work / rel
            if not copy.is_file():
                raise ModFailure(f"{rel}: git apply left no file here")
            body = copy.read_bytes()
            if body != before.get(rel):
                writes[target] = body
    return ModState.APPLIED, writes


_OFFSET = re.compile(rb"^Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)", re.M)


def _both_ways(patches: list[FilePatch], forward: bytes, reverse: bytes) -> ModState:
    """The state of a diff that git takes both forward and in reverse (from their `-v` reports)."""
    hunks = [h for fp in patches for h in fp.hunks]
    if zero_context(patches):
        if all(h.old_count == 0 for h in hunks):  # only insertions: forward always finds their line
            return ModState.ALREADY
        if all(h.new_count == 0 for h in hunks):  # only deletions: reverse always finds their line
            return ModState.APPLIED
    else:
        ahead, back = (sum(abs(int(k)) for k in _OFFSET.findall(out)) for out in (forward, reverse))
        if ahead != back:
            return ModState.APPLIED if ahead < back else ModState.ALREADY
    names = ", ".join(dict.fromkeys(fp.path for fp in patches))
    raise ModFailure(f"{names}: the patch applies both forward and in reverse, as far from its lines either way; "
                     "cannot tell whether it is applied (give the hunks more context)")


def _copy_in(targets: dict[str, Path], work: Path) -> dict[str, bytes]:
    """Copy the files the patch names into work, by their names in the patch; refuse any that is
    not a regular file (the paths were resolved by inside(), so no link is followed out)."""
    found = {}
    for rel, target in targets.items():
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise ModFailure(f"{rel}: not a regular file; a patch mod changes the text of regular files")
        found[rel] = read_file(target)
        copy = work / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(found[rel])
    return found


def _git(home: Path, timeout: float):
    """A runner of git in home/tree that finds no repository above it and reads no configuration."""
    git = shutil.which("git")
    if git is None:
        raise ModFailure("git is not installed here; patch mods are applied with `git apply` (install git)")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": str(home),
           "GIT_CEILING_DIRECTORIES": str(home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}

    def run(args: list[str]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([git, *args], cwd=home / "tree", env=env, capture_output=True,
                                  stdin=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ModFailure(f"git apply did not finish within {timeout:g} s; stopped") from None
    return run


_FAILED_AT = re.compile(r"patch failed: (.+):(\d+)$")


def _reason(stderr: bytes, patches: list[FilePatch], tmp: str) -> str:
    """git's refusal in one short line; a failed hunk is named by its header."""
    lines = [line.removeprefix("error: ").strip() for line in stderr.decode("utf-8", "replace").splitlines()]
    lines = [line.replace(tmp + "/", "") for line in lines if line and not line.startswith(("warning:", "hint:"))]
    for line in lines:
        m = _FAILED_AT.match(line)
        if m:
            rel, start = m.group(1), int(m.group(2))
            hunk = next((h for fp in patches if fp.path == rel for h in fp.hunks if h.old_start == start), None)
            if hunk is not None:
                return f"{rel}: hunk {hunk.header} does not match the file (git apply: patch failed at line {start})"
    text = "; ".join(dict.fromkeys(lines)) or "failed without a message"
    return "git apply: " + (text if len(text) <= 400 else text[:397] + "...")
