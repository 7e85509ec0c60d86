"""The applier and `git apply` side by side on diffs that hide git's headers from a line reader.

Each diff runs twice on the same tree: through the applier (inimage.apply_mod, which writes the tree
itself), and through `git apply` run directly in a copy of the tree. Every verdict must agree (the
same files, bytes, types and executable bits after an application; git's reverse check passing for
"already") or the applier must refuse. The tree holds what makes a second name for a file (a hard
link, a link to a file, a link to its folder) and a link to a secret outside it; the secret must
never reach the tree, and nothing outside may change. Hand-written cases pin the verdict each
class must get; a hypothesis test composes headers, names and hunks at random.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkforge import inimage
from tests.support.seam import mod_doc

SECRET = b"host secret that must never reach the tree\n"
X = b"a\nb\nc\n"
CASES = int(os.environ.get("SPARKFORGE_HIDDEN_CASES", "100"))  # generated diffs


def build_tree(root: Path, outside: Path) -> None:
    """vllm/x.py, its hard link h.py, a link l.py to it, a link alias to its folder, an executable
    run.sh, a link out.py to a file outside the tree, and a sentinel in outside."""
    (root / "vllm").mkdir(parents=True)
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (root / "vllm" / "x.py").write_bytes(X)
    os.chmod(root / "vllm" / "x.py", 0o644)
    (root / "vllm" / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "vllm" / "run.sh", 0o755)
    os.link(root / "vllm" / "x.py", root / "vllm" / "h.py")
    os.symlink("x.py", root / "vllm" / "l.py")
    os.symlink(".", root / "vllm" / "alias")
    os.symlink(outside / "secret.txt", root / "vllm" / "out.py")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry below root, links not followed: its type, and a file's bytes and executable bit."""
    out: dict[str, tuple] = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(parent, name)
            mode = os.lstat(path).st_mode
            rel = path.relative_to(root).as_posix()
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(mode):
                out[rel] = ("file", path.read_bytes(), bool(mode & stat.S_IXUSR))
            else:
                out[rel] = ("other", stat.S_IFMT(mode))
    return out


