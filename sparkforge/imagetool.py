#!/usr/bin/env python3
"""Apply and verify mods: the one applier used both inside the image build and by check-mods.

Stdlib only: this file is copied into the image and runs on whatever Python the base has.
Every application has three outcomes: applied, already applied (detected, skipped, reported),
or failed. A failure names the mod and the file or hunk, and leaves every file untouched.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

APPLIED = "applied"
ALREADY = "already"
FAILED = "failed"


class ModFailure(Exception):
    """The mod cannot be applied; the message says which file or hunk and why."""


@dataclass(frozen=True)
class Result:
    mod: str
    state: str  # applied | already | failed
    detail: str = ""

    def line(self) -> str:
        text = {APPLIED: "applied", ALREADY: "already applied, skipped", FAILED: "FAILED"}[self.state]
        return f"mod {self.mod}: {text}" + (f": {self.detail}" if self.detail else "")


# ------------------------------------------------------------------ confinement


def _parts(rel: str, what: str, *, absolute_ok: bool = False) -> list[str]:
    """The components of a path a mod names; refused when it could leave the folder it is read against."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise ModFailure(f"{what} {rel!r} is not a path")
    if rel.startswith("/") and not absolute_ok:
        raise ModFailure(f"{what} {rel!r} is an absolute path; name it relative to the tree")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ModFailure(f"{what} {rel!r} climbs out of its root with '..'")
    if not parts:
        raise ModFailure(f"{what} {rel!r} names no file")
    return parts


def inside(root: Path, rel: str, what: str, *, absolute_ok: bool = False) -> Path:
    """root/rel with every link resolved; refused when it, or a link on its way, leads out of root.

    Links inside the tree are followed only while they stay in it (a merged /usr root has /bin ->
    usr/bin); the path returned is the real one, so later reads and writes follow no link."""
    parts = _parts(rel, what, absolute_ok=absolute_ok)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, *parts))
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise ModFailure(f"{what} {rel!r} leads out of the tree through a link")
    return Path(real)


def asset(folder: Path, rel: str, what: str) -> Path:
    """A file of the mod's own folder; refused when its path leaves the folder or passes a link."""
    path = folder
    for part in _parts(rel, what):
        path = path / part
        if path.is_symlink():
            raise ModFailure(f"{what} {rel!r} is or passes through a link; a mod folder holds only regular files")
    return path


def check_folder(folder: Path) -> None:
    """Refuse a mod folder that holds a link or anything but folders and regular files."""
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(parent) / name
            if path.is_symlink():
                raise ModFailure(f"{path.relative_to(folder)} is a link; a mod folder holds only regular files")
            if name in files and not path.is_file():
                raise ModFailure(f"{path.relative_to(folder)} is not a regular file")


def check_paths(spec: dict, folder: Path) -> None:
    """Refuse, before anything is read, every path of a mod spec that could leave its root."""
    check_folder(folder)
    for field in ("patch", "patcher"):
        if spec.get(field):
            asset(folder, spec[field], field)
    for i, item in enumerate(spec.get("files") or []):
        asset(folder, item["src"], f"files[{i}].src")
        _parts(item["dest"], f"files[{i}].dest", absolute_ok=True)
    for i, check in enumerate(spec.get("verify") or []):
        if check.get("file") is not None:
            _parts(check["file"], f"verify[{i}].file", absolute_ok=True)


def check_static(spec: dict, folder: Path) -> None:
    """Every refusal that needs no target tree, so that the config stage can make it before any build:
    the spec's paths, the patch's file names and hunk counts, a patcher's TARGETS when they are a literal."""
    check_paths(spec, folder)
    if spec.get("kind") == "patch" and spec.get("patch"):
        for file_patch in parse_diff(_read(asset(folder, spec["patch"], "patch"))):
            _parts(file_patch.path, "patch target")
    if spec.get("kind") == "patcher" and spec.get("patcher"):
        for rel in _literal_targets(asset(folder, spec["patcher"], "patcher")):
            _parts(rel, "patcher TARGETS entry")


def _literal_targets(patcher: Path) -> list[str]:
    """TARGETS of a patcher module when it is assigned a literal list of strings; else none (checked at run time)."""
    import ast

    try:
        tree = ast.parse(_read(patcher), filename=str(patcher))
    except SyntaxError as exc:
        raise ModFailure(f"patcher {patcher.name} does not parse: line {exc.lineno}: {exc.msg}") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "TARGETS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [v for v in value if isinstance(v, str)] if isinstance(value, (list, tuple)) else []
    return []


