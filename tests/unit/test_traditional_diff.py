"""Diffs that are not git's, made with the real `diff`, apply as `git apply` applies them.

`diff -u f.orig f` names two files; git apply patches the one it picks by its own rule (the shorter name when
it begins the longer, else the `+++` one), and reads a side dated at the epoch (`diff -N`) as a new file. The
patch engine picks the same file and changes exactly what git apply changes in a copy of the tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sparkforge import inimage
from sparkforge.inimage.patch import plan_patch

pytestmark = pytest.mark.needs("git", "diff")


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def run_diff(*args: str, cwd: Path) -> bytes:
    proc = subprocess.run(["diff", *args], capture_output=True, cwd=cwd, timeout=60)
    assert proc.returncode == 1, proc.stderr  # 1: the files differ
    return proc.stdout


def git_applies(diff: bytes, root: Path, strip: int) -> dict[str, bytes]:
    """What real git apply makes of the files under a copy of root."""
    copy = root.parent / f"{root.name}-git"
    shutil.copytree(root, copy)
    (root.parent / "p.diff").write_bytes(diff)
    env = {"PATH": os.environ["PATH"], "HOME": str(root.parent), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    proc = subprocess.run(["git", "apply", f"-p{strip}", "../p.diff"], cwd=copy, capture_output=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file()}


def engine_applies(diff: bytes, root: Path) -> dict[str, bytes]:
    state, writes = plan_patch(diff, root)
    assert state == inimage.ModState.APPLIED
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    return files | {p.relative_to(root).as_posix(): body for p, body in writes.items()}


def test_a_diff_of_file_orig_against_file_patches_file(tmp_path: Path) -> None:
    root = tree(tmp_path / "root", {"vllm/envs.py": "A = 1\nB = 2\nC = 3\n", "vllm/envs.py.orig": "A = 1\nB = 2\nC = 3\n"})
    (root / "vllm/envs.py").write_text("A = 1\nB = 20\nC = 3\n")
    diff = run_diff("-u", "vllm/envs.py.orig", "vllm/envs.py", cwd=root)
    assert diff.startswith(b"--- vllm/envs.py.orig\t")
    (root / "vllm/envs.py").write_text("A = 1\nB = 2\nC = 3\n")  # back to the pristine file
    (patch,) = inimage.parse_diff(diff)
    assert (patch.path, patch.prefixed) == ("vllm/envs.py", False)
    expected = git_applies(diff, root, 0)
    assert expected["vllm/envs.py"] == b"A = 1\nB = 20\nC = 3\n"
    assert engine_applies(diff, root) == expected


def test_of_two_names_the_shorter_that_begins_the_other_is_patched(tmp_path: Path) -> None:
    """`diff -u f f.new` patches f (git takes the old name when the new one starts with it)."""
    root = tree(tmp_path / "root", {"a/x.py": "one\ntwo\n", "b/x.py.new": "one\nTWO\n"})
    diff = run_diff("-u", "a/x.py", "b/x.py.new", cwd=root)
    (patch,) = inimage.parse_diff(diff)
    assert (patch.path, patch.prefixed) == ("x.py", True)
    shutil.rmtree(root / "a")
    shutil.rmtree(root / "b")
    tree(root, {"x.py": "one\ntwo\n"})
    assert engine_applies(diff, root) == git_applies(diff, root, 1) == {"x.py": b"one\nTWO\n"}


def test_a_new_file_of_diff_N_is_created(tmp_path: Path) -> None:
    work = tree(tmp_path / "work", {"a/vllm/old.py": "x = 1\n", "b/vllm/old.py": "x = 2\n", "b/vllm/new.py": "y = 1\n"})
    diff = run_diff("-ruN", "a", "b", cwd=work)
    assert sorted(p.path for p in inimage.parse_diff(diff)) == ["vllm/new.py", "vllm/old.py"]
    root = tree(tmp_path / "root", {"vllm/old.py": "x = 1\n"})
    expected = git_applies(diff, root, 1)
    assert expected == {"vllm/old.py": b"x = 2\n", "vllm/new.py": b"y = 1\n"}
    assert engine_applies(diff, root) == expected


def test_a_file_that_diff_N_shows_gone_is_refused_as_git_would_delete_it(tmp_path: Path) -> None:
    work = tree(tmp_path / "work", {"a/vllm/gone.py": "x = 1\n", "b/vllm/keep.py": "y = 1\n", "a/vllm/keep.py": "y = 1\n"})
    diff = run_diff("-ruN", "a", "b", cwd=work)
    root = tree(tmp_path / "root", {"vllm/gone.py": "x = 1\n", "vllm/keep.py": "y = 1\n"})
    with pytest.raises(inimage.ModFailure, match=r"^vllm/gone.py: git apply deletes this file"):
        plan_patch(diff, root)
    assert (root / "vllm/gone.py").read_text() == "x = 1\n"


def test_a_git_diff_whose_names_differ_is_still_a_rename_and_refused() -> None:
    diff = (b"diff --git a/old.py b/new.py\n--- a/old.py\n+++ b/new.py\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(inimage.ModFailure, match=r"^a rename \(old.py -> new.py\) is not supported"):
        inimage.parse_diff(diff)
