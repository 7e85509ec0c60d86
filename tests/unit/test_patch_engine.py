"""Patch mods are applied by `git apply` itself; these tests hold the engine to git's answers.

The rules: forward first (`git apply` takes the patch: applied), then reverse (`git apply -R
--check` takes it: already applied), else failed with git's own words; `--unidiff-zero` for a
patch with no context line. What git is never asked: file names outside the tree, and what a git
diff changes outside its hunks (renames, copies, deletions, modes, binary), refused in one line.
Every case runs on real vLLM files and is compared with `git apply` run directly on the same bytes.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sparkforge import inimage
from sparkforge.recipe import sources
from sparkforge.inimage import ModFailure
from sparkforge.inimage.contract import ModState
from sparkforge.inimage.patch import plan_patch as _plan_patch
from tests.support.seam import mod_doc

ALREADY, APPLIED = ModState.ALREADY, ModState.APPLIED
REL = "vllm/target.py"
CASES = int(os.environ.get("SPARKFORGE_DIFF_CASES", "300"))  # generated cases for each vLLM release


def plan_patch(_name: str, diff: bytes, root: Path):
    return _plan_patch(diff, root)


def run_engine(text: bytes, diff: bytes, tmp: Path) -> tuple[str, bytes | None]:
    """(applied|already|failed, the file after) for the engine on a tree holding text at REL."""
    root = tmp / "engine"
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / REL).write_bytes(text)
    try:
        state, writes = _plan_patch(diff, root)
    except ModFailure:
        return "failed", None
    return state, (writes.get((root / REL).resolve(), text) if state == APPLIED else text)


def git_run(text: bytes, diff: bytes, tmp: Path, *, reverse: bool = False) -> tuple[bytes | None, int]:
    """(the file after `git apply -v` run directly, or None when git refuses; the sum of its hunks'
    offsets as git reports them); --unidiff-zero for context-free patches."""
    root = tmp / ("git-r" if reverse else "git")
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / REL).write_bytes(text)
    (tmp / "p.diff").write_bytes(diff)
    cmd = ["git", "apply", "-v"] + (["-R"] if reverse else []) + (["--unidiff-zero"] if zero_context(diff) else [])
    proc = subprocess.run(cmd + [str(tmp / "p.diff")], cwd=root, capture_output=True,
                          env={"PATH": os.environ["PATH"], "GIT_CEILING_DIRECTORIES": str(tmp), "HOME": str(tmp)})
    offsets = sum(abs(int(k)) for k in re.findall(rb"succeeded at \d+ \(offset (-?\d+) lines?\)", proc.stderr))
    return ((root / REL).read_bytes() if proc.returncode == 0 else None), offsets


def git_apply(text: bytes, diff: bytes, tmp: Path, *, reverse: bool = False) -> bytes | None:
    """The file after `git apply` run directly (None when git refuses)."""
    return git_run(text, diff, tmp, reverse=reverse)[0]


def own_place(text: bytes, diff: bytes) -> str | None:
    """A context-free diff's state from its hunks' lines at each hunk's own place in text: an insertion
    whose lines stand there is already applied, a deletion whose lines stand there is still to do, a
    change is whichever side stands there alone; None when hunks disagree or the file has two sections."""
    if len(re.findall(rb"^\+\+\+ ", diff, re.M)) > 1:
        return None
    lines, states = _lines_of(text), set()
    for header, body in re.findall(rb"^(@@ [^\n]* @@)[^\n]*\n((?:[-+\\][^\n]*(?:\n|$))*)", diff, re.M):
        old_start, new_start = (int(n) for n in re.findall(rb"[-+](\d+)", header))
        old: list[bytes] = []
        new: list[bytes] = []
        previous = b""
        for line in _lines_of(body):
            if line.startswith(b"\\"):
                last = new if previous == b"+" else old
                last[-1] = last[-1].removesuffix(b"\n")
            else:
                previous = line[:1]
                (new if previous == b"+" else old).append(line[1:])
        old_here = bool(old) and lines[old_start - 1:old_start - 1 + len(old)] == old
        new_here = bool(new) and lines[new_start - 1:new_start - 1 + len(new)] == new
        if not old:
            states.add(ALREADY if new_here else APPLIED)
        elif not new:
            states.add(APPLIED if old_here else ALREADY)
        else:
            states.add(None if old_here == new_here else APPLIED if old_here else ALREADY)
    return states.pop() if len(states) == 1 else None


def git_state(text: bytes, diff: bytes, tmp: Path) -> tuple[str, bytes | None]:
    """The documented rule (docs/mods.md), with git run directly: forward alone -> applied (git's file),
    reverse alone -> already, neither -> failed; both -> the direction whose hunks stand nearer their
    lines, or for a context-free diff where its hunks' lines stand at their own places, else failed
    as ambiguous."""
    (ahead, ahead_off), (back, back_off) = git_run(text, diff, tmp), git_run(text, diff, tmp, reverse=True)
    if ahead is None:
        return (ALREADY, text) if back is not None else ("failed", None)
    if back is None:
        return APPLIED, ahead
    if zero_context(diff):
        state = own_place(text, diff)
        return (state, ahead if state == APPLIED else text) if state else ("failed", None)
    if ahead_off == back_off:
        return "failed", None
    return (APPLIED, ahead) if ahead_off < back_off else (ALREADY, text)


def zero_context(diff: bytes) -> bool:
    """Whether no hunk of the diff holds a context line (read from the text, not by the engine)."""
    in_hunk = False
    for line in diff.split(b"\n"):
        if line.startswith(b"@@"):
            in_hunk = True
        elif line.startswith((b"diff ", b"--- ", b"index ")):
            in_hunk = False
        elif in_hunk and line.startswith(b" "):
            return False
    return True


def make_patch(old: bytes, new: bytes, tool: str, context: int, tmp: Path) -> bytes:
    """A unified diff from old to new with a/REL and b/REL headers, made by `diff` or `git diff`."""
    for side, body in (("old", old), ("new", new)):
        (tmp / side / "vllm").mkdir(parents=True, exist_ok=True)
        (tmp / side / REL).write_bytes(body)
    if tool == "diff":
        cmd = ["diff", f"-U{context}", "--label", f"a/{REL}", "--label", f"b/{REL}", f"old/{REL}", f"new/{REL}"]
    else:
        cmd = ["git", "diff", "--no-index", "--no-color", f"-U{context}", f"old/{REL}", f"new/{REL}"]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True)
    assert proc.returncode == 1, proc.stderr
    return proc.stdout.replace(f"a/old/{REL}".encode(), f"a/{REL}".encode()).replace(
        f"b/new/{REL}".encode(), f"b/{REL}".encode())


@pytest.fixture(scope="module", params=["0.17.0", "0.18.1"])
def vllm_files(request) -> list[bytes]:
    """Python files of a real vLLM release, of a size that keeps each case fast."""
    tree = sources.release_tree("vllm", request.param)
    files = sorted(p for p in (tree / "vllm").rglob("*.py") if 200 < p.stat().st_size < 40_000)
    assert len(files) > 100
    return [p.read_bytes() for p in files]


@pytest.fixture(scope="module")
def real_file() -> bytes:
    """vllm/config/compilation.py of vLLM 0.17.0, a file the shipped mods patch."""
    return (sources.release_tree("vllm", "0.17.0") / "vllm" / "config" / "compilation.py").read_bytes()


def _lines_of(text: bytes) -> list[bytes]:
    return re.findall(rb"[^\n]*\n|[^\n]+$", text)


# ------------------------------------------------------------------ what users found, against git directly


@pytest.mark.network  # a real vLLM release from the package index
def test_a_patch_whose_last_line_has_no_line_end_fails_as_git_says(real_file: bytes, tmp_path: Path) -> None:
    lines = _lines_of(real_file)
    new = b"".join(lines[:40] + [b"# sparkforge\n"] + lines[40:])
    diff = make_patch(real_file, new, "git", 3, tmp_path / "make").rstrip(b"\n")
    assert git_apply(real_file, diff, tmp_path) is None  # git: corrupt patch
    state, after = run_engine(real_file, diff, tmp_path)
    assert (state, after) == ("failed", None)
    with pytest.raises(ModFailure, match="git apply: corrupt patch"):
        _plan_patch(diff, tmp_path / "engine")


@pytest.mark.network  # a real vLLM release from the package index
def test_two_sections_for_one_file_apply_both(real_file: bytes, tmp_path: Path) -> None:
    lines = _lines_of(real_file)
    middle = b"".join(lines[:30] + [b"# first\n"] + lines[30:])
    last = _lines_of(middle)
    new = b"".join(last[:200] + [b"# second\n"] + last[200:])
    diff = make_patch(real_file, middle, "diff", 3, tmp_path / "one") + make_patch(middle, new, "diff", 3,
                                                                                   tmp_path / "two")
    assert diff.count(b"+++ b/" + REL.encode()) == 2
    assert git_apply(real_file, diff, tmp_path) == new
    assert run_engine(real_file, diff, tmp_path) == (APPLIED, new)
    assert run_engine(new, diff, tmp_path)[0] == ALREADY


@pytest.mark.network  # a real vLLM release from the package index
def test_a_hunk_whose_new_side_stands_further_down_is_applied_not_already(real_file: bytes, tmp_path: Path) -> None:
    lines = _lines_of(real_file)
    window = lines[300:307]  # three lines, the one to insert, three lines
    pristine = b"".join(lines[:100] + window[:3] + window[4:] + lines[100:120] + window + lines[120:])
    new = b"".join(lines[:100] + window + lines[100:120] + window + lines[120:])
    diff = make_patch(pristine, new, "diff", 3, tmp_path / "make")
    assert git_apply(pristine, diff, tmp_path, reverse=True) is not None  # why "already" was tempting
    assert run_engine(pristine, diff, tmp_path) == (APPLIED, new) == (APPLIED, git_apply(pristine, diff, tmp_path))


@pytest.mark.network  # a real vLLM release from the package index
@pytest.mark.parametrize("tool", ["diff", "git"])
def test_u0_diffs_of_a_real_file_apply_as_git_applies_them(tool: str, real_file: bytes, tmp_path: Path) -> None:
    lines = _lines_of(real_file)
    new = b"".join(lines[:10] + [b"# added\n"] + lines[11:50] + lines[52:])
    diff = make_patch(real_file, new, tool, 0, tmp_path / "make")
    assert zero_context(diff)
    assert run_engine(real_file, diff, tmp_path) == git_state(real_file, diff, tmp_path) == (APPLIED, new)


@pytest.mark.network  # a real vLLM release from the package index
def test_crlf_files_and_patches_are_kept_exactly(real_file: bytes, tmp_path: Path) -> None:
    old = real_file.replace(b"\n", b"\r\n")
    lines = _lines_of(old)
    new = b"".join(lines[:60] + [b"# crlf\r\n"] + lines[61:])
    for context in (0, 3):
        diff = make_patch(old, new, "diff", context, tmp_path / f"make{context}")
        assert run_engine(old, diff, tmp_path) == git_state(old, diff, tmp_path) == (APPLIED, new)
        assert run_engine(new, diff, tmp_path)[0] == ALREADY


@pytest.mark.network  # a real vLLM release from the package index
def test_a_diff_of_file_orig_against_file_applies_to_file_as_git_does(real_file: bytes, tmp_path: Path) -> None:
    """`diff -u vllm/x.py.orig vllm/x.py`, run in the component's root: git applies it (-p0) to vllm/x.py."""
    lines = _lines_of(real_file)
    new = b"".join(lines[:70] + [b"# edited by hand\n"] + lines[70:])
    make = tmp_path / "make"
    (make / "vllm").mkdir(parents=True)
    (make / f"{REL}.orig").write_bytes(real_file)
    (make / REL).write_bytes(new)
    diff = subprocess.run(["diff", "-u", f"{REL}.orig", REL], cwd=make, capture_output=True).stdout
    assert diff.startswith(f"--- {REL}.orig\t".encode())
    theirs = tmp_path / "git"
    (theirs / "vllm").mkdir(parents=True)
    (theirs / REL).write_bytes(real_file)
    (tmp_path / "p.diff").write_bytes(diff)
    subprocess.run(["git", "apply", "-p0", str(tmp_path / "p.diff")], cwd=theirs, check=True,
                   env={"PATH": os.environ["PATH"], "GIT_CEILING_DIRECTORIES": str(tmp_path), "HOME": str(tmp_path)})
    assert sorted(p.name for p in (theirs / "vllm").iterdir()) == ["target.py"]
    assert run_engine(real_file, diff, tmp_path) == (APPLIED, new) == (APPLIED, (theirs / REL).read_bytes())
    assert run_engine(new, diff, tmp_path)[0] == ALREADY


@pytest.mark.network  # a real vLLM release from the package index
def test_a_patch_git_calls_corrupt_fails_and_writes_nothing(real_file: bytes, tmp_path: Path) -> None:
    lines = _lines_of(real_file)
    new = b"".join(lines[:80] + [b"# x\n"] + lines[80:])
    diff = make_patch(real_file, new, "git", 3, tmp_path / "make")
    corrupt = diff.replace(b"\n+# x\n", b"\n+# x\n junk that is no context line of the file\n")
    assert git_apply(real_file, corrupt, tmp_path) is None
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "p.diff").write_bytes(corrupt)
    root = tmp_path / "root"
    (root / "vllm").mkdir(parents=True)
    (root / REL).write_bytes(real_file)
    result = inimage.apply_mod(mod_doc({"name": "m", "kind": "patch", "patch": "p.diff"}), tmp_path / "mod", root)
    assert result.state == "failed" and REL in result.detail
    assert (root / REL).read_bytes() == real_file


