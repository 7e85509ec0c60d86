"""The git-source build, for real: vLLM compiled from a git commit served over HTTPS.

The setup (tests/support/gitsource.py): the real vLLM 0.17.0 source under an annotated tag and a small git
component on an HTTPS git server with a test CA, a base with a real CPU torch and numpy, a
source-phase mod and the shipped install-phase mods, VLLM_TARGET_DEVICE=empty for the compile.
The same variant with its lock, built, pushed, deployed and shown by every verb, is the users' path
(tests/cluster/test_user_path.py); a short SHA's resolution is gitfetch's, tested against a git server of
its own (tests/unit/test_gitfetch.py).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.cli import run_cli as sparkforge
from tests.support.gitsource import NUMPY, VARIANT, GitSource, ran_steps

pytestmark = [pytest.mark.docker, pytest.mark.network]


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def built(git_setup: GitSource) -> dict:
    proc = git_setup.build()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    tag = json.loads(git_setup.cli("show", VARIANT, "--json").stdout)["tag"]
    record = json.loads(sparkforge("inspect", tag, "--json").stdout)["record"]
    return {"tag": tag, "record": record, "stdout": proc.stdout}


def test_annotated_tag_is_recorded_as_its_commit(git_setup: GitSource, built: dict) -> None:
    assert git_setup.tag_object != git_setup.commit  # an annotated tag: its own object
    record = built["record"]
    assert record["vllm"]["built_commit"] == git_setup.commit
    assert record["installed"]["sparkprobe"] == git_setup.probe  # v1.0.0, peeled to the commit


def test_source_mod_and_install_mods_applied(built: dict) -> None:
    assert [(m["name"], m["phase"], m["result"]) for m in built["record"]["mods"]] == [
        ("probe-source-mark", "source", "applied"), ("uf17-eager-allreduce", "install", "applied"),
        ("fix-qwen35-tp4-marlin", "install", "applied"), ("serve-torchrun", "install", "applied")]
    # The edit reached the compiled wheel that the image installed.
    proc = _run("docker", "run", "--rm", "--network", "none", built["tag"], "python3", "-c",
                "import importlib.util, pathlib; s = importlib.util.find_spec('vllm'); "
                "print(pathlib.Path(s.origin).read_text().count('SPARKFORGE_SOURCE_PROBE'))")
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


def test_protected_torch_and_numpy_held(built: dict) -> None:
    record = built["record"]
    assert record["protected"]["numpy"] == NUMPY
    assert record["protected"]["torch"].startswith("2.13.0")
    assert record["packages"]["numpy"] == NUMPY
    assert record["packages"]["torch"] == record["protected"]["torch"]
    assert record["packages"]["scipy"]  # installed, at a release that accepts the protected numpy
    assert record["packages"]["sparkprobe"] == "1.0.0"
    assert "jq" not in record.get("packages", {})  # an OS package, not a Python one
    assert _run("docker", "run", "--rm", "--network", "none", built["tag"], "jq", "--version").returncode == 0


def test_build_env_stays_out_of_the_runtime_env(built: dict) -> None:
    env = json.loads(_run("docker", "image", "inspect", "--format", "{{json .Config.Env}}", built["tag"]).stdout)
    assert not any(e.startswith("VLLM_TARGET_DEVICE=") for e in env)
    assert "VLLM_UF_EAGER_ALLREDUCE=0" in env


def test_a_short_sha_that_names_no_commit_fails_in_one_line(git_setup: GitSource, built: dict) -> None:
    (git_setup.images / "testgit-nosuch.yaml").write_text(
        f"extends: {VARIANT}\nvllm:\n  ref: 0000000ab\n  commit:\n    unknown: a short SHA that is in no branch\n")
    proc = git_setup.build("testgit-nosuch")
    assert proc.returncode == 1
    assert "no commit starting with 0000000ab" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_rebuilds_rerun_only_what_a_change_touches(git_setup: GitSource, built: dict) -> None:
    again = git_setup.build()
    assert again.returncode == 0 and ": 0 steps ran," in again.stdout, again.stdout[-2000:]
    # Each edit is new to this run: BuildKit matches steps by content, so a text an earlier run on the
    # same engine already built would come from its cache and show nothing.
    edit = f"summary: (edited {uuid.uuid4().hex[:12]}) "
    install_mod = git_setup.mods / "uf17-eager-allreduce" / "mod.yaml"
    install_mod.write_text(install_mod.read_text().replace("summary: ", edit, 1))
    proc = git_setup.build()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [s for s in _ran_steps(proc.stdout) if s.startswith("vllm-")]
    assert [s for s in _ran_steps(proc.stdout) if s.startswith("runtime")]
    # The source stage reads the mod's mod.json (no summary: a text edit costs no compile) and its patch; a
    # line before the patch's first header is text that git apply skips, and new bytes in what the stage copies.
    patch = git_setup.mods / "probe-source-mark" / "probe.patch"
    original = patch.read_bytes()
    try:
        patch.write_bytes(f"{edit}\n\n".encode() + original)
        proc = git_setup.build()
        assert proc.returncode == 0, proc.stderr[-3000:]
        ran = _ran_steps(proc.stdout)
        assert any(s.startswith("vllm-source") for s in ran) and any(s.startswith("vllm-build") for s in ran), ran
    finally:
        patch.write_bytes(original)  # the tests after this one build the source as the setup made it


def _ran_steps(stdout: str) -> list[str]:
    """The steps BuildKit ran in the build whose log the build's output names."""
    return ran_steps(Path(next(line for line in stdout.splitlines() if "; log: " in line).rsplit("; log: ", 1)[1]))
