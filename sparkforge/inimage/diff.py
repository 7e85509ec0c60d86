"""Unified diffs: file names, hunks and what a git diff changes outside its hunks.

The diff is applied by `git apply` (patch.py); this reader decides what git is never asked to do:
every file name stays inside the tree, and a rename, copy, deletion, mode change, binary change or
`diff -r` line (`Binary files ... differ`, `Only in`) is refused in one line rather than dropped.
It also tells a diff made without context lines (`-U0`), which git reads with --unidiff-zero.
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
    old_count: int
    new_start: int
    new_count: int
    old: tuple[bytes, ...]
    new: tuple[bytes, ...]
    context: int  # context lines in all

@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the component root, without the a/ b/ prefix
    create: bool
    hunks: tuple[Hunk, ...]
    prefixed: bool = True  # whether its header names carry the a/ b/ prefixes (git apply -p1, else -p0)

_HUNK_RE = re.compile(rb"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _lines(data: bytes) -> list[bytes]:
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


def _traditional_name(old: str, new: str) -> str:
    """The file a diff that is not git's patches when its two names differ (`diff -u f.orig f`), as git apply
    reads it: the old name when it begins the new one and is shorter (`f` of `f` and `f.new`), else the new."""
    return old if len(old) < len(new) and new.startswith(old) else new


_STAMP = re.compile(rb"(1969-12-31|1970-01-01) ([0-2][0-9]):([0-5][0-9]):00(?:\.0+)? ([-+])([0-2][0-9]):?([0-5][0-9])")


def _epoch(line: bytes) -> bool:
    """Whether a `---`/`+++` line of a diff that is not git's carries the epoch as its time after the last tab:
    how `diff -N` marks the side of a file that is new (or gone), and how git apply reads it."""
    stamp = line.rstrip(b"\r\n").rpartition(b"\t")[2] if b"\t" in line else b""
    m = _STAMP.fullmatch(stamp)
    if not m:
        return False
    zone = (int(m.group(5)) * 60 + int(m.group(6))) * (-1 if m.group(4) == b"-" else 1)
    epoch_hour = 24 if m.group(1) == b"1969-12-31" else 0
    return int(m.group(2)) * 60 + int(m.group(3)) - zone == epoch_hour * 60


def parse_diff(data: bytes) -> list[FilePatch]:
    """Parse a unified diff (diff -u / -U0, git diff); its header counts must match its hunks exactly."""
    lines = _lines(data)
    patches: list[FilePatch] = []
    git = _GitHeader()
    i = 0
    while i < len(lines):
        if lines[i].startswith(b"@@"):
            raise ModFailure(f"hunk {lines[i].decode(errors='replace').strip()} comes before any file header")
        if not (lines[i].startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")):
            git.line(lines[i], patches)
            i += 1
            continue
        in_git = git.file is not None  # a `diff --git` section: its names are git's own
        git.close(None)
        (old_name, old_prefixed), (new_name, new_prefixed) = _name(lines[i], "a/"), _name(lines[i + 1], "b/")
        if None not in (old_prefixed, new_prefixed) and old_prefixed != new_prefixed:
            raise ModFailure(f"{new_name}: one header name has the a/ or b/ prefix and the other not")
        for name in (old_name, new_name):
            if name != "/dev/null":
                parts(name, "patch header")
        if new_name == "/dev/null" or (not in_git and old_name != "/dev/null" and _epoch(lines[i + 1])):
            raise ModFailure(f"deleting files is not supported ({old_name})")
        create = old_name == "/dev/null" or (not in_git and _epoch(lines[i]))
        if old_name not in ("/dev/null", new_name):
            if in_git:
                raise ModFailure(f"renaming files is not supported ({old_name} -> {new_name})")
            new_name = _traditional_name(old_name, new_name)
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith(b"@@"):
            hunk, i = _parse_hunk(new_name, lines, i)
            hunks.append(hunk)
        if not hunks:
            raise ModFailure(f"{new_name}: the diff names this file but holds no hunk")
        if i < len(lines) and lines[i][:1] in (b" ", b"+", b"-") and lines[i] != b"-- \n" and not (
                lines[i].startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")):
            raise ModFailure(f"{new_name}: hunk {hunks[-1].header} holds more lines than its header counts")
        if create and (len(hunks) != 1 or hunks[0].old_count):
            raise ModFailure(f"{new_name}: a new file takes one hunk from -0,0")
        patches.append(FilePatch(new_name, create, tuple(hunks), bool(new_prefixed)))
    git.close(patches)
    if not patches:
        raise ModFailure("the patch file holds no file changes")
    return patches


class _GitHeader:
    """The extended header of a `diff --git` section, from that line to its `---`/`+++` pair or its end.

    What git says there without a hunk (a binary change, a rename, a mode) is refused rather than
    dropped; a new empty file (`new file mode 100644` and no `---`/`+++`) becomes a FilePatch that
    creates it empty. Anything else ends the section, so a commit message is never read as a header."""

    HEADER = (b"index ", b"old mode ", b"new mode ", b"new file mode ", b"deleted file mode ", b"similarity index ",
              b"dissimilarity index ", b"rename from ", b"rename to ", b"copy from ", b"copy to ", b"Binary files ",
              b"GIT binary patch")

    def __init__(self) -> None:
        self.file: str | None = None
        self.new = False

    def line(self, line: bytes, patches: list[FilePatch]) -> None:
        if line.startswith(b"diff --git "):
            self.close(patches)
            names = line[11:].rstrip(b"\r\n").decode("utf-8", "surrogateescape")
            self.file = names.rpartition(" b/")[2] if " b/" in names else names
        elif self.file is not None and line.startswith(self.HEADER):
            _refuse_git_extension(self.file, line)
            self.new = self.new or line.startswith(b"new file mode ")
        else:
            self.close(patches)
            text = line.decode("utf-8", "replace").strip()
            if text.startswith("Binary files ") and text.endswith(" differ"):  # diff -r
                raise ModFailure(f"a binary file change ({text}) is not supported; a patch mod changes the text of "
                                 "files only")
            if text.startswith("Only in ") and ": " in text:  # diff -r without -N
                raise ModFailure(f"{text}: a file only one side has; make the diff with `diff -ruN` (or git diff)")

    def close(self, patches: list[FilePatch] | None) -> None:
        """End the section; with patches, a new file that had no hunk is added to them, empty."""
        if patches is not None and self.file is not None and self.new:
            parts(self.file, "patch header")
            patches.append(FilePatch(self.file, True, ()))
        self.file, self.new = None, False


# Changes a git diff makes without a hunk, which applying only the hunks would silently drop.
_GIT_EXTENSIONS = ((b"Binary files ", "a binary file change"), (b"GIT binary patch", "a binary file change"),
                   (b"rename from ", "a rename"), (b"copy from ", "a copy"), (b"old mode ", "a file mode change"),
                   (b"new mode ", "a file mode change"),
                   (b"deleted file mode ", "a file deletion"))


def _refuse_git_extension(files: str, line: bytes) -> None:
    if line.startswith(b"new file mode ") and line.rstrip(b"\r\n") != b"new file mode 100644":
        raise ModFailure(f"{files}: a new file with mode {line[14:].decode('utf-8', 'replace').strip()} is not "
                         "supported; a patch mod makes new files as plain files (100644)")
    for prefix, what in _GIT_EXTENSIONS:
        if line.startswith(prefix):
            raise ModFailure(f"{files}: {what} ({line.decode('utf-8', 'replace').strip()}) is not supported; "
                             "a patch mod changes the text of files only")


def _parse_hunk(path: str, lines: list[bytes], i: int) -> tuple[Hunk, int]:
    """Read the hunk whose header is lines[i]; return it and the index after it."""
    m = _HUNK_RE.match(lines[i])
    header = lines[i].decode("utf-8", "replace").rstrip("\r\n")
    if not m:
        raise ModFailure(f"{path}: malformed hunk header {header!r}")
    header = m.group(0).decode()
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_count = 1 if m.group(2) is None else int(m.group(2))
    new_count = 1 if m.group(4) is None else int(m.group(4))
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
    changes = [k for k, t in enumerate(body_tags) if t != b" "]
    if not changes:
        raise ModFailure(f"{path}: hunk {header} changes nothing")
    return Hunk(header, old_start, old_count, new_start, new_count, tuple(old), tuple(new),
                body_tags.count(b" ")), i


def zero_context(patches: list[FilePatch]) -> bool:
    """Whether no hunk holds a context line: a diff made with -U0, applied as git's --unidiff-zero reads it."""
    return not any(h.context for fp in patches for h in fp.hunks)