@pytest.mark.network  # a real vLLM release from the package index
def test_a_failed_hunk_is_named_by_its_header(real_file: bytes, tmp_path: Path) -> None:
    lines = _lines_of(real_file)
    new = b"".join(lines[:80] + [b"# x\n"] + lines[80:])
    diff = make_patch(real_file, new, "diff", 3, tmp_path / "make")
    header = re.search(rb"^@@ [^@]+ @@", diff, re.M).group(0).decode()
    broken = b"".join(lines[:79] + [b"# changed meanwhile\n"] + lines[80:])
    root = tmp_path / "root"
    (root / "vllm").mkdir(parents=True)
    (root / REL).write_bytes(broken)
    assert git_apply(broken, diff, tmp_path) is None
    with pytest.raises(ModFailure, match=re.escape(f"{REL}: hunk {header} does not match the file")):
        _plan_patch(diff, root)


@pytest.mark.network  # a real vLLM release from the package index
def test_without_git_a_patch_fails_in_one_line(real_file: bytes, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    diff = make_patch(real_file, real_file + b"# x\n", "diff", 3, tmp_path / "make")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ModFailure, match="git is not installed here"):
        run_engine_strict(real_file, diff, tmp_path)


def run_engine_strict(text: bytes, diff: bytes, tmp: Path):
    root = tmp / "strict"
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / REL).write_bytes(text)
    return _plan_patch(diff, root)