def git(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    """git run directly, outside any repository and without the user's configuration."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "GIT_CEILING_DIRECTORIES": str(home),
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, timeout=60)


def flags(diff: bytes) -> list[str]:
    """The -p and --unidiff-zero a reader of the text would give git: read here from the text alone."""
    names = [line.split(b"\t")[0][4:] for line in diff.split(b"\n") if line.startswith((b"--- ", b"+++ "))]
    names = [n for n in names if n != b"/dev/null"]
    prefixed = all(n.startswith((b"a/", b"b/")) for n in names)
    hunk_lines = [line for line in diff.split(b"\n") if line[:1] in (b" ", b"+", b"-") and not line.startswith(
        (b"+++ ", b"--- "))]
    zero = not any(line.startswith(b" ") for line in hunk_lines)
    return ["-p1" if prefixed else "-p0"] + (["--unidiff-zero"] if zero else [])


def side_by_side(diff: bytes, tmp: Path) -> tuple[str, str]:
    """(the applier's state, why it is right): agrees with git run directly, or the applier refused."""
    outside = tmp / "outside"
    mine, theirs = tmp / "mine", tmp / "theirs"
    build_tree(mine, outside)
    build_tree(theirs, outside)
    (tmp / "p.diff").write_bytes(diff)
    (tmp / "mod").mkdir()
    (tmp / "mod" / "p.diff").write_bytes(diff)
    before = snapshot(mine)
    result = inimage.apply_mod(mod_doc({"name": "m", "kind": "patch", "patch": "p.diff"}), tmp / "mod", mine)
    after = snapshot(mine)
    assert (outside / "secret.txt").read_bytes() == SECRET and sorted(os.listdir(outside)) == ["secret.txt"]
    assert not any(SECRET in entry[1] for entry in after.values() if entry[0] == "file"), "the secret leaked in"
    assert "\n" not in result.line() and "Traceback" not in result.line()
    if result.state == "failed":
        assert after == before, "a refused diff changed the tree"
        return "failed", result.detail
    forward = git(["apply", *flags(diff), str(tmp / "p.diff")], theirs, tmp)
    if result.state == "applied":
        assert forward.returncode == 0, f"the applier applied what git refuses: {forward.stderr!r}"
        assert after == snapshot(theirs), "the applier's tree differs from git's"
        return "applied", "as git applies it"
    reverse = git(["apply", "-R", "--check", *flags(diff), str(tmp / "p.diff")], mine, tmp)
    assert result.state == "already" and after == before
    assert reverse.returncode == 0, f"already applied, but git's reverse check refuses: {reverse.stderr!r}"
    return "already", "git's reverse check takes it"


# ------------------------------------------------------------------ what hides where, by hand


def section(name: str, hunk: str, header: str = "") -> str:
    """A git diff section: `diff --git`, extended header lines, ---/+++ and the hunk."""
    old = "/dev/null" if "new file mode" in header else f"a/{name}"
    new = "/dev/null" if "deleted file mode" in header else f"b/{name}"
    return f"diff --git a/{name} b/{name}\n{header}--- {old}\n+++ {new}\n{hunk}"


CHANGE = "@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
OUT = "{outside}/secret.txt"
LINK_HUNK = "@@ -0,0 +1 @@\n+" + OUT + "\n\\ No newline at end of file\n"

HIDDEN = {  # name -> (the diff, the verdict it must get)
    "lone +++ then a link to a host file": (
        section("vllm/x.py", CHANGE) + "diff --git a/vllm/leak b/vllm/leak\n+++ b/vllm/leak\nnew file mode 120000\n"
        "--- /dev/null\n+++ b/vllm/leak\n" + LINK_HUNK, "failed"),
    "lone +++ then an executable new file": (
        "diff --git a/vllm/t.sh b/vllm/t.sh\n+++ b/vllm/t.sh\nnew file mode 100755\n--- /dev/null\n+++ b/vllm/t.sh\n"
        "@@ -0,0 +1 @@\n+echo x\n", "failed"),
    "lone +++ then a mode change": (
        "diff --git a/vllm/x.py b/vllm/x.py\n+++ b/vllm/x.py\nold mode 100644\nnew mode 100755\n--- a/vllm/x.py\n"
        "+++ b/vllm/x.py\n" + CHANGE, "failed"),
    "lone +++ then the executable bit taken away": (
        "diff --git a/vllm/run.sh b/vllm/run.sh\n+++ b/vllm/run.sh\nold mode 100755\nnew mode 100644\n"
        "--- a/vllm/run.sh\n+++ b/vllm/run.sh\n@@ -1,2 +1,2 @@\n #!/bin/sh\n-echo hi\n+echo ho\n", "failed"),
    "lone --- then a deletion": (
        "diff --git a/vllm/x.py b/vllm/x.py\n--- a/vllm/x.py\ndeleted file mode 100644\n--- a/vllm/x.py\n+++ /dev/null\n"
        "@@ -1,3 +0,0 @@\n-a\n-b\n-c\n", "failed"),
    "lone +++ then a rename": (
        "diff --git a/vllm/x.py b/vllm/y.py\n+++ b/vllm/y.py\nsimilarity index 60%\nrename from vllm/x.py\n"
        "rename to vllm/y.py\n--- a/vllm/x.py\n+++ b/vllm/y.py\n" + CHANGE, "failed"),
    "lone +++ then a copy": (
        "diff --git a/vllm/x.py b/vllm/y.py\n+++ b/vllm/y.py\nsimilarity index 60%\ncopy from vllm/x.py\n"
        "copy to vllm/y.py\n--- a/vllm/x.py\n+++ b/vllm/y.py\n" + CHANGE, "failed"),
    "a traditional deletion": ("--- a/vllm/x.py\n+++ /dev/null\n@@ -1,3 +0,0 @@\n-a\n-b\n-c\n", "failed"),
    "a deletion by an epoch time stamp": (
        "--- vllm/x.py\t2024-01-01 00:00:00.000000000 +0000\n+++ vllm/x.py\t1970-01-01 00:00:00.000000000 +0000\n"
        "@@ -1,3 +0,0 @@\n-a\n-b\n-c\n", "failed"),
    "a creation by an epoch time stamp": (
        "--- vllm/new.py\t1970-01-01 00:00:00.000000000 +0000\n+++ vllm/new.py\t2024-01-01 00:00:00.000000000 +0000\n"
        "@@ -0,0 +1 @@\n+new\n", "applied"),
    "a file and its hard link": (section("vllm/x.py", CHANGE) + section("vllm/h.py", CHANGE), "failed"),
    "a file and a link to it": (section("vllm/x.py", CHANGE) + section("vllm/l.py", CHANGE), "failed"),
    "a file and a link to its folder": (section("vllm/x.py", CHANGE) + section("vllm/alias/x.py", CHANGE), "failed"),
    "a link to a file outside": (section("vllm/out.py", "@@ -1 +1 @@\n-" + SECRET.decode() + "+x\n"), "failed"),
    "a new file through a link to its folder": (
        "--- /dev/null\n+++ b/vllm/alias/new.py\n@@ -0,0 +1 @@\n+new\n", "failed"),
    "FILE.orig against FILE": (
        "--- vllm/x.py.orig\t2024-01-01 00:00:00.000000000 +0000\n+++ vllm/x.py\t2024-01-01 00:00:01.000000000 +0000\n"
        + CHANGE, "applied"),
    "a/FILE.orig against b/FILE": ("--- a/vllm/x.py.orig\n+++ b/vllm/x.py\n" + CHANGE, "applied"),
    "FILE against FILE.new": ("--- vllm/x.py\n+++ vllm/x.py.new\n" + CHANGE, "applied"),
    "two sections for one file": (section("vllm/x.py", CHANGE) + section(
        "vllm/x.py", "@@ -1,3 +1,4 @@\n a\n B\n c\n+d\n"), "applied"),
    "an index line with another mode": (
        "diff --git a/vllm/x.py b/vllm/x.py\nindex 1111111..2222222 100755\n--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        + CHANGE, "applied"),
    "a mode change in plain sight": (section("vllm/x.py", CHANGE, "old mode 100644\nnew mode 100755\n"), "failed"),
    "a binary file line": ("diff --git a/vllm/x.py b/vllm/x.py\nindex 1..2 100644\nBinary files a/vllm/x.py and "
                           "b/vllm/x.py differ\n", "failed"),
    "a hunk after a lone +++": ("diff --git a/vllm/x.py b/vllm/x.py\n+++ b/vllm/x.py\n" + CHANGE, "failed"),
    "a --- line moved into the extended header": (
        "diff --git a/vllm/x.py b/vllm/x.py\n--- a/vllm/x.py\nindex 1111111..2222222 100644\n+++ b/vllm/x.py\n" + CHANGE,
        "failed"),
    "a name that climbs out in the git header only": (
        "diff --git a/../../escape.txt b/../../escape.txt\nnew file mode 100644\nindex 0000000..e69de29\n", "failed"),
    "a new empty file": ("diff --git a/vllm/e.py b/vllm/e.py\nnew file mode 100644\nindex 0000000..e69de29\n", "applied"),
    "-U0: an insertion whose line stands elsewhere in the file": (
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -3,0 +4 @@\n+a\n", "applied"),
    "-U0: an insertion whose line stands at its place": (
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,0 +2 @@\n+b\n", "already"),
}


@pytest.mark.parametrize("case", sorted(HIDDEN))
def test_hidden_headers_get_gits_verdict_or_a_refusal(case: str, tmp_path: Path) -> None:
    diff, verdict = HIDDEN[case]
    state, why = side_by_side(diff.replace("{outside}", str(tmp_path / "outside")).encode(), tmp_path)
    assert state == verdict, why


def test_a_git_binary_patch_behind_a_lone_header_is_refused(tmp_path: Path) -> None:
    (tmp_path / "make" / "old" / "vllm").mkdir(parents=True)
    (tmp_path / "make" / "new" / "vllm").mkdir(parents=True)
    (tmp_path / "make" / "old" / "vllm" / "x.py").write_bytes(X)
    (tmp_path / "make" / "new" / "vllm" / "x.py").write_bytes(b"\0\1binary\0")
    made = git(["diff", "--no-index", "--binary", "old/vllm/x.py", "new/vllm/x.py"], tmp_path / "make", tmp_path)
    binary = made.stdout.replace(b"a/old/", b"a/").replace(b"b/new/", b"b/")
    assert b"GIT binary patch" in binary
    # The ---/+++ pair split by the index line: no line reader sees a section, git reads the names.
    hidden = binary.replace(b"\nindex ", b"\n--- a/vllm/x.py\nindex ", 1).replace(
        b"\nGIT binary patch", b"\n+++ b/vllm/x.py\nGIT binary patch", 1)
    (tmp_path / "hidden.diff").write_bytes(hidden)
    assert git(["apply", "--check", str(tmp_path / "hidden.diff")], tmp_path / "make" / "old", tmp_path).returncode == 0
    state, why = side_by_side(hidden, tmp_path / "run")
    assert state == "failed" and "binary" in why, why


# ------------------------------------------------------------------ generated


NAMES = ["vllm/x.py", "vllm/h.py", "vllm/l.py", "vllm/alias/x.py", "vllm/out.py", "vllm/new.py", "vllm/x.py.orig",
         "vllm/run.sh", "../escape.py"]
EXTENDED = ["new file mode 100644", "new file mode 100755", "new file mode 120000", "old mode 100644",
            "new mode 100755", "deleted file mode 100644", "similarity index 90%", "rename from {a}", "rename to {b}",
            "copy from {a}", "copy to {b}", "index 1111111..2222222 100755", "index 1111111..2222222 100644",
            "dissimilarity index 80%", "+++ b/{b}", "--- a/{a}", "+++ /dev/null", "--- /dev/null",
            "Binary files a/{a} and b/{b} differ"]
SECTIONS = [  # (old name, new name, hunk) of sections that apply to the tree as it is
    ("vllm/x.py", "vllm/x.py", CHANGE), ("vllm/x.py", "vllm/x.py", "@@ -2 +2 @@\n-b\n+B\n"),
    ("vllm/x.py", "vllm/x.py", "@@ -1,0 +2 @@\n+b\n"), ("vllm/x.py", "vllm/x.py", "@@ -3,0 +4 @@\n+a\n"),
    ("vllm/x.py.orig", "vllm/x.py", CHANGE), ("/dev/null", "vllm/new.py", "@@ -0,0 +1 @@\n+new\n"),
    ("vllm/run.sh", "vllm/run.sh", "@@ -1,2 +1,2 @@\n #!/bin/sh\n-echo hi\n+echo ho\n"),
    ("/dev/null", "vllm/leak", LINK_HUNK), ("vllm/x.py", "/dev/null", "@@ -1,3 +0,0 @@\n-a\n-b\n-c\n")]


@st.composite
def hostile_diff(draw) -> str:
    """One to three sections, each a sound one (git header or not) with up to three extended header lines
    put anywhere before its hunk, often behind a lone `+++`/`---` line that hides them from a reader of
    ---/+++ pairs, and now and then a name swapped for another name of the tree."""
    out = ""
    for _ in range(draw(st.integers(1, 3))):
        old, new, hunk = draw(st.sampled_from(SECTIONS))
        if draw(st.integers(0, 5)) == 0:
            new = draw(st.sampled_from(NAMES))
            old = old if old == "/dev/null" else new
        a, b = (new if old == "/dev/null" else old), (old if new == "/dev/null" else new)
        lines = [f"--- {'/dev/null' if old == '/dev/null' else 'a/' + old}",
                 f"+++ {'/dev/null' if new == '/dev/null' else 'b/' + new}"]
        if draw(st.integers(0, 3)):
            header = draw(st.lists(st.sampled_from(EXTENDED), min_size=1, max_size=3))
            header.insert(0, draw(st.sampled_from(["+++ b/{b}", "--- a/{a}", "+++ /dev/null"])))
            lines = ["diff --git a/{a} b/{b}"] + [line.format(a=a, b=b) for line in header] + lines
        elif draw(st.booleans()):
            lines.insert(0, f"diff --git a/{a} b/{b}")
            for extra in draw(st.lists(st.sampled_from(EXTENDED), max_size=3)):
                lines.insert(draw(st.integers(1, len(lines))), extra.format(a=a, b=b))
        out += "\n".join(line.format(a=a, b=b) for line in lines) + "\n" + hunk
    return out


def test_generated_diffs_get_gits_verdict_or_a_refusal() -> None:
    tally: dict[str, int] = {}

    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(hostile_diff())
    def check(diff: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            outside = str(Path(tmp) / "outside")
            state, _ = side_by_side(diff.replace("{outside}", outside).encode(), Path(tmp))
            tally[state] = tally.get(state, 0) + 1

    check()
    print(f"\ngenerated hostile diffs: {tally}")
    assert tally.get("applied") and tally.get("failed")


def test_a_fifo_or_folder_where_a_file_is_named_is_refused_at_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    build_tree(root, tmp_path / "outside")
    os.mkfifo(root / "vllm" / "fifo.py")
    (root / "vllm" / "folder.py").mkdir()
    (tmp_path / "mod").mkdir()
    for name, why in (("vllm/fifo.py", "is a FIFO"), ("vllm/folder.py", "is a folder"),
                      ("vllm/x.py/new.py", "stands where its folder belongs")):
        hunk = "@@ -0,0 +1 @@\n+new\n" if name.endswith("new.py") else CHANGE
        old = "/dev/null" if name.endswith("new.py") else f"a/{name}"
        (tmp_path / "mod" / "p.diff").write_text(f"--- {old}\n+++ b/{name}\n{hunk}")
        result = inimage.apply_mod(mod_doc({"name": "m", "kind": "patch", "patch": "p.diff"}), tmp_path / "mod",
                                   root)
        assert result.state == "failed" and why in result.detail, result
    shutil.rmtree(tmp_path / "mod")
