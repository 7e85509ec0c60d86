"""`bump` from one real vLLM release to the next (release sdists from PyPI, cached): the mods that apply are
kept, one that does not is dropped with its reason, a mod that applies outside its declared range is widened,
and the new variant passes check-mods; --dry-run and bad input write nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.support import gitserver
from tests.support.cli import assert_one_line, run_cli
from tests.support.paths import MODS, VARIANTS

pytestmark = pytest.mark.network

# testvllm at 0.18.1, the last release fix-qwen35-tp4-marlin declares; in 0.19.0 its target is gone.
OLD, NEW = "0.18.1", "0.19.0"
NO_REGISTRY = "127.0.0.1:9"
MODS_USED = ("uf17-eager-allreduce", "fix-qwen35-tp4-marlin", "serve-torchrun")


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, Path]:
    """A recipe folder with testvllm at 0.18.1 as `old`, and a copy of its mods, where uf17-eager-allreduce
    declares 0.18.1 alone (so that bump has to prove and widen it)."""
    images, mods = tmp_path / "images", tmp_path / "mods"
    images.mkdir()
    text = (VARIANTS / "testvllm.yaml").read_text()
    assert 'version: "0.17.0"' in text
    # Its base on a loopback port nothing listens on: the lock bump runs asks no registry but this machine.
    text = text.replace("repository: nvcr.io/nvidia/pytorch", f"repository: {NO_REGISTRY}/nvidia/pytorch")
    (images / "old.yaml").write_text(text.replace('version: "0.17.0"', f'version: "{OLD}"'))
    for name in MODS_USED:
        shutil.copytree(MODS / name, mods / name)
    meta = mods / "uf17-eager-allreduce" / "mod.yaml"
    meta.write_text(meta.read_text().replace('versions: ">=0.15.0,<=0.33.0"', f'versions: "=={OLD}"'))
    assert yaml.safe_load(meta.read_text())["targets"]["versions"] == f"=={OLD}"
    return images, mods


def snapshot(*folders: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def test_bump_keeps_what_applies_drops_what_does_not_and_the_new_variant_passes_check_mods(project) -> None:
    images, mods = project
    proc = run_cli("bump", "old", "--to", NEW, "--name", "new", images=images, mods=mods)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"bump old -> new: vllm {OLD} -> {NEW}" in out
    assert f"kept    uf17-eager-allreduce: applies to vllm {NEW}; targets widened from =={OLD} to >={OLD},<={NEW}" in out
    assert f"dropped fix-qwen35-tp4-marlin: does not apply to vllm {NEW}: vllm/model_executor/models/qwen3_next.py" in out
    assert "kept    serve-torchrun: drop-in files" in out
    assert "- fix-qwen35-tp4-marlin" in out and f"vllm: {OLD} (pypi) -> {NEW} (pypi)" in out  # the diff
    recipe = yaml.safe_load((images / "new.yaml").read_text())
    assert recipe == {"extends": "old", "description": f"old with vLLM {NEW}", "vllm": {"version": NEW},
                      "mods": {"remove": ["fix-qwen35-tp4-marlin"]}}
    assert "# Dropped fix-qwen35-tp4-marlin: does not apply" in (images / "new.yaml").read_text()
    widened = yaml.safe_load((mods / "uf17-eager-allreduce" / "mod.yaml").read_text())["targets"]["versions"]
    assert widened == f">={OLD},<={NEW}"
    # lock --no-build ran on the new variant: its mods and vLLM pin are in the lock.
    lock = json.loads((images / "new.lock.json").read_text())
    assert [m["name"] for m in lock["mods"]] == ["uf17-eager-allreduce", "serve-torchrun"]
    assert lock["vllm"]["version"] == NEW and "unresolved" in lock["base"]["digest"]
    check = run_cli("check-mods", "new", "old", images=images, mods=mods)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "0 failed, 0 unverified" in check.stdout, check.stdout
    # The same bump again: the name is taken; nothing changes.
    before = snapshot(images, mods)
    assert_one_line(run_cli("bump", "old", "--to", NEW, "--name", "new", images=images, mods=mods),
                    "--name", "new.yaml exists", progress=("vllm ",))
    assert snapshot(images, mods) == before


def test_dry_run_and_bad_input_write_nothing(project) -> None:
    images, mods = project
    before = snapshot(images, mods)
    dry = run_cli("bump", "old", "--to", NEW, "--dry-run", images=images, mods=mods)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"dry run: nothing written; {images / 'old-0-19-0.yaml'} would read:" in dry.stdout
    assert "    extends: old" in dry.stdout and "and these mods' targets would widen" in dry.stdout
    assert snapshot(images, mods) == before
    for args, needles in (
            (("--to", "9.9.9"), ("--to", "vllm 9.9.9 is not a final release")),
            (("--to", "0.18.0"), ("--to", "old pins vllm 0.18.1; 0.18.0 is not newer")),
            ((), ("--to", "give the release with --to VERSION, or --latest")),
            (("--to", NEW, "--name", "Bad_Name"), ("Bad_Name",))):
        assert_one_line(run_cli("bump", "old", *args, images=images, mods=mods), *needles, progress=("vllm ",))
    wheel = images / "wheel.yaml"
    wheel.write_text("extends: old\nvllm:\n  source: wheel\n  path: vllm-0.18.1-cp38-abi3-manylinux_2_31_x86_64.whl\n  sha256: \"" + "0" * 64 + "\"\n")
    before = snapshot(images, mods)
    assert_one_line(run_cli("bump", "wheel", "--latest", images=images, mods=mods), "wheel.yaml", "vllm.source")
    assert snapshot(images, mods) == before


@pytest.mark.needs("git")
def test_a_git_source_follows_the_release_tag_and_refuses_a_remote_whose_tag_is_not_the_release(
        project, tmp_path: Path) -> None:
    """The tag's commit must start with the commit the release's sdist records; a remote that does not answer
    leaves the commit open, with the reason, for lock."""
    images, mods = project
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tmp_path / "repos").mkdir()
    gitserver.init_repo(tmp_path / "repos", "vllm", tree, tag=f"v{NEW}")
    srv = gitserver.start(tmp_path / "repos", tmp_path / "certs")
    url = srv.repo_url("vllm")
    (images / "gitold.yaml").write_text(f"extends: old\nvllm:\n  source: git\n  repo: {url}\n  ref: v{OLD}\n"
                                        f"  commit:\n    unknown: not locked\n  version: \"{OLD}\"\n")
    env = {"GIT_SSL_CAINFO": str(srv.ca)}
    try:
        before = snapshot(images, mods)
        assert_one_line(run_cli("bump", "gitold", "--to", NEW, "--no-lock", images=images, mods=mods, env=env),
                        "gitold.yaml: vllm.repo", f"tag v{NEW} is commit", "the remote is not vLLM's release",
                        progress=("vllm ", "applying ", "fix-qwen35", "uf17"))
        assert snapshot(images, mods) == before
    finally:
        srv.stop()
    proc = run_cli("bump", "gitold", "--to", NEW, "--no-lock", images=images, mods=mods, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "open    vllm.commit: bump could not ask" in proc.stdout, proc.stdout
    vllm = yaml.safe_load((images / "gitold-0-19-0.yaml").read_text())["vllm"]
    assert vllm["ref"] == f"v{NEW}" and vllm["version"] == NEW and "`lock` asks again" in vllm["commit"]["unknown"]
    assert not (images / "gitold-0-19-0.lock.json").exists()