def _read(path: Path) -> bytes:
    """A file's bytes, refusing a link at the last step (the path was resolved by inside())."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


# ------------------------------------------------------------------ unified diffs


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
    leading: int  # context lines before the first change
    trailing: int  # context lines after the last change
    context: int  # context lines in all

    def place(self, new_side: bool) -> int:
        """The 0-based line where a side starts; a side of no lines sits after the line it names."""
        start, count = (self.new_start, self.new_count) if new_side else (self.old_start, self.old_count)
        return start if count == 0 else start - 1


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the component root, without the a/ b/ prefix
    create: bool
    hunks: tuple[Hunk, ...]


_HUNK_RE = re.compile(rb"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _lines(data: bytes) -> list[bytes]:
    """Split on "\\n" only (never on "\\r" or other breaks), keeping each line's end."""
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _name(line: bytes, prefix: str) -> str:
    name = line[4:].rstrip(b"\r\n").split(b"\t")[0].decode("utf-8", "surrogateescape")
    if name.startswith('"'):
        raise ModFailure(f"quoted file name {name} in the diff is not supported")
    if name != "/dev/null" and name.startswith(prefix):
        name = name[len(prefix):]
    return name


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
        git.close(None)
        old_name, new_name = _name(lines[i], "a/"), _name(lines[i + 1], "b/")
        for name in (old_name, new_name):
            if name != "/dev/null":
                _parts(name, "patch header")
        if new_name == "/dev/null":
            raise ModFailure(f"deleting files is not supported ({old_name})")
        if old_name not in ("/dev/null", new_name):
            raise ModFailure(f"renaming files is not supported ({old_name} -> {new_name})")
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
        _check_order(new_name, hunks)
        create = old_name == "/dev/null"
        if create and (len(hunks) != 1 or hunks[0].old_count):
            raise ModFailure(f"{new_name}: a new file takes one hunk from -0,0")
        patches.append(FilePatch(new_name, create, tuple(hunks)))
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
            _parts(self.file, "patch header")
            patches.append(FilePatch(self.file, True, ()))
        self.file, self.new = None, False