@pytest.mark.network  # a real vLLM release from the package index
def test_no_outer_repository_is_used(real_file: bytes, tmp_path: Path) -> None:
    """The tree lies inside a git repository whose index knows nothing of the file: git apply run
    there would look at the repository; the engine's copy is outside any."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    lines = _lines_of(real_file)
    new = b"".join(lines[:5] + [b"# y\n"] + lines[5:])
    diff = make_patch(real_file, new, "diff", 3, tmp_path / "make")
    assert run_engine(real_file, diff, tmp_path / "deep") == (APPLIED, new)


# ------------------------------------------------------------------ what git is never asked


def test_headers_without_hunks_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModFailure, match="holds no hunk"):
        plan_patch("m", f"--- a/{REL}\n+++ b/{REL}\n".encode(), tmp_path)


GIT_ONLY = {  # what `git diff` says outside its hunks; applying only the hunks would drop it
    "binary": (b"diff --git a/logo.png b/logo.png\nindex 1e2..3f4 100644\n"
               b"Binary files a/logo.png and b/logo.png differ\n",
               "logo.png: a binary file change (Binary files a/logo.png and b/logo.png differ)"),
    "binary data": (b"diff --git a/w.bin b/w.bin\nnew file mode 100644\nindex 0000000000000000000000000000000000000000"
                    b"..57ac8dfea0a9e139b853b7046845ac161d6d2bd5\nGIT binary patch\nliteral 9\n"
                    b"QcmZQzOv=nlEUIJx01GDqhX4Qo\n\nliteral 0\nHcmV?d00001\n\n",  # git diff --binary of 9 bytes
                    "w.bin: a binary file change"),
    "rename": (b"diff --git a/old.py b/new.py\nsimilarity index 100%\nrename from old.py\nrename to new.py\n",
               "a rename (rename old.py => new.py (100%), as git apply reads the diff)"),
    "mode": (b"diff --git a/run.sh b/run.sh\nold mode 100644\nnew mode 100755\n--- a/run.sh\n+++ b/run.sh\n"
             b"@@ -1 +1 @@\n-a\n+b\n", "a file mode change (mode change 100644 => 100755 run.sh, as git apply"),
    "diff -r binary": (b"Binary files old/logo.png and new/logo.png differ\n--- old/a\n+++ new/a\n@@ -1 +1 @@\n-a\n+b\n",
                       "a binary file change (Binary files old/logo.png"),
    "diff -r only in": (b"Only in new/pkg: extra.py\n--- old/a\n+++ new/a\n@@ -1 +1 @@\n-a\n+b\n",
                        "Only in new/pkg: extra.py: a file only one side has"),
    "new executable": (b"diff --git a/t.sh b/t.sh\nnew file mode 100755\nindex 0000000..1\n--- /dev/null\n"
                       b"+++ b/t.sh\n@@ -0,0 +1 @@\n+x\n",
                       "a new file with a mode other than 100644 (create mode 100755 t.sh"),
}


@pytest.mark.parametrize("case", sorted(GIT_ONLY))
def test_git_changes_outside_hunks_are_refused_not_dropped(case: str, tmp_path: Path) -> None:
    diff, why = GIT_ONLY[case]
    with pytest.raises(ModFailure, match=re.escape(why)):
        plan_patch("m", diff, tmp_path)


def test_a_git_diff_of_text_files_with_a_mail_preamble_applies(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"a\n")
    diff = (b"From 1f0e Mon Sep 17 00:00:00 2001\nSubject: [PATCH] rename from the old name\n\n"
            b"old mode of thinking\n---\n a.txt | 2 +-\n\ndiff --git a/a.txt b/a.txt\nindex 7898192..6178079 100644\n"
            b"--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-a\n+b\n")
    assert plan_patch("m", diff, tmp_path)[0] == APPLIED


def test_a_new_empty_file_of_a_git_diff_is_created_not_dropped(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"a\n")
    diff = (b"diff --git a/pkg/__init__.py b/pkg/__init__.py\nnew file mode 100644\nindex 0000000..e69de29\n"
            b"diff --git a/a.txt b/a.txt\nindex 7898192..6178079 100644\n--- a/a.txt\n+++ b/a.txt\n"
            b"@@ -1 +1 @@\n-a\n+b\n")
    state, writes = plan_patch("m", diff, tmp_path)
    assert state == APPLIED and writes == {tmp_path / "pkg" / "__init__.py": b"", tmp_path / "a.txt": b"b\n"}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_bytes(b"")
    (tmp_path / "a.txt").write_bytes(b"b\n")
    assert plan_patch("m", diff, tmp_path) == (ALREADY, {})


def test_a_commit_message_after_a_git_section_is_not_read_as_its_header(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a\n")
    (tmp_path / "c").write_bytes(b"c\n")
    two_commits = (b"From 1f0e\nSubject: [PATCH 1/2] one\n\n---\ndiff --git a/a b/a\nindex 1..2 100644\n--- a/a\n"
                   b"+++ b/a\n@@ -1 +1 @@\n-a\n+b\n-- \n2.40.0\n\nFrom 2a1b\nSubject: [PATCH 2/2] two\n\n"
                   b"old mode of thinking is gone\n---\ndiff --git a/c b/c\nindex 1..2 100644\n--- a/c\n+++ b/c\n"
                   b"@@ -1 +1 @@\n-c\n+d\n")
    assert plan_patch("m", two_commits, tmp_path)[0] == APPLIED


def test_a_context_free_deletion_of_a_last_line_without_line_end_does_what_git_does(tmp_path: Path) -> None:
    """Found by the differential test below: `diff -U0` of deleting a last line that has no line end,
    after a line of the same text. git apply deletes the line before it (its line hash skips the line
    end), and so does the engine: byte for byte what git does, even where that is not the new file."""
    old, new = b"a\nb\nT,\nT,", b"a\nb\nT,\n"
    diff = make_patch(old, new, "diff", 0, tmp_path / "make")
    assert b"@@ -4 +3,0 @@" in diff and b"\\ No newline at end of file" in diff
    assert git_apply(old, diff, tmp_path) == b"a\nb\nT,"
    assert run_engine(old, diff, tmp_path) == (APPLIED, b"a\nb\nT,")


def test_truncated_hunk_is_an_error_and_nothing_is_written(tmp_path: Path) -> None:
    old = b"".join(b"line %d\n" % i for i in range(10))
    diff = make_patch(old, old.replace(b"line 4\n", b"line four\n"), "diff", 3, tmp_path)
    cut = b"\n".join(diff.split(b"\n")[:-3]) + b"\n"  # drop the last two context lines
    (tmp_path / "root" / "vllm").mkdir(parents=True)
    (tmp_path / "root" / REL).write_bytes(old)
    with pytest.raises(ModFailure, match="truncated"):
        plan_patch("m", cut, tmp_path / "root")
    spec = mod_doc({"name": "m", "kind": "patch", "patch": "p.diff"})
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "p.diff").write_bytes(cut)
    result = inimage.apply_mod(spec, tmp_path / "mod", tmp_path / "root")
    assert result.state == "failed" and "truncated" in result.detail
    assert (tmp_path / "root" / REL).read_bytes() == old


@pytest.mark.parametrize("bad, why", [
    (b"@@ -1,2 +1,2 @@\n-a\n+b\n c\n c2\n", "more lines than its header"),
    (b"@@ -1 +1 @@\n a\n", "changes nothing"),
    (b"@@ -1 +1 @@\n-a\n?b\n", "truncated"),
    (b"@@ -x +1 @@\n-a\n+b\n", "malformed hunk header"),
])
def test_hunks_must_match_their_headers(bad: bytes, why: str, tmp_path: Path) -> None:
    with pytest.raises(ModFailure, match=why):
        plan_patch("m", f"--- a/{REL}\n+++ b/{REL}\n".encode() + bad, tmp_path)


def test_crlf_and_no_newline_at_end_are_kept_exactly(tmp_path: Path) -> None:
    old = b"one\r\ntwo\r\nthree\r\nfour"
    new = b"one\r\n2\r\nthree\r\nfour\r\nfive"
    for context in (0, 3):
        diff = make_patch(old, new, "diff", context, tmp_path)
        assert b"\\ No newline at end of file" in diff
        assert run_engine(old, diff, tmp_path) == (APPLIED, new) == (APPLIED, git_apply(old, diff, tmp_path))
        assert run_engine(new, diff, tmp_path)[0] == ALREADY


def test_a_hunk_with_no_trailing_context_must_match_at_the_end(tmp_path: Path) -> None:
    old = b"a\nb\nc\n"
    diff = make_patch(old, b"a\nb\nc\nd\n", "diff", 3, tmp_path)
    drifted = old + b"tail\n"
    assert run_engine(drifted, diff, tmp_path)[0] == "failed"
    assert git_apply(drifted, diff, tmp_path) is None


# ------------------------------------------------------------------ differential, on real vLLM files


@dataclass
class Tally:
    cases: int = 0
    applied: int = 0
    already: int = 0
    failed: int = 0
    reapplied: int = 0  # applied once, the patch's forward still applies (git offers no "already" there)
    mutated: int = 0  # diffs cut at their last line end or split into two sections for one file


line_text = st.sampled_from([b"", b"x = 1", b"    pass", b"# sparkforge", b"    return None", b"}", b"\t"])


@st.composite
def edit_case(draw, files: list[bytes]):
    text = draw(st.sampled_from(files))
    lines = re.findall(rb"[^\n]*\n|[^\n]+$", text)
    start = draw(st.integers(0, max(0, len(lines) - 1)))
    lines = lines[start:start + draw(st.integers(1, 60))]
    if draw(st.booleans()):
        lines = [ln.replace(b"\n", b"\r\n") for ln in lines]
    end = b"\r\n" if lines and lines[0].endswith(b"\r\n") else b"\n"
    if draw(st.integers(0, 5)) == 0 and lines:
        lines[-1] = lines[-1].rstrip(b"\r\n")
    old = list(lines)
    new = _edited(draw, list(lines), end)
    tool = draw(st.sampled_from(["diff", "git"]))
    context = draw(st.sampled_from([0, 0, 1, 3]))
    drift = _edited(draw, list(old), end)
    mutation = draw(st.sampled_from([None, None, None, "cut", "split"]))
    return b"".join(old), b"".join(new), tool, context, b"".join(drift), mutation


def mutate(diff: bytes, mutation: str | None) -> bytes:
    """A diff git may call corrupt (the last line end cut off), or one file's hunks as two sections."""
    if mutation == "cut":
        return diff.rstrip(b"\n")
    if mutation == "split":
        head, sep, rest = diff.partition(b"\n@@ ")
        hunks = re.split(rb"\n(?=@@ )", sep[1:] + rest)
        if len(hunks) > 1:
            files = f"--- a/{REL}\n+++ b/{REL}\n".encode()
            return head + b"\n" + hunks[0] + b"\n" + files + b"\n".join(hunks[1:])
    return diff


