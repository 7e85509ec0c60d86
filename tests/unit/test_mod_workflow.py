"""A patch mod written by hand: `mod new NAME --variant V` scaffolds it with a git work tree of the pristine
source, the user edits that tree, `mod save NAME` writes the patch from `git diff` and checks it.

The library steps run on a small tree of their own (real git); the whole path runs through the command line
on the real vLLM 0.17.0 release source (marked network).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from sparkforge import inimage
from sparkforge.errors import ConfigError
from sparkforge.recipe import scaffold
from sparkforge.recipe.config import load_mod, read_yaml
from tests.support.cli import assert_one_line, run_cli
from tests.support.paths import IMAGES, MODS
from sparkforge.recipe.config import mod_document

REQUIRED = {"name", "summary", "description", "component", "targets", "phase", "kind", "patch", "verify"}
ENVS = "A = 1\nB = 2\nC = 3\n"


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


@pytest.fixture
def made(tmp_path: Path) -> tuple[Path, scaffold.WorkTree]:
    pristine = tmp_path / "pristine"
    (pristine / "vllm").mkdir(parents=True)
    (pristine / "vllm" / "envs.py").write_text(ENVS)
    (pristine / "vllm" / "gone.py").write_text("x = 1\n")
    (pristine / ".gitignore").write_text("gone.py\nprobe.py\n")  # a source's own ignore file hides none of its files
    mods = tmp_path / "mods"
    mods.mkdir()
    work = scaffold.new_local_mod(mods, "my-fix", variant="ng17", component="vllm", phase="install",
                                  versions="==0.17.0", tree=pristine, source="vllm 0.17.0 (a test tree)",
                                  work_root=tmp_path / "mod-src")
    return mods, work


def test_new_writes_every_required_field_with_its_meaning_and_a_pristine_work_tree(made) -> None:
    mods, work = made
    text = (mods / "my-fix" / "mod.yaml").read_text()
    data = read_yaml(mods / "my-fix" / "mod.yaml")
    assert set(data) == REQUIRED and data["verify"] == [] and data["patch"] == "my-fix.patch"
    for key in REQUIRED - {"targets"}:
        line = next(line for line in text.splitlines() if line.startswith(f"{key}:"))
        assert "  # " in line, line  # what the field means, beside it
    assert work.path.name == "my-fix" and (work.path / "vllm" / "envs.py").read_text() == ENVS
    assert git(work.path, "ls-files").split() == [".gitignore", "vllm/envs.py", "vllm/gone.py"]
    assert git(work.path, "status", "--porcelain") == ""
    assert git(work.path, "rev-parse", "HEAD").strip() == work.pristine
    assert scaffold.read_work_tree("my-fix", work.path.parent) == work


def test_save_writes_the_patch_from_git_diff_and_one_verify_check(made, tmp_path: Path) -> None:
    mods, work = made
    (work.path / "vllm" / "envs.py").write_text("A = 1\nB = 20\nC = 3\n")
    (work.path / "vllm" / "probe.py").write_text("PROBE = 'sparkforge'\n")  # a path .gitignore names: it counts
    (work.path / "vllm" / "__pycache__").mkdir()
    (work.path / "vllm" / "__pycache__" / "envs.cpython-311.pyc").write_bytes(b"\x00\x01bytecode")  # never a change
    git(work.path, "add", "vllm/envs.py")  # the user's own index: mod save leaves it as it is
    staged = git(work.path, "diff", "--cached", "--name-only")
    saved = scaffold.save_patch(mods, work)
    assert git(work.path, "diff", "--cached", "--name-only") == staged
    patch = (mods / "my-fix" / "my-fix.patch").read_bytes()
    assert saved.patch == mods / "my-fix" / "my-fix.patch" and saved.files == ("vllm/envs.py", "vllm/probe.py")
    assert patch.startswith(b"diff --git a/vllm/envs.py b/vllm/envs.py\n")
    assert b"new file mode 100644" in patch and b"+++ b/vllm/probe.py" in patch
    spec, _ = load_mod(mods, "my-fix")  # the mod is whole now: the schema takes it
    assert [v.model_dump(exclude_none=True, exclude_defaults=True) for v in spec.verify] == [
        {"file": "vllm/envs.py", "contains": "B = 20"}]
    # The patch makes exactly the edited tree out of the pristine one, and is then already applied.
    copy = shutil.copytree(tmp_path / "pristine", tmp_path / "copy")
    spec_json = mod_document(spec, spec.patch if isinstance(spec.patch, str) else None)
    assert inimage.apply_mod(spec_json, mods / "my-fix", copy).state is inimage.ModState.APPLIED
    assert (copy / "vllm" / "envs.py").read_text() == "A = 1\nB = 20\nC = 3\n"
    assert (copy / "vllm" / "probe.py").read_text() == "PROBE = 'sparkforge'\n"
    assert inimage.apply_mod(spec_json, mods / "my-fix", copy).state is inimage.ModState.ALREADY
    # A later save writes the patch again and leaves the check the user now owns.
    (work.path / "vllm" / "probe.py").unlink()
    scaffold.save_patch(mods, work)
    assert b"probe.py" not in (mods / "my-fix" / "my-fix.patch").read_bytes()
    assert read_yaml(mods / "my-fix" / "mod.yaml")["verify"] == [{"file": "vllm/envs.py", "contains": "B = 20"}]


def test_save_refuses_no_change_and_what_a_patch_mod_cannot_do_writing_nothing(made) -> None:
    mods, work = made
    before = (mods / "my-fix" / "mod.yaml").read_text()
    with pytest.raises(ConfigError, match="no change since the pristine source yet"):
        scaffold.save_patch(mods, work)
    (work.path / "vllm" / "gone.py").unlink()
    with pytest.raises(ConfigError, match=r"a file deletion \(delete mode 100644 vllm/gone.py, as git apply reads the diff\) is not supported"):
        scaffold.save_patch(mods, work)
    assert sorted(p.name for p in (mods / "my-fix").iterdir()) == ["mod.yaml"]
    assert (mods / "my-fix" / "mod.yaml").read_text() == before


def test_new_refuses_a_taken_name_before_fetching_anything(made, tmp_path: Path) -> None:
    mods, work = made
    for name, words in (("my-fix", "already exists"), ("My_Fix", "is not a mod name")):
        with pytest.raises(ConfigError, match=words):
            scaffold.check_new(mods, name, "==0.17.0", work.path.parent)


def test_a_source_that_cannot_be_had_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    """ng16 pins no full vLLM commit, so no source can be had for it: exit 1, no mod folder, no work tree."""
    name = f"wf-{uuid.uuid4().hex[:8]}"
    mods = shutil.copytree(MODS, tmp_path / "mods")
    proc = run_cli("--mods", str(mods), "mod", "new", name, "--variant", "ng16")
    assert_one_line(proc, "ng16: cannot fetch vllm 882682ab8 (commit unknown)", code=1)
    assert not (mods / name).exists() and not (scaffold.WORK_ROOT / name).exists()


@pytest.mark.network
def test_the_whole_path_through_the_command_line_on_the_real_release_source(tmp_path: Path) -> None:
    name = f"wf-{uuid.uuid4().hex[:8]}"
    mods = shutil.copytree(MODS, tmp_path / "mods")
    images = shutil.copytree(IMAGES, tmp_path / "images")
    work = scaffold.WORK_ROOT / name
    try:
        new = run_cli("--images", str(images), "--mods", str(mods), "mod", "new", name, "--variant", "ng17")
        assert new.returncode == 0, new.stderr
        # The work tree holds the source as the build hands it to a new mod: after ng17's own mods.
        assert (f"made {work}: vllm 0.17.0 (PyPI, commit b31e9326a), with ng17's mods marlin-sm12x-fp8, "
                "mtp-nvfp4-exclusion, uf17-eager-allreduce, fix-qwen35-tp4-marlin applied, as the build hands it to this mod, as a git "
                "work tree") in new.stdout, new.stdout
        assert "VLLM_UF_EAGER_ALLREDUCE" in (work / "vllm" / "config" / "compilation.py").read_text()  # uf17 is in
        assert f"mod save {name}`" in new.stdout
        envs = work / "vllm" / "envs.py"
        assert git(work, "status", "--porcelain") == "" and envs.is_file()

        # The user's edit: a setting the release does not have, and a new module.
        envs.write_text(envs.read_text() + '\nSPARKFORGE_WORKFLOW_PROBE = "by hand"\n')
        (work / "vllm" / "sparkforge_probe.py").write_text("PROBE = True\n")
        saved = run_cli("--images", str(images), "--mods", str(mods), "mod", "save", name)
        assert saved.returncode == 0, saved.stdout + saved.stderr
        assert "changes vllm/envs.py, vllm/sparkforge_probe.py" in saved.stdout
        rows = [line.split() for line in saved.stdout.splitlines() if line.startswith("ng17 ")]
        assert [r[1:3] for r in rows if r[1] == name] == [[name, "applied"]], saved.stdout
        assert "0 failed" in saved.stdout

        # Listed in the recipe, check-mods applies it like any other mod.
        recipe = images / "ng17.yaml"
        text = recipe.read_text()
        assert "\nmods:\n" in text
        assert text.endswith("\n") and text.rstrip().splitlines()[-1].startswith("  - ")  # the mod list ends it
        recipe.write_text(text + f"  - {name}\n")  # after the variant's mods, where `mod save` checked it
        checked = run_cli("--images", str(images), "--mods", str(mods), "check-mods", "ng17")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        rows = [line.split() for line in checked.stdout.splitlines() if line.startswith("ng17 ")]
        assert [r[1:3] for r in rows if r[1] == name] == [[name, "applied"]], checked.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)