# Changes a git diff makes without a hunk, which applying only the hunks would silently drop.
_GIT_EXTENSIONS = ((b"Binary files ", "a binary file change"), (b"GIT binary patch", "a binary file change"),
                   (b"rename from ", "a rename"), (b"copy from ", "a copy"), (b"old mode ", "a file mode change"),
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
    leading, trailing = changes[0], len(body_tags) - 1 - changes[-1]
    hunk = Hunk(header, old_start, old_count, new_start, new_count, tuple(old), tuple(new), leading, trailing,
                body_tags.count(b" "))
    return hunk, i


def _check_order(path: str, hunks: list[Hunk]) -> None:
    """Hunks must come in file order and not overlap, on both sides."""
    for side in (False, True):
        end = 0
        for h in hunks:
            start = h.place(side)
            if start < end:
                raise ModFailure(f"{path}: hunk {h.header} overlaps or precedes the hunk before it")
            end = start + (h.new_count if side else h.old_count)


def _block_at(image: list[bytes], block: tuple[bytes, ...], pos: int, at_end: bool) -> bool:
    """Whether block stands at image[pos:], compared as git apply compares it."""
    if pos < 0 or pos + len(block) > len(image) or (at_end and pos + len(block) != len(image)):
        return False
    for k, line in enumerate(block):
        have = image[pos + k]
        if have == line:
            continue
        # git compares the block's bytes as a prefix of the file's, and its line hash skips
        # whitespace: a last line without its line end also matches that line with a line end
        # (and trailing blanks), unless the block must end where the file ends.
        if at_end or k != len(block) - 1 or line.endswith(b"\n") or not have.startswith(line) \
                or have[len(line):].strip():
            return False
    return True


def _candidates(line: int, n: int):
    """Positions to try, nearest first, later before earlier at equal distance (as git apply does)."""
    yield line
    d = 1
    while line + d <= n or line - d >= 0:
        if line + d <= n:
            yield line + d
        if line - d >= 0:
            yield line - d
        d += 1


def apply_forward(lines: list[bytes], hunks: tuple[Hunk, ...], zero_context: bool) -> list[bytes] | Hunk:
    """Apply hunks as `git apply` does (exact bytes, offsets allowed, no fuzz; with zero_context as
    --unidiff-zero); return the new lines, or the first hunk that does not match."""
    image = list(lines)
    patched = [False] * len(image)
    for h in hunks:
        at_start = h.old_start == 0 or (h.old_start == 1 and not zero_context)
        at_end = not zero_context and h.trailing == 0
        n, k = len(image), len(h.old)
        line = 0 if at_start else (n - k if at_end else (h.new_start - 1 if h.new_start else 0))
        found = -1
        if k <= n:
            for pos in _candidates(min(line, n), n):
                if (not at_start or pos == 0) and _block_at(image, h.old, pos, at_end) \
                        and not any(patched[pos:pos + k]):
                    found = pos
                    break
        if found < 0:
            return h
        image[found:found + k] = h.new
        # A later hunk may not match lines an earlier one wrote.
        patched[found:found + k] = [True] * len(h.new)
    return image


def is_applied(lines: list[bytes], hunks: tuple[Hunk, ...], zero_context: bool) -> bool:
    """Whether every hunk's new side stands at the hunk's place: found as the forward match finds
    the old side (nearest to the recorded line, carrying the offset of the hunks before it), except
    that a hunk without context is looked for only at its line, never searched for elsewhere.

    A hunk that only removes lines and has no context has an empty new side; it counts as applied
    only while the lines it removes are not at its place."""
    offset, end = 0, 0
    for h in hunks:
        expected = h.place(new_side=True) + offset
        at_start = h.new_start == 0 or (h.new_start == 1 and not zero_context)
        at_end = not zero_context and h.trailing == 0
        if h.context:
            line = 0 if at_start else (len(lines) - len(h.new) if at_end else expected)
            found = next((pos for pos in _candidates(max(0, min(line, len(lines))), len(lines))
                          if pos >= end and (not at_start or pos == 0) and _block_at(lines, h.new, pos, at_end)),
                         -1)
        else:
            found = expected if expected >= end and _block_at(lines, h.new, expected, at_end) else -1
            if found >= 0 and not h.new and _block_at(lines, h.old, found, False):
                found = -1
        if found < 0:
            return False
        offset, end = found - h.place(new_side=True), found + len(h.new)
    return True


def plan_patch(name: str, diff: bytes, root: Path) -> tuple[str, dict[Path, bytes]]:
    """Decide the state of a diff against root and compute the new file contents (nothing written)."""
    patches = parse_diff(diff)
    # A diff without a single context line was made with -U0: read it as git apply --unidiff-zero does.
    zero = not any(h.context for fp in patches for h in fp.hunks)
    targets = [inside(root, fp.path, "patch header") for fp in patches]
    forward: dict[Path, bytes] = {}
    states = []
    for fp, target in zip(patches, targets):
        if fp.create:
            body = b"".join(fp.hunks[0].new) if fp.hunks else b""  # no hunk: a new empty file
            if not os.path.lexists(target):
                forward[target] = body
                states.append(APPLIED)
            elif target.is_file() and _read(target) == body:
                states.append(ALREADY)
            else:
                raise ModFailure(f"{fp.path}: the patch creates this file, but it exists with other content")
            continue
        if not target.is_file():
            raise ModFailure(f"{fp.path}: file to patch not found")
        lines = _lines(_read(target))
        if is_applied(lines, fp.hunks, zero):
            states.append(ALREADY)
            continue
        result = apply_forward(lines, fp.hunks, zero)
        if isinstance(result, Hunk):
            raise ModFailure(f"{fp.path}: hunk {result.header} does not match the file")
        forward[target] = b"".join(result)
        states.append(APPLIED)
    if all(s == ALREADY for s in states):
        return ALREADY, {}
    if any(s == ALREADY for s in states):
        done = [fp.path for fp, s in zip(patches, states) if s == ALREADY]
        raise ModFailure(f"partly applied already ({', '.join(done)}); refusing to mix")
    return APPLIED, forward


# ------------------------------------------------------------------ patchers, in a child process

PATCHER_TIMEOUT = 60.0  # seconds for each run of a patcher, unless the caller says otherwise
_RESULT_MARK = "sparkforge-patcher-result "
# Before 3.11, -I still puts the script's folder (or the working folder) first on sys.path, where a
# sibling such as sparkforge/inspect.py would shadow the standard library; start from a clean path.
_CHILD_BOOT = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; sys.argv = sys.argv[1:]; "
               "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")


