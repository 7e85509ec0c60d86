"""The patch engine of imagetool.py, exact by rule and proven against `git apply`.

The rules: a hunk applies as `git apply` applies it (exact bytes, offsets allowed, no fuzz;
a patch with no context line anywhere as with --unidiff-zero); a patch is "already applied"
only when every hunk's new side stands at the hunk's own place; a diff must hold hunks, and
every hunk exactly the lines its header counts. The differential test makes edits of real
vLLM files, writes the patch with `diff` or `git diff --no-index`, and compares the engine
with `git apply` on the original file and on a drifted copy of it.
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

from sparkforge import imagetool, sources
from sparkforge.imagetool import ALREADY, APPLIED, ModFailure, plan_patch

REL = "vllm/target.py"
CASES = int(os.environ.get("SPARKFORGE_DIFF_CASES", "400"))  # generated cases for each vLLM release


def run_engine(text: bytes, diff: bytes, tmp: Path) -> tuple[str, bytes | None]:
    """(applied|already|failed, the file after) for the engine on a tree holding text at REL."""
    root = tmp / "engine"
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / REL).write_bytes(text)
    try:
        state, writes = plan_patch("test", diff, root)
    except ModFailure:
        return "failed", None
    return state, (writes[(root / REL).resolve()] if state == APPLIED else text)


def git_apply(text: bytes, diff: bytes, tmp: Path, *, reverse: bool = False) -> bytes | None:
    """The file after `git apply` (None when git refuses); --unidiff-zero for context-free patches."""
    root = tmp / ("git-r" if reverse else "git")
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / REL).write_bytes(text)
    (tmp / "p.diff").write_bytes(diff)
    cmd = ["git", "apply"] + (["-R"] if reverse else []) + (["--unidiff-zero"] if zero_context(diff) else [])
    proc = subprocess.run(cmd + [str(tmp / "p.diff")], cwd=root, capture_output=True)
    return (root / REL).read_bytes() if proc.returncode == 0 else None


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


# ------------------------------------------------------------------ the three silent cases and bad diffs


def test_u0_insertion_of_a_line_present_elsewhere_is_applied_at_its_place(tmp_path: Path) -> None:
    old = b"a\nb\nc\nx\nd\ne\n"
    new = b"a\nx\nb\nc\nx\nd\ne\n"
    diff = make_patch(old, new, "diff", 0, tmp_path)
    assert b"@@ -1,0 +2 @@" in diff
    assert run_engine(old, diff, tmp_path) == (APPLIED, new)
    assert git_apply(old, diff, tmp_path) == new
    assert run_engine(new, diff, tmp_path) == (ALREADY, new)


def test_headers_without_hunks_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModFailure, match="holds no hunk"):
        plan_patch("m", f"--- a/{REL}\n+++ b/{REL}\n".encode(), tmp_path)


GIT_ONLY = {  # what `git diff` says outside its hunks; applying only the hunks would drop it
    "binary": (b"diff --git a/logo.png b/logo.png\nindex 1e2..3f4 100644\n"
               b"Binary files a/logo.png and b/logo.png differ\n", "logo.png: a binary file change"),
    "binary data": (b"diff --git a/w.bin b/w.bin\nnew file mode 100644\nindex 0000000..5e1c309\n"
                    b"GIT binary patch\nliteral 5\nMcmWGYEiP6D00tNUb^rhX\n\nliteral 0\nHcmV?d00001\n\n",
                    "w.bin: a binary file change"),
    "rename": (b"diff --git a/old.py b/new.py\nsimilarity index 100%\nrename from old.py\nrename to new.py\n",
               "new.py: a rename"),
    "mode": (b"diff --git a/run.sh b/run.sh\nold mode 100644\nnew mode 100755\n--- a/run.sh\n+++ b/run.sh\n"
             b"@@ -1 +1 @@\n-a\n+b\n", "run.sh: a file mode change"),
    "diff -r binary": (b"Binary files old/logo.png and new/logo.png differ\n--- old/a\n+++ new/a\n@@ -1 +1 @@\n-a\n+b\n",
                       "a binary file change (Binary files old/logo.png"),
    "diff -r only in": (b"Only in new/pkg: extra.py\n--- old/a\n+++ new/a\n@@ -1 +1 @@\n-a\n+b\n",
                        "Only in new/pkg: extra.py: a file only one side has"),
    "new executable": (b"diff --git a/t.sh b/t.sh\nnew file mode 100755\nindex 0000000..1\n--- /dev/null\n"
                       b"+++ b/t.sh\n@@ -0,0 +1 @@\n+x\n", "t.sh: a new file with mode 100755"),
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
    spec = {"name": "m", "kind": "patch", "patch": "p.diff", "verify": []}
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "p.diff").write_bytes(cut)
    result = imagetool.apply_mod(spec, tmp_path / "mod", tmp_path / "root")
    assert result.state == "failed" and "truncated" in result.detail
    assert (tmp_path / "root" / REL).read_bytes() == old


@pytest.mark.parametrize("bad, why", [
    (b"@@ -1,2 +1,2 @@\n-a\n+b\n c\n c2\n", "more lines than its header"),
    (b"@@ -1 +1 @@\n a\n", "changes nothing"),
    (b"@@ -3,1 +3,1 @@\n-c\n+C\n@@ -1,1 +1,1 @@\n-a\n+A\n", "overlaps or precedes"),
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


@pytest.fixture(scope="module", params=["0.17.0", "0.18.1"])
def vllm_files(request) -> list[bytes]:
    """Python files of a real vLLM release, of a size that keeps each case fast."""
    tree = sources.release_tree("vllm", request.param)
    files = sorted(p for p in (tree / "vllm").rglob("*.py") if 200 < p.stat().st_size < 40_000)
    assert len(files) > 100
    return [p.read_bytes() for p in files]


@dataclass
class Tally:
    cases: int = 0
    applied: int = 0
    already_first: int = 0  # context-free insertions whose new side the file already holds at its place
    drifted_applied: int = 0
    drifted_failed: int = 0
    drifted_already: int = 0
    git_misplaced: int = 0  # cases where git's own result is not the file the patch was made to


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
    return b"".join(old), b"".join(new), tool, context, b"".join(drift)


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


def _unclear_deletion(diff: bytes, new: bytes) -> bool:
    """A context-free hunk that only deletes lines which also follow its place in the new file:
    no rule can tell such a patch applied from not applied (git -R cannot either)."""
    if not zero_context(diff):
        return False
    lines = re.findall(rb"[^\n]*\n|[^\n]+$", new)
    for m in re.finditer(rb"^@@ -\d+(?:,\d+)? \+(\d+),0 @@\n((?:-.*\n?)+)", diff, re.M):
        place, removed = int(m.group(1)), [ln[1:] + b"\n" for ln in m.group(2).split(b"\n") if ln]
        if [ln.rstrip(b"\n") for ln in lines[place:place + len(removed)]] == [r.rstrip(b"\n") for r in removed]:
            return True
    return False


@pytest.mark.network  # a real vLLM release from the package index
def test_engine_agrees_with_git_apply_on_edits_of_real_vllm_files(vllm_files: list[bytes]) -> None:
    tally = Tally()
    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(edit_case(vllm_files))
    def check(case) -> None:
        old, new, tool, context, drifted = case
        assume(old != new)
        with tempfile.TemporaryDirectory() as tmp_dir:
            tmp = Path(tmp_dir)
            diff = make_patch(old, new, tool, context, tmp / "make")
            tally.cases += 1
            # The file the patch was made from: applied (git agrees, byte for byte), or, where the
            # new side already stands at its place (a context-free insertion of a line that is there
            # already), already applied, and git's reverse applies too.
            state, after = run_engine(old, diff, tmp)
            if state == ALREADY:
                assert git_apply(old, diff, tmp, reverse=True) is not None
                tally.already_first += 1
            else:
                reference = git_apply(old, diff, tmp)
                assert (state, after) == (APPLIED, reference)
                if reference == new:
                    tally.applied += 1
                    # Applied once, it is detected as applied.
                    again = run_engine(new, diff, tmp)[0]
                    # (A context-free deletion of a line that repeats right after it cannot be told
                    # from one not yet made; the engine then applies again or fails, never silently skips.)
                    assert again == ALREADY or _unclear_deletion(diff, new)
                else:
                    # git itself misplaces a context-free hunk whose removed last line has no line end
                    # when the same text stands just before it (git's line hash skips the line end):
                    # the engine does exactly what git does, here too.
                    assert zero_context(diff) and b"\\ No newline at end of file" in diff, diff
                    tally.git_misplaced += 1
            # A drifted copy: the engine applies where git applies, with the same result, and fails
            # where git fails; where it says "already", git's reverse applies too.
            state, after = run_engine(drifted, diff, tmp)
            reference = git_apply(drifted, diff, tmp)
            if state == ALREADY:
                assert git_apply(drifted, diff, tmp, reverse=True) is not None
                tally.drifted_already += 1
            elif state == APPLIED:
                assert after == reference
                tally.drifted_applied += 1
            else:
                assert reference is None
                tally.drifted_failed += 1

    check()
    print(f"\ndifferential cases: {tally}")
    assert tally.applied > tally.cases // 2