def _edited(draw, lines: list[bytes], end: bytes) -> list[bytes]:
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "repeat", "eof"]))
        pos = draw(st.integers(0, len(lines)))
        if op == "insert":
            lines[pos:pos] = [draw(line_text) + end for _ in range(draw(st.integers(1, 3)))]
        elif op == "delete" and lines:
            del lines[min(pos, len(lines) - 1):pos + draw(st.integers(1, 3))]
        elif op == "replace" and pos < len(lines):
            lines[pos] = draw(line_text) + end
        elif op == "repeat" and lines:
            # A copy of a nearby line: the repeated content that a search of the whole file would find.
            src = lines[draw(st.integers(max(0, pos - 3), min(len(lines) - 1, pos + 3)))]
            lines[pos:pos] = [src if src.endswith(b"\n") else src + end]
        elif op == "eof" and lines:
            last = lines[-1]
            lines[-1] = last.rstrip(b"\r\n") if last.endswith(b"\n") else last + end
    return lines


@pytest.mark.network  # a real vLLM release from the package index
def test_engine_agrees_with_git_apply_on_edits_of_real_vllm_files(vllm_files: list[bytes], fast_tmp: Path) -> None:
    """The engine's state and bytes are git's rule run directly: on the file the patch was made from,
    on the new file (the second application) and on a drifted copy. Each case's folders are made in
    fast_tmp."""
    tally = Tally()

    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(edit_case(vllm_files))
    def check(case) -> None:
        old, new, tool, context, drifted, mutation = case
        assume(old != new)
        with tempfile.TemporaryDirectory(dir=fast_tmp) as tmp_dir:
            tmp = Path(tmp_dir)
            plain = make_patch(old, new, tool, context, tmp / "make")
            diff = mutate(plain, mutation)
            tally.cases += 1
            tally.mutated += diff != plain
            for text in (old, new, drifted):
                state, after = run_engine(text, diff, tmp / "e")
                assert (state, after) == git_state(text, diff, tmp / "g"), (text, diff)
                if text is old:
                    tally.applied += state == APPLIED
                    tally.failed += state == "failed"
                    if diff == plain and not mutation:
                        assert state == APPLIED and after == new or zero_context(diff), diff
                elif text is new:
                    tally.already += state == ALREADY
                    tally.reapplied += state == APPLIED

    check()
    print(f"\ndifferential cases: {tally}")
    assert tally.applied > tally.cases // 2 and tally.already > tally.cases // 5 and tally.mutated


def _twice(old: bytes, new: bytes, context: int, tmp: Path) -> list[tuple[str, bytes | None]]:
    """The engine's (state, file) applying a diff of old -> new, then again on what it wrote."""
    diff = make_patch(old, new, "diff", context, tmp / "make")
    first = run_engine(old, diff, tmp / "first")
    return [first, run_engine(first[1], diff, tmp / "second")]


def test_a_second_application_is_already_when_the_context_repeats_in_the_file(tmp_path: Path) -> None:
    # git finds a hunk's context away from its line too: here the same block stands twice, so after the
    # first application git would happily apply the hunk again at the second copy.
    block = b"".join(b"line %d\n" % i for i in range(6))
    old = block + b"middle\n" + block
    new = block[:21] + b"X\n" + block[21:] + b"middle\n" + block
    assert _twice(old, new, 3, tmp_path) == [(APPLIED, new), (ALREADY, new)]


def test_a_context_free_insertion_is_already_there_the_second_time(tmp_path: Path) -> None:
    old, new = b"a\nb\nc\n", b"a\nX\nb\nc\n"
    assert _twice(old, new, 0, tmp_path) == [(APPLIED, new), (ALREADY, new)]