def plan_patcher(name: str, patcher: Path, root: Path,
                 timeout: float = PATCHER_TIMEOUT) -> tuple[str, dict[Path, bytes]]:
    """Run a patcher in a fresh, isolated interpreter: it names its targets, gets their texts, and
    decides and transforms; its answer, or ModFailure (nothing written)."""
    deadline = time.monotonic() + timeout
    cmd = [sys.executable, "-I", "-B", "-c", _CHILD_BOOT, str(Path(__file__).resolve()), "patcher-child",
           str(patcher)]
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a chatty patcher cannot block on it
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                cwd=patcher.parent, start_new_session=True)
        try:
            first, rest = _first_line(proc, deadline)
            targets = _answer(patcher, first, proc, errors)["targets"]
            paths, sources = _read_targets(root, targets)
            out, _ = proc.communicate(json.dumps(sources).encode(), timeout=max(0.001, deadline - time.monotonic()))
            answer = _answer(patcher, rest + out, proc, errors)
        except subprocess.TimeoutExpired:
            raise ModFailure(f"patcher {patcher.name} did not finish within {timeout:g} s; stopped") from None
        finally:
            _stop(proc)
    if answer["state"] == ALREADY:
        return ALREADY, {}
    return APPLIED, {paths[rel]: text.encode("utf-8") for rel, text in answer["files"].items()
                     if text != sources[rel]}


def _first_line(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes]:
    """The child's first line (its targets), and what came after it, waiting no longer than deadline."""
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise subprocess.TimeoutExpired(proc.args, 0)
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            data += chunk
    first, _, rest = data.partition(b"\n")
    return first, rest


def _answer(patcher: Path, data: bytes, proc: subprocess.Popen, errors) -> dict:
    """The last marked line of the child's output as a dict; ModFailure for an error or no answer."""
    marked = [line for line in data.decode("utf-8", "replace").splitlines() if line.startswith(_RESULT_MARK)]
    if not marked:
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        errors.seek(0)
        why = last_line(errors.read().decode("utf-8", "replace"), "no output")
        raise ModFailure(f"patcher {patcher.name} exited with code {code} without a result: {why}")
    answer = json.loads(marked[-1][len(_RESULT_MARK):])
    if "error" in answer:
        raise ModFailure(answer["error"])
    return answer


def _read_targets(root: Path, targets: list[str]) -> tuple[dict[str, Path], dict[str, str]]:
    """Resolve a patcher's targets in root (refusing any that leave it) and read their texts."""
    paths = {rel: inside(root, rel, "patcher TARGETS entry") for rel in targets}
    sources = {}
    for rel, path in paths.items():
        if not path.is_file():
            raise ModFailure(f"{rel}: file to patch not found")
        try:
            sources[rel] = _read(path).decode("utf-8")
        except UnicodeDecodeError:
            raise ModFailure(f"{rel}: not UTF-8 text; a patcher edits text files") from None
    return paths, sources


def _stop(proc: subprocess.Popen) -> None:
    """Kill a patcher still running, and everything it started (it leads its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def _patcher_targets(module) -> list[str]:
    targets = getattr(module, "TARGETS")
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise ModFailure("TARGETS must be a list of relative paths")
    return list(targets)


def _patcher_run(module, sources: dict[str, str]) -> dict:
    """What the child answers once it has the texts; runs the patcher's own code."""
    if module.is_applied(dict(sources)):
        return {"state": ALREADY}
    try:
        result = module.transform(dict(sources))
    except ValueError as exc:
        raise ModFailure(str(exc)) from None
    if not isinstance(result, dict) or not all(isinstance(v, str) for v in result.values()):
        raise ModFailure("transform() must return a dict of path -> text")
    extra = sorted(set(result) - set(sources))
    if extra:
        raise ModFailure(f"patcher changed files it does not list in TARGETS: {extra}")
    if not module.is_applied({**sources, **result}):
        raise ModFailure("patcher ran, but is_applied() is still false on its result")
    return {"state": APPLIED, "files": result}


