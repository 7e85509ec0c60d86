"""Unified diffs as text: the `---`/`+++` sections, their hunks, and the lines git would drop.

What a diff does to files is git's to say (patch.py compares git's reading with this one's). This reader checks
the text: every hunk matches its header's counts, a header name stays inside the tree, and a `diff -r` line git
would skip (`Binary files ... differ`, `Only in`) is refused rather than dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .paths import ModFailure, parts


@dataclass(frozen=True)
class Hunk:
    """One hunk; its lines keep their line ends (none where the diff says "No newline at end of file")."""

    header: str
    old_start: int
    new_start: int
    old: tuple[bytes, ...]
    new: tuple[bytes, ...]
    context: int  # context lines in all


@dataclass(frozen=True)
class FilePatch:
    """One `---`/`+++` section with its hunks."""

    path: str  # the name git picks from the two header names, without the a/ b/ prefix
    hunks: tuple[Hunk, ...]
    prefixed: bool = True  # whether its header names carry the a/ b/ prefixes (git apply -p1, else -p0)

    @property
    def added(self) -> int:
        return sum(len(h.new) - h.context for h in self.hunks)

    @property
    def deleted(self) -> int:
        return sum(len(h.old) - h.context for h in self.hunks)


_HUNK_RE = re.compile(rb"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def lines_of(data: bytes) -> list[bytes]:
    """Split on "\\n" only (never on "\\r" or other breaks), keeping each line's end."""
    pieces = data.split(b"\n")
    return [p + b"\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


def _name(line: bytes, prefix: str) -> tuple[str, bool | None]:
    """A header's file name without its prefix, and whether it had one (None for /dev/null)."""
    name = line[4:].rstrip(b"\r\n").split(b"\t")[0].decode("utf-8", "surrogateescape")
    if name.startswith('"'):
        raise ModFailure(f"quoted file name {name} in the diff is not supported")
    if name == "/dev/null":
        return name, None
    if name.startswith(prefix):
        return name[len(prefix):], True
    return name, False


def _picked(old: str, new: str) -> str:
    """The name git applies a section to: not /dev/null; of two, the old one when it begins the new one (`f` of `f`
    and `f.new`), else the new one (`f` of `f.orig` and `f`)."""
    if new == "/dev/null" or (old != "/dev/null" and len(old) < len(new) and new.startswith(old)):
        return old
    return new


def parse_diff(data: bytes) -> list[FilePatch]:
    """The `---`/`+++` sections of a unified diff (diff -u / -U0, git diff); a git diff's sections without hunks (a
    new empty file) are git's to list (patch.py)."""
    lines = lines_of(data)
    patches: list[FilePatch] = []
    git_sections = in_git = False
    i = 0
    while i < len(lines):
        if lines[i].startswith(b"@@"):
            raise ModFailure(f"hunk {lines[i].decode(errors='replace').strip()} comes before any file header")
        if not (lines[i].startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")):
            if lines[i].startswith(b"diff "):  # `diff --git a/x b/x`, or `diff -ruN a/x b/x` of a traditional diff
                in_git = lines[i].startswith(b"diff --git ")
            git_sections = git_sections or in_git
            _refuse_dropped(lines[i])
            i += 1
            continue
        (old_name, old_prefixed), (new_name, new_prefixed) = _name(lines[i], "a/"), _name(lines[i + 1], "b/")
        if None not in (old_prefixed, new_prefixed) and old_prefixed != new_prefixed:
            raise ModFailure(f"{new_name}: one header name has the a/ or b/ prefix and the other not")
        if in_git and "/dev/null" not in (old_name, new_name) and old_name != new_name:
            # git reads two names in a git diff's section as a rename, even without its `rename from` lines
            raise ModFailure(f"a rename ({old_name} -> {new_name}) is not supported; a patch mod changes the text of "
                             "regular files only")
        for name in (old_name, new_name):
            if name != "/dev/null":
                parts(name, "patch header")
        path = _picked(old_name, new_name)
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith(b"@@"):
            hunk, i = _parse_hunk(path, lines, i)
            hunks.append(hunk)
        if not hunks:
            raise ModFailure(f"{path}: the diff names this file but holds no hunk")
        if i < len(lines) and lines[i][:1] in (b" ", b"+", b"-") and lines[i] != b"-- \n" and not (
                lines[i].startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")):
            raise ModFailure(f"{path}: hunk {hunks[-1].header} holds more lines than its header counts")
        patches.append(FilePatch(path, tuple(hunks), old_prefixed is not False and new_prefixed is not False))
    if not patches and not git_sections:
        raise ModFailure("the patch file holds no file changes")
    return patches


def _refuse_dropped(line: bytes) -> None:
    """Refuse a line of `diff -r` that git skips as text between sections, which would drop a change."""
    text = line.decode("utf-8", "replace").strip()
    if text.startswith("Binary files ") and text.endswith(" differ"):
        name = text[len("Binary files "):-len(" differ")].rpartition(" and ")[2].removeprefix("b/")
        raise ModFailure(f"{name}: a binary file change ({text}) is not supported; a patch mod changes the text of "
                         "files only")
    if text.startswith("Only in ") and ": " in text:  # diff -r without -N
        raise ModFailure(f"{text}: a file only one side has; make the diff with `diff -ruN` (or git diff)")


def _parse_hunk(path: str, lines: list[bytes], i: int) -> tuple[Hunk, int]:
    """The hunk whose header is lines[i], and the index after it."""
    m = _HUNK_RE.match(lines[i])
    header = lines[i].decode("utf-8", "replace").rstrip("\r\n")
    if not m:
        raise ModFailure(f"{path}: malformed hunk header {header!r}")
    header = m.group(0).decode()
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_count, new_count = (1 if count is None else int(count) for count in m.group(2, 4))  # no count: one line
    old: list[bytes] = []
    new: list[bytes] = []
    tags: list[bytes] = []
    i += 1
    while len(old) < old_count or len(new) < new_count or (i < len(lines) and lines[i].startswith(b"\\")):
        if i >= len(lines):
            raise ModFailure(f"{path}: hunk {header} is truncated (the diff ends inside it)")
        line = lines[i]
        tag, body = (b" ", b"\n") if line == b"\n" else (line[:1], line[1:])
        if tag == b"\\":
            if not tags:
                raise ModFailure(f"{path}: hunk {header}: '\\ No newline' before any line")
            # The line before has no line end in the file.
            if tags[-1] in (b" ", b"-"):
                old[-1] = old[-1].removesuffix(b"\n")
            if tags[-1] in (b" ", b"+"):
                new[-1] = new[-1].removesuffix(b"\n")
            tags.append(tag)
        elif tag in (b" ", b"-", b"+"):
            if (tag != b"+" and len(old) >= old_count) or (tag != b"-" and len(new) >= new_count):
                raise ModFailure(f"{path}: hunk {header} does not match its header's line counts")
            if tag != b"+":
                old.append(body)
            if tag != b"-":
                new.append(body)
            tags.append(tag)
        else:
            raise ModFailure(f"{path}: hunk {header} is truncated (it ends after {len(tags)} lines)")
        i += 1
    body_tags = [t for t in tags if t != b"\\"]
    if all(t == b" " for t in body_tags):
        raise ModFailure(f"{path}: hunk {header} changes nothing")
    return Hunk(header, old_start, new_start, tuple(old), tuple(new), body_tags.count(b" ")), i


def zero_context(patches: list[FilePatch]) -> bool:
    """Whether no hunk holds a context line: a diff made with -U0, applied as git's --unidiff-zero reads it."""
    return not any(h.context for fp in patches for h in fp.hunks)


def prefix_flag(patches: list[FilePatch]) -> str:
    """git apply's -p for the diff: -p1 when its names carry the a/ b/ prefixes, -p0 when none does."""
    if len({fp.prefixed for fp in patches}) > 1:
        raise ModFailure("some file names of the diff carry the a/ b/ prefixes and some not")
    return "-p0" if patches and not patches[0].prefixed else "-p1"
