"""Patch mods, applied by `git apply` itself on a private copy of the files the patch names.

What the diff does is git's reading of it (`git apply --numstat --summary`), not a second parser's: anything
beyond changing or creating the text of a regular file is refused, as is a diff git reads otherwise than its
`---`/`+++` sections show (diff.py) and one naming a file twice. git runs in a temporary folder holding copies of
the named files only, with no repository above it, no configuration and a time limit; what it leaves is read
without following a link, and the tree is written only once git has succeeded (the applier's writer).

Both directions are asked (`git apply --check`, and with -R): only forward is to apply, only reverse is applied
already, neither is git's own refusal. Both (git looks for a hunk's lines away from their place too): the
direction whose hunks stand nearer wins, a diff without context is decided at each hunk's own place, and
anything else is refused as ambiguous.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .contract import ModState
from .diff import FilePatch, Hunk, lines_of, parse_diff, prefix_flag, zero_context
from .paths import ModFailure, kind_of, parts, read_file, regular, unlinked
from .run import TimeLimit, run

GIT_TIMEOUT = 60.0  # seconds for each run of git apply
_PATCH = "../mod.patch"  # the diff, beside the private tree git runs in


@dataclass(frozen=True)
class Change:
    """One section of a diff as `git apply --numstat --summary` reads it."""

    path: str  # relative to the tree: no empty, '.' or '..' segment
    added: int
    deleted: int
    create: bool  # git makes it as a new regular file

    @property
    def sectioned(self) -> bool:
        """Whether it stands in the diff as a ---/+++ section (all but a new empty file of a git diff)."""
        return bool(self.added or self.deleted or not self.create)


def check_patch(diff: bytes, *, timeout: float = GIT_TIMEOUT) -> None:
    """Every refusal that needs no tree: the reader's, and git's where git is installed here (else the image's)."""
    sections = parse_diff(diff)
    if shutil.which("git") is not None:
        with _Private(diff, timeout) as git:
            _changes(git, _flags(sections), sections)


def plan_patch(diff: bytes, root: Path, *, timeout: float = GIT_TIMEOUT) -> tuple[ModState, dict[Path, bytes]]:
    """Decide the state of a diff against root and compute the new file contents (nothing written)."""
    sections = parse_diff(diff)
    flags = _flags(sections)
    with _Private(diff, timeout) as git:
        changes = _changes(git, flags, sections)
        targets = _targets(changes, root)
        work = Path(git.tree)
        before, modes = _copy_in(targets, {c.path for c in changes if c.create}, work)
        pairs = list(zip([c.path for c in changes if c.sectioned], sections))
        forward = git(["apply", "--check", "-v", *flags, _PATCH])
        reverse = git(["apply", "-R", "--check", "-v", *flags, _PATCH])
        if forward.returncode != 0:
            if reverse.returncode == 0:
                return ModState.ALREADY, {}
            raise ModFailure(_reason(forward.stderr, pairs, git.home))
        if reverse.returncode == 0 and _both_ways(pairs, before, forward.stderr, reverse.stderr) == ModState.ALREADY:
            return ModState.ALREADY, {}
        applied = git(["apply", *flags, _PATCH])
        if applied.returncode != 0:
            raise ModFailure(_reason(applied.stderr, pairs, git.home))
        after = _results(work, set(targets), modes)
    return ModState.APPLIED, {targets[rel]: body for rel, body in after.items() if body != before.get(rel)}


def _flags(sections: list[FilePatch]) -> list[str]:
    return [prefix_flag(sections)] + (["--unidiff-zero"] if sections and zero_context(sections) else [])


# ------------------------------------------------------------------ what git reads


_NUMSTAT = re.compile(rb"(\d+|-)\t(\d+|-)\t([^\0]*)\0")
# What --summary says beyond the text. A traditional diff gives no modes: its " create NAME" is a new
# regular file (or, for a context-free hunk, a change of the file if it exists); its " delete NAME" is
# a deletion (+++ /dev/null) or, for a context-free hunk, no deletion at all: the files git leaves tell.
_CREATE = re.compile(r" create (?:mode 100644 )?(?!mode )(.+)")
_TEXT_ONLY = re.compile(r" rewrite .+ \(\d+%\)| delete (?!mode ).+")
_REFUSED = ((" create mode 120000 ", "a new link"), (" create mode ", "a new file with a mode other than 100644"),
            (" delete mode ", "a file deletion"), (" rename ", "a rename"), (" copy ", "a copy"),
            (" mode change ", "a file mode change"))


def _changes(git: _Private, flags: list[str], sections: list[FilePatch]) -> list[Change]:
    """The diff's sections as git reads them; refused beyond a text change of a regular file (or a new one), for a
    name outside the tree, and when git reads other sections than the `---`/`+++` headers show."""
    listed = git(["apply", "--numstat", "--summary", "-z", *flags, _PATCH])
    if listed.returncode != 0:
        raise ModFailure(_reason(listed.stderr, [], git.home))
    rows, pos = [], 0
    while m := _NUMSTAT.match(listed.stdout, pos):
        rows.append((m.group(1), m.group(2), _git_name(m.group(3))))
        pos = m.end()
    created: list[str] = []
    for line in listed.stdout[pos:].decode("utf-8", "replace").splitlines():
        made = _CREATE.fullmatch(line)
        if made:
            created.append(made.group(1))
        elif not _TEXT_ONLY.fullmatch(line):
            what = next((w for prefix, w in _REFUSED if line.startswith(prefix)), "a change")
            raise ModFailure(f"{what} ({line.strip()}, as git apply reads the diff) is not supported; a patch mod "
                             "changes the text of regular files only")
    changes = []
    for added, deleted, name in rows:
        if added == b"-":
            raise ModFailure(f"{name}: a binary file change is not supported; a patch mod changes the text of "
                             "regular files only")
        create = name in created
        if create:
            created.remove(name)
        changes.append(Change("/".join(parts(name, "patch header")), int(added), int(deleted), create))
    if not changes:
        raise ModFailure("the patch file holds no file changes")
    if [(c.added, c.deleted) for c in changes if c.sectioned] != [(fp.added, fp.deleted) for fp in sections]:
        git_reads = ", ".join(f"{c.path} +{c.added} -{c.deleted}" for c in changes if c.sectioned)
        headers = ", ".join(f"{fp.path} +{fp.added} -{fp.deleted}" for fp in sections)
        raise ModFailure(f"git apply reads other sections in the diff ({git_reads or 'none'}) than its ---/+++ "
                         f"headers show ({headers or 'none'}); write it with `git diff` or `diff -u`")
    return changes


def _git_name(raw: bytes) -> str:
    """A file name as git read it from the diff: UTF-8 without control characters, else ModFailure."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ModFailure(f"a file name of the diff is not UTF-8: {raw.decode('utf-8', 'backslashreplace')}") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise ModFailure(f"a file name of the diff holds a control character: {name!r}")
    return name


# ------------------------------------------------------------------ the private copy


def _targets(changes: list[Change], root: Path) -> dict[str, Path]:
    """Each file the diff names in root, reached through no link; refused for two names of one file (hard links)."""
    targets: dict[str, Path] = {}
    seen: dict[tuple[int, int], str] = {}
    for change in changes:
        if change.path in targets:
            continue  # one name in two sections: git applies them in turn
        target = unlinked(root, change.path, "patch header")
        try:
            st = os.lstat(target)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        first = change.path if st is None else seen.setdefault((st.st_dev, st.st_ino), change.path)
        if first != change.path:
            raise ModFailure(f"the diff names one file twice, as {first} and as {change.path} "
                             "(two names of one file); name each file once")
        targets[change.path] = target
    return targets


def _copy_in(targets: dict[str, Path], created: set[str], work: Path) -> tuple[dict[str, bytes], dict[str, int]]:
    """Copy the files the patch names into work with their modes, refusing any that is not a regular file."""
    found, modes = {}, {}
    for rel, target in targets.items():
        try:
            mode = os.lstat(target).st_mode
        except (FileNotFoundError, NotADirectoryError):
            if rel not in created:
                raise ModFailure(f"{rel}: file to patch not found") from None
            _check_folders(target, rel)
            continue
        found[rel], modes[rel] = read_file(target, rel), stat.S_IMODE(mode)  # a regular file, or refused
        copy = work / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(found[rel])
        os.chmod(copy, modes[rel])
    return found, modes


def _check_folders(target: Path, rel: str) -> None:
    """Refuse a new file whose folder is something else on disk (a file, a FIFO)."""
    parent = target.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    mode = os.lstat(parent).st_mode
    if not stat.S_ISDIR(mode):
        raise ModFailure(f"{rel}: {kind_of(mode)} stands where its folder belongs")


def _results(work: Path, names: set[str], modes: dict[str, int]) -> dict[str, bytes]:
    """The files git left in work, read through no link: regular files the diff names, none gone, modes kept."""
    found = {}
    for parent, dirs, files in os.walk(work):
        for name in dirs + files:
            path = Path(parent, name)
            rel = path.relative_to(work).as_posix()
            mode = os.lstat(path).st_mode
            if name in dirs and stat.S_ISDIR(mode):
                continue
            if rel not in names:
                raise ModFailure(f"git apply changed files the diff's headers do not name: {rel}")
            regular(mode, f"{rel}, as git apply left it,")
            if mode & stat.S_IXUSR != modes.get(rel, 0) & stat.S_IXUSR:  # git keeps or sets no other bit
                raise ModFailure(f"{rel}: git apply would change its mode to {stat.S_IMODE(mode):o}; a patch mod "
                                 "changes the text of files only")
            found[rel] = read_file(path, rel)
    missing = sorted(names - set(found))
    if missing:
        raise ModFailure(f"{missing[0]}: git apply deletes this file; a patch mod changes the text of files only "
                         "(a file deletion)")
    return found


class _Private:
    """A temporary folder holding mod.patch and tree/, and a runner of git there that sees no repository or config."""

    def __init__(self, diff: bytes, timeout: float) -> None:
        git = shutil.which("git")
        if git is None:
            raise ModFailure("git is not installed here; patch mods are applied with `git apply` (install git)")
        self.git, self.timeout = git, timeout
        self.home = tempfile.mkdtemp(prefix="sparkforge-patch-")
        self.tree = os.path.join(self.home, "tree")
        try:
            os.mkdir(self.tree)
            Path(self.home, "mod.patch").write_bytes(diff)
        except BaseException:
            shutil.rmtree(self.home, ignore_errors=True)
            raise
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": self.home,
                    "GIT_CEILING_DIRECTORIES": self.home, "GIT_CONFIG_NOSYSTEM": "1",
                    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}

    def __call__(self, args: list[str]) -> subprocess.CompletedProcess[bytes]:
        try:
            return run([self.git, *args], limit=self.timeout, what="git apply", cwd=self.tree, env=self.env)
        except TimeLimit as exc:
            raise ModFailure(str(exc)) from None

    def __enter__(self) -> _Private:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


# ------------------------------------------------------------------ both directions


_OFFSET = re.compile(rb"^Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)", re.M)


def _both_ways(pairs: list[tuple[str, FilePatch]], before: dict[str, bytes], forward: bytes,
               reverse: bytes) -> ModState:
    """The state of a diff that git takes both forward and in reverse (see the module's docstring)."""
    if zero_context([fp for _, fp in pairs]):
        state = _own_place(pairs, before)
        if state is not None:
            return state
    else:
        ahead, back = (sum(abs(int(k)) for k in _OFFSET.findall(out)) for out in (forward, reverse))
        if ahead != back:
            return ModState.APPLIED if ahead < back else ModState.ALREADY
    names = ", ".join(dict.fromkeys(rel for rel, _ in pairs))
    raise ModFailure(f"{names}: the patch applies both forward and in reverse, as far from its lines either way; "
                     "cannot tell whether it is applied (give the hunks more context)")


def _own_place(pairs: list[tuple[str, FilePatch]], before: dict[str, bytes]) -> ModState | None:
    """A context-free diff's state from whether its hunks' new or old lines stand at each hunk's own place; None
    when the hunks disagree, or a file has more than one section (their places shift)."""
    if len({rel for rel, _ in pairs}) < len(pairs):
        return None
    states = {_hunk_state(h, lines_of(before.get(rel, b""))) for rel, fp in pairs for h in fp.hunks}
    return states.pop() if len(states) == 1 else None


def _hunk_state(hunk: Hunk, lines: list[bytes]) -> ModState | None:
    old_here = bool(hunk.old) and lines[hunk.old_start - 1:hunk.old_start - 1 + len(hunk.old)] == list(hunk.old)
    new_here = bool(hunk.new) and lines[hunk.new_start - 1:hunk.new_start - 1 + len(hunk.new)] == list(hunk.new)
    if not hunk.old:
        return ModState.ALREADY if new_here else ModState.APPLIED
    if not hunk.new:
        return ModState.APPLIED if old_here else ModState.ALREADY
    return None if old_here == new_here else ModState.APPLIED if old_here else ModState.ALREADY


# ------------------------------------------------------------------ git's words


_FAILED_AT = re.compile(r"patch failed: (.+):(\d+)$")


def _reason(stderr: bytes, pairs: list[tuple[str, FilePatch]], home: str) -> str:
    """git's refusal in one short line; a failed hunk is named by its header."""
    lines = [line.removeprefix("error: ").strip() for line in stderr.decode("utf-8", "replace").splitlines()]
    lines = [line.replace(home + "/", "") for line in lines if line and not line.startswith(("warning:", "hint:"))]
    for line in lines:
        m = _FAILED_AT.match(line)
        if m:
            rel, start = "/".join(p for p in m.group(1).split("/") if p not in ("", ".")), int(m.group(2))
            hunk = next((h for name, fp in pairs if name == rel for h in fp.hunks if h.old_start == start), None)
            if hunk is not None:
                return f"{rel}: hunk {hunk.header} does not match the file (git apply: patch failed at line {start})"
    text = "; ".join(dict.fromkeys(lines)) or "failed without a message"
    return "git apply: " + (text if len(text) <= 400 else text[:397] + "...")