def _cmd_patcher_child(args: argparse.Namespace) -> int:
    """The child side of plan_patcher: import the patcher, print its targets, read their texts from
    stdin, and print the answer; one marked JSON line each."""
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # the patcher's prints must not mix with the answer

    def say(answer: dict) -> None:
        print(_RESULT_MARK + json.dumps(answer), file=real_stdout, flush=True)

    path, stage = Path(args.patcher), "import"
    try:
        spec = importlib.util.spec_from_file_location("sparkforge_patcher", path)
        if spec is None or spec.loader is None:
            raise ModFailure(f"cannot load patcher {path.name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        missing = [a for a in ("TARGETS", "is_applied", "transform") if not hasattr(module, a)]
        if missing:
            raise ModFailure(f"patcher {path.name} does not define {', '.join(missing)}")
        stage = "run"
        say({"targets": _patcher_targets(module)})
        answer = _patcher_run(module, json.loads(sys.stdin.buffer.read()))
    except ModFailure as exc:
        answer = {"error": str(exc)}
    except SystemExit as exc:
        answer = {"error": f"patcher {path.name} called sys.exit({exc.code!r}) during {stage}"}
    except BaseException as exc:  # the patcher's own code: anything it raises is its failure
        answer = {"error": f"patcher {path.name} raised {type(exc).__name__} during {stage}: {exc}"}
    say(answer)
    return 0


# ------------------------------------------------------------------ drop-in files


def plan_files(spec: dict, folder: Path, root: Path) -> tuple[str, dict[Path, bytes], dict[Path, int]]:
    writes: dict[Path, bytes] = {}
    modes: dict[Path, int] = {}
    states = []
    for i, item in enumerate(spec["files"]):
        body = _read(asset(folder, item["src"], f"files[{i}].src"))
        target = inside(root, item["dest"], f"files[{i}].dest", absolute_ok=True)
        mode = int(item.get("mode", "0644"), 8)
        if os.path.lexists(target):
            if not target.is_file() or _read(target) != body:
                raise ModFailure(f"{item['dest']}: exists with other content; refusing to overwrite")
            states.append(ALREADY)
        else:
            writes[target] = body
            modes[target] = mode
            states.append(APPLIED)
    if all(s == ALREADY for s in states):
        return ALREADY, {}, {}
    return APPLIED, writes, modes


def _write_all(writes: dict[Path, bytes], modes: dict[Path, int] | None = None) -> None:
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
        if spec["kind"] == "patch":
            state, writes = plan_patch(name, _read(asset(folder, spec["patch"], "patch")), root)
        elif spec["kind"] == "patcher":
            state, writes = plan_patcher(name, asset(folder, spec["patcher"], "patcher"), root, patcher_timeout)
        elif spec["kind"] == "files":
            state, writes, modes = plan_files(spec, folder, root)
        else:
            raise ModFailure(f"unknown kind {spec['kind']!r}")
        if state == APPLIED:
            _write_all(writes, modes)
        return Result(name, state)
    except ModFailure as exc:
        return Result(name, FAILED, str(exc))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return Result(name, FAILED, f"{type(exc).__name__}: {exc}")


def verify_mod(spec: dict, root: Path, *, in_image: bool) -> list[tuple[str, str, str]]:
    """Run a mod's verify checks: (check, ok|failed|skipped, detail) for each."""
    out = []
    for i, check in enumerate(spec.get("verify", [])):
        if check.get("python") is not None:
            label = f"python: {check['python']}"
            if not in_image:
                out.append((label, "skipped", "runs only inside a built image"))
                continue
            missing = [n for n in check.get("needs", []) if importlib.util.find_spec(n) is None]
            if missing:
                out.append((label, "skipped", f"needs {', '.join(missing)}, not installed here"))
                continue
            proc = subprocess.run([sys.executable, "-c", check["python"]], capture_output=True, text=True,
                                  cwd=root)
            tail = (proc.stderr.strip().splitlines() or [""])[-1]
            out.append((label, "ok" if proc.returncode == 0 else "failed", tail))
            continue
        label = f"{check['file']} contains {check['contains']!r}"
        try:
            target = inside(root, check["file"], f"verify[{i}].file", absolute_ok=True)
        except ModFailure as exc:
            out.append((label, "failed", str(exc)))
            continue
        if not target.is_file():
            out.append((label, "failed", f"{check['file']} not found"))
        elif check["contains"] in _read(target).decode("utf-8", errors="replace"):
            out.append((label, "ok", ""))
        else:
            out.append((label, "failed", "string not found"))
    return out


# ------------------------------------------------------------------ in the image


def component_root(component: str) -> Path:
    """Where an installed component's tree is rooted: the folder that holds its package."""
    if component == "image":
        return Path("/")
    spec = importlib.util.find_spec(component.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModFailure(f"component {component!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _installed(name: str) -> str | None:
    import importlib.metadata  # here, not at the top: the patcher child starts faster without it

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> str:
    """torch.version.cuda of the installed torch ("None" for a CPU build); asked in a subprocess."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"import failed: {last_line(proc.stderr)}"


def last_line(text: str, default: str = "") -> str:
    """The last non-blank line of a command's output: usually the error that matters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else default


def protect(names: list[str], out_dir: Path) -> dict[str, str]:
    """Record the base image's builds of the protected packages, as pip constraints; for torch
    also its CUDA build, which a PyPI torch would silently replace."""
    found = {name: v for name in names if (v := _installed(name)) is not None}
    out_dir.mkdir(parents=True, exist_ok=True)
    record = dict(found)
    if "torch" in found:
        record["torch.version.cuda"] = _torch_cuda()
    (out_dir / "protected.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (out_dir / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(found.items())))
    return found


def check_protected(out_dir: Path) -> list[str]:
    """What differs from the base image's protected packages, one line each."""
    recorded = json.loads((out_dir / "protected.json").read_text())
    changed = []
    for name, version in sorted(recorded.items()):
        now = _torch_cuda() if name == "torch.version.cuda" else (_installed(name) or "absent")
        if now != version:
            changed.append(f"{name} {version} -> {now}")
    return changed


# ------------------------------------------------------------------ build record and smoke tests


def write_record(home: Path) -> dict:
    """Gather the build record: the plan, every mod's result, and what is really installed."""
    plan = json.loads((home / "plan.json").read_text())
    mods = [json.loads(p.read_text()) for p in sorted((home / "record" / "mods").glob("*.json"))]
    commit_file = home / "record" / "vllm-commit"
    wheel_file = home / "record" / "vllm-wheel.json"
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    built = int(epoch) if epoch.isdigit() else int(time.time())
    installed = {"vllm": _installed("vllm")}
    for comp in plan["components"]:
        if comp["kind"] == "pip":
            name = comp["package"].split("[")[0]
            installed[name] = _installed(name)
    for comp in plan["components"]:
        if comp["kind"] == "git":
            marker = Path(comp["dest"]) / ".sparkforge-commit"
            installed[comp["name"]] = marker.read_text().strip() if marker.exists() else None
    built_commit = commit_file.read_text().strip() if commit_file.exists() else _release_commit()
    record = {
        "variant": plan["variant"],
        "chain": plan["chain"],
        "tag": plan["tag"],
        "plan_hash": plan["plan_hash"],
        "base": plan["base"],
        "vllm": plan["vllm"] | {"built_commit": built_commit,
                                "installed_wheel": json.loads(wheel_file.read_text()) if wheel_file.exists() else None},
        "components": plan["components"],
        "installed": installed,
        "packages": installed_packages(),
        "mods": [{"name": m["name"], "digest": m["digest"], "phase": m["spec"]["phase"],
                  "result": next((r["result"] for r in mods if r["name"] == m["name"]), None)}
                 # a patch named by URL (or pull request) and its sha256: where the change came from
                 | ({"patch": m["spec"]["patch"]} if isinstance(m["spec"].get("patch"), dict) else {})
                 for m in plan["mods"]],
        "protected": json.loads((home / "protect" / "protected.json").read_text()),
        "build": plan["build"],
        "env": plan["env"],
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(built)),
        "source_date_epoch": int(epoch) if epoch.isdigit() else None,
        "python": sys.version.split()[0],
        "tool_version": plan["tool_version"],
        "unpinned": plan["unpinned"],
        "kernels": json.loads((home / "record" / "kernels.json").read_text()) if (home / "record" / "kernels.json").exists() else None,
    }
    (home / "build-record.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def installed_packages() -> dict[str, str]:
    """Every Python distribution the image's Python sees, by normalized name, with its version;
    where a name is installed twice, the one found first on sys.path (the one imported) wins."""
    import importlib.metadata

    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()
        if name and name not in found:
            found[name] = dist.version
    return dict(sorted(found.items()))


def _release_commit() -> str | None:
    """The commit an installed vLLM release records in vllm/_version.py, read without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return version_file_commit(Path(list(spec.submodule_search_locations)[0]) / "_version.py")


def version_file_commit(version_file: Path) -> str | None:
    """The short commit a setuptools-scm _version.py records (without its 'g'), or None."""
    if not version_file.exists():
        return None
    m = re.search(r"commit_id\s*=\s*['\"]g?([0-9a-f]{7,40})['\"]", version_file.read_text())
    return m.group(1) if m else None


def _public(version: str | None) -> str | None:
    return version.split("+")[0] if version else version


def smoke_static(home: Path) -> list[tuple[str, str, str]]:
    """The static smoke tier: (check, ok|failed|skipped, detail). Needs no GPU."""
    checks: list[tuple[str, str, str]] = []

    def add(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, "ok" if ok else "failed", detail))

    try:
        record = json.loads((home / "build-record.json").read_text())
        plan = json.loads((home / "plan.json").read_text())
    except (OSError, ValueError) as exc:
        return [("build record present", "failed", str(exc))]
    add("build record present", record.get("plan_hash") == plan["plan_hash"], str(home / "build-record.json"))
    want, have = plan["vllm"]["version"], _installed("vllm")
    add(f"vllm {want} installed", (have if "+" in want else _public(have)) == want, f"installed: {have}")
    for comp in plan["components"]:
        if comp["kind"] == "pip":
            name = comp["package"].split("[")[0]
            want, have = comp["version"]["value"], _installed(name)
            ok = have is not None and (want is None or _public(have) == want)
            add(f"{name} {want or '(unpinned)'} installed", ok, f"installed: {have}")
        else:
            marker = Path(comp["dest"]) / ".sparkforge-commit"
            have = marker.read_text().strip() if marker.exists() else None
            want = comp["commit"]["value"]
            add(f"{comp['name']} at {want or comp['ref']}", have is not None and (want is None or have == want),
                f"{comp['dest']}: {have}")
    changed = check_protected(home / "protect")
    protected = json.loads((home / "protect" / "protected.json").read_text())
    add("base packages not replaced by pip", not changed,
        "; ".join(changed) or ", ".join(f"{k} {v}" for k, v in sorted(protected.items())) or
        "the base has none of the protected packages")
    entries = [json.loads(p.read_text()) for p in (home / "record" / "mods").glob("*.json")]
    results = {entry["name"]: entry["result"] for entry in entries}
    for mod in plan["mods"]:
        name = mod["name"]
        add(f"mod {name} recorded", results.get(name) in (APPLIED, ALREADY), str(results.get(name)))
        spec = json.loads((home / "mods" / name / "mod.json").read_text())
        try:
            root = component_root(spec["component"])
        except ModFailure as exc:
            add(f"mod {name}: component root", False, str(exc))
            continue
        for label, state, detail in verify_mod(spec, root, in_image=True):
            if spec["phase"] == "source" and not label.startswith("python:"):
                # A source-phase mod edits the source tree before the compile; its file checks ran
                # there when it was applied (the record above), and the tree is not in the image.
                state, detail = "skipped", "checked in the source tree at build time"
            missing = re.fullmatch(r"ModuleNotFoundError: No module named '([\w.]+)'", detail)
            if (state == "failed" and missing and not plan["vllm"]["install_deps"]
                    and importlib.util.find_spec(missing.group(1).split(".")[0]) is None):
                # As `needs` does for declared modules: vLLM was installed --no-deps, so its own
                # dependencies are the base's to provide, and this base lacks one.
                state, detail = "skipped", (f"needs {missing.group(1)}, not installed (vllm was installed with "
                                            "--no-deps; the base provides its dependencies)")
            checks.append((f"mod {name}: {label}", state, detail))
    entry = shutil.which("vllm")
    add("vllm entry point on PATH", entry is not None, entry or "not found")
    if any(m["name"] == "serve-torchrun" for m in plan["mods"]):
        server = Path("/opt/sparkforge/serve_torchrun.py")
        add("torchrun server script", server.is_file() and os.access(server, os.X_OK), str(server))
    return checks


def smoke_gpu(home: Path) -> list[tuple[str, str, str]]:
    """The gpu smoke tier: CUDA works and the device's capability is covered by the arch list."""
    plan = json.loads((home / "plan.json").read_text())
    code = ("import json, torch; ok = torch.cuda.is_available(); "
            "print(json.dumps({'ok': ok, 'cap': list(torch.cuda.get_device_capability(0)) if ok else None, "
            "'name': torch.cuda.get_device_name(0) if ok else None}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return [("torch.cuda.is_available()", "failed", last_line(proc.stderr))]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    checks = [("torch.cuda.is_available()", "ok" if info["ok"] else "failed", str(info["name"]))]
    if info["ok"]:
        major, minor = info["cap"]
        arches = plan["build"]["torch_cuda_arch_list"].split(";")
        covered = any(a.rstrip("afPTX+").rstrip(".") == f"{major}.{minor}" for a in arches)
        checks.append((f"sm_{major}{minor} in TORCH_CUDA_ARCH_LIST", "ok" if covered else "failed",
                       plan["build"]["torch_cuda_arch_list"]))
    return checks


def _cmd_apply(args: argparse.Namespace) -> int:
    folder = Path(args.mod)
    try:
        check_folder(folder)
        spec = json.loads(_read(folder / "mod.json"))
    except (ModFailure, OSError, ValueError) as exc:
        print(f"mod {folder.name}: FAILED: {exc}", file=sys.stderr)
        return 1
    try:
        root = Path(args.root) if args.root else component_root(spec["component"])
    except ModFailure as exc:
        print(f"mod {spec['name']}: FAILED: {exc}", file=sys.stderr)
        return 1
    result = apply_mod(spec, folder, root, patcher_timeout=args.patcher_timeout)
    print(result.line(), file=sys.stderr if result.state == FAILED else sys.stdout)
    if result.state == FAILED:
        return 1
    bad = [c for c in verify_mod(spec, root, in_image=False) if c[1] == "failed"]
    if bad:
        print(f"mod {spec['name']}: FAILED: verify: {bad[0][0]}: {bad[0][2]}", file=sys.stderr)
        return 1
    if args.record:
        record = Path(args.record)
        record.parent.mkdir(parents=True, exist_ok=True)
        entry = {"name": spec["name"], "result": result.state, "phase": spec["phase"], "root": str(root)}
        record.write_text(json.dumps(entry, sort_keys=True) + "\n")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    failed = 0
    for folder in args.mods:
        spec = json.loads((Path(folder) / "mod.json").read_text())
        root = Path(args.root) if args.root else component_root(spec["component"])
        for label, state, detail in verify_mod(spec, root, in_image=True):
            print(f"{spec['name']}\t{state}\t{label}" + (f"\t{detail}" if detail else ""))
            failed += state == "failed"
    return 1 if failed else 0


def _cmd_protect(args: argparse.Namespace) -> int:
    found = protect(args.names, Path(args.out))
    for name in args.names:
        print(f"protect {name}: {found.get(name, 'not installed in the base')}")
    return 0


def _cmd_check_protected(args: argparse.Namespace) -> int:
    changed = check_protected(Path(args.dir))
    for line in changed:
        print(f"protected package replaced: {line}", file=sys.stderr)
    return 1 if changed else 0


def _cmd_record(args: argparse.Namespace) -> int:
    record = write_record(Path(args.home))
    print(f"build record: {record['variant']} {record['tag']}")
    return 0


def _cmd_note_wheel(args: argparse.Namespace) -> int:
    """Record the vLLM wheel the image installed: compiled here, from the wheel cache, or the recipe's."""
    import hashlib

    wheel = Path(args.wheel)
    digest = hashlib.sha256()
    with open(wheel, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    note = {"origin": args.origin, "filename": wheel.name, "sha256": digest.hexdigest(), "cache_key": args.key,
            "compiled_for": args.compiled_for}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(note, sort_keys=True) + "\n")
    print(f"vllm wheel: {args.origin}, {wheel.name}, sha256 {note['sha256']}")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    checks = smoke_static(Path(args.home)) if args.tier == "static" else smoke_gpu(Path(args.home))
    for name, state, detail in checks:
        print(json.dumps({"check": name, "state": state, "detail": detail}))
    return 1 if any(state == "failed" for _, state, _ in checks) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="imagetool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("apply", help="apply one mod (a folder holding mod.json and its assets)")
    p.add_argument("mod")
    p.add_argument("--root", help="the component root (default: found from the installed package)")
    p.add_argument("--record", help="write the result to this JSON file")
    p.add_argument("--patcher-timeout", type=float, default=PATCHER_TIMEOUT, metavar="SECONDS",
                   help=f"time limit of each run of a patcher (default {PATCHER_TIMEOUT:g})")
    p.set_defaults(func=_cmd_apply)
    p = sub.add_parser("patcher-child", help="(internal) run a patcher for apply, in a child process")
    p.add_argument("patcher")
    p.set_defaults(func=_cmd_patcher_child)
    p = sub.add_parser("verify", help="run the verify checks of mods")
    p.add_argument("mods", nargs="+")
    p.add_argument("--root")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("protect", help="record the base's versions of packages pip must not replace")
    p.add_argument("--out", required=True)
    p.add_argument("names", nargs="*")
    p.set_defaults(func=_cmd_protect)
    p = sub.add_parser("check-protected", help="fail if a protected package was replaced")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_check_protected)
    p = sub.add_parser("record", help="write the build record into HOME/build-record.json")
    p.add_argument("home")
    p.set_defaults(func=_cmd_record)
    p = sub.add_parser("note-wheel", help="record the vLLM wheel installed and where it came from")
    p.add_argument("wheel")
    p.add_argument("--origin", required=True, choices=["compiled", "cache", "recipe"])
    p.add_argument("--key", help="the wheel cache key (origin cache and compiled)")
    p.add_argument("--compiled-for", help="origin cache: the build that compiled it (VARIANT-HASH at TIME)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_note_wheel)
    p = sub.add_parser("smoke", help="run a smoke tier inside the image; one JSON line per check")
    p.add_argument("--tier", choices=["static", "gpu"], default="static")
    p.add_argument("--home", default="/opt/sparkforge")
    p.set_defaults(func=_cmd_smoke)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
