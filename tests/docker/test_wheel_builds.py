"""The wheel cache and prebuilt wheels, built for real.

The git-source setup of tests/support/gitsource.py (the real vLLM 0.17.0 tree over HTTPS, compiled with
VLLM_TARGET_DEVICE=empty) compiles once into a wheel cache of the test's own, and the image installs that
wheel; a rebuild of the same plan runs no step. Why a cached wheel does not fit (another arch list, commit,
mod) is the cache key's logic, tested in tests/unit/test_wheels.py. The wheel the compile made is then
served over HTTPS with a test CA as a recipe's `source: wheel`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import fileserver
from tests.support.gitsource import VARIANT, GitSource

pytestmark = [pytest.mark.docker, pytest.mark.network]

PINNED = "testgit-wc"  # testgit with every commit pinned, so that the cache can key it
WHEEL = "testwheel"


@pytest.fixture(scope="module")
def setup(git_setup: GitSource) -> GitSource:
    s = git_setup
    (s.images / f"{PINNED}.yaml").write_text(f"extends: {VARIANT}\ncomponents:\n  sparkprobe:\n    commit: {s.probe}\n")
    s.wheel_cache = s.root / "wheel-cache"
    return s


def build(s: GitSource, variant: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = s.build(variant, "--wheel-cache", str(s.wheel_cache), *extra, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def entries(s: GitSource) -> list[dict]:
    proc = s.cli("wheels", "list", "--wheel-cache", str(s.wheel_cache), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def record(tag: str, host: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"} | ({"DOCKER_HOST": host} if host else {})
    proc = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "cat", tag,
                           "/opt/sparkforge/build-record.json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def tag_of(s: GitSource, variant: str) -> str:
    return json.loads(s.cli("show", variant, "--json").stdout)["tag"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def compiled(setup: GitSource) -> dict:
    proc = build(setup, PINNED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (entry,) = entries(setup)
    return {"proc": proc, "entry": entry, "tag": tag_of(setup, PINNED)}


def test_a_compile_stores_its_wheel_and_the_image_installs_that_wheel(setup: GitSource, compiled: dict) -> None:
    out, entry = compiled["proc"].stdout, compiled["entry"]
    assert "vLLM wheel: compiling, because the wheel cache holds no wheel of vllm" in out, out
    assert f"compiled (the wheel cache holds no wheel of vllm {setup.commit[:12]}) and stored" in out, out
    compile_log = Path(out.split("compile log: ", 1)[1].split()[0])
    assert "--target wheel-export" in compile_log.read_text() and "pip wheel" in compile_log.read_text()
    inputs = entry["inputs"]
    assert inputs["vllm"]["commit"] == setup.commit
    assert inputs["torch_cuda_arch_list"] == "12.1a" and inputs["build_env"] == {"VLLM_TARGET_DEVICE": "empty"}
    assert [m["name"] for m in inputs["source_mods"]] == ["probe-source-mark"]
    assert inputs["git_components"] == {"sparkprobe": setup.probe}
    stored = setup.wheel_cache / entry["key"] / entry["wheel"]
    assert sha256(stored) == entry["sha256"]
    wheel = record(compiled["tag"])["vllm"]["installed_wheel"]
    assert wheel["origin"] == "cache" and wheel["sha256"] == entry["sha256"] and wheel["cache_key"] == entry["key"]
    plan_hash = json.loads(setup.cli("show", PINNED, "--json").stdout)["plan_hash"]
    assert wheel["compiled_for"].startswith(f"{PINNED}-{plan_hash[:12]} at ")


def test_a_rebuild_of_the_same_plan_runs_no_step(setup: GitSource, compiled: dict) -> None:
    proc = build(setup, PINNED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from the wheel cache" in proc.stdout and ": 0 steps ran," in proc.stdout, proc.stdout[-3000:]


# ------------------------------------------------------------------ source: wheel, over HTTPS


@pytest.fixture(scope="module")
def wheel_server(setup: GitSource, compiled: dict, tmp_path_factory):
    """An HTTPS server with a test CA, serving the compiled wheel and a copy that claims another version."""
    root = tmp_path_factory.mktemp("served")
    entry = compiled["entry"]
    stored = setup.wheel_cache / entry["key"] / entry["wheel"]
    shutil.copy(stored, root / stored.name)
    shutil.copy(stored, root / stored.name.replace("-0.17.0", "-0.17.1", 1))
    server = fileserver.start(root.parent / f"{root.name}-certs", root=root)
    bundle = fileserver.bundle(server.ca, root.parent / f"{root.name}-bundle.crt")
    yield {"url": server.url, "name": stored.name, "sha256": entry["sha256"], "bundle": bundle}
    server.stop()


def wheel_recipe(server: dict, *, version: str = "", name: str | None = None, sha: str | None = None) -> str:
    """A recipe of the served wheel; its version is the wheel's own (0.17.0+empty: the compile's local tag)."""
    version = version or server["name"].split("-")[1]
    return f"""description: the vLLM wheel compiled by the git-source test, as a prebuilt wheel over HTTPS
image: sparkforge-test/vllm
platform: linux/amd64
base:
  repository: sparkforge-test/base-torch
  tag: bookworm
  digest:
    unknown: made by the tests on this machine
vllm:
  source: wheel
  url: {server['url']}/{name or server['name']}
  sha256: "{sha or server['sha256']}"
  version: "{version}"
  install_deps: false
protect: [torch, numpy]
build:
  torch_cuda_arch_list: 12.1a
# The wheel of a VLLM_TARGET_DEVICE=empty compile holds no CUDA extension.
gpus: []
mods:
  - uf17-eager-allreduce
  - serve-torchrun
"""


def test_a_prebuilt_wheel_over_https_is_hash_checked_and_installed(setup: GitSource, wheel_server: dict) -> None:
    (setup.images / f"{WHEEL}.yaml").write_text(wheel_recipe(wheel_server))
    proc = setup.cli("build", WHEEL, "--ca-cert", str(wheel_server["bundle"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"vllm wheel: the recipe's prebuilt wheel, sha256 {wheel_server['sha256']}" in proc.stdout, proc.stdout
    rec = record(tag_of(setup, WHEEL))
    assert rec["vllm"]["installed_wheel"]["origin"] == "recipe"
    assert rec["vllm"]["installed_wheel"]["sha256"] == wheel_server["sha256"]
    assert [(m["name"], m["result"]) for m in rec["mods"]] == [("uf17-eager-allreduce", "applied"),
                                                                 ("serve-torchrun", "applied")]


@pytest.mark.parametrize("case", ["wrong sha256", "metadata says another version", "untrusted CA"])
def test_a_bad_prebuilt_wheel_is_refused_in_one_line_and_moves_no_tag(setup: GitSource, wheel_server: dict,
                                                                    case: str) -> None:
    variant = f"{WHEEL}-bad"
    other = wheel_server["name"].replace("-0.17.0", "-0.17.1", 1)
    claimed, real = other.split("-")[1], wheel_server["name"].split("-")[1]
    recipe, ca, want, code = {
        "wrong sha256": (wheel_recipe(wheel_server, sha="0" * 64), wheel_server["bundle"],
                         f"vllm.sha256: the wheel has sha256 {wheel_server['sha256']}, not {'0' * 64}", 2),
        "metadata says another version": (wheel_recipe(wheel_server, version=claimed, name=other),
                                          wheel_server["bundle"], f"holds vllm {real} (its METADATA), but the recipe "
                                          f"says version {claimed}", 2),
        "untrusted CA": (wheel_recipe(wheel_server, sha="1" * 64), setup.ca_bundle,
                         "TLS certificate not trusted", 1),
    }[case]
    (setup.images / f"{variant}.yaml").write_text(recipe)
    proc = setup.cli("build", variant, "--ca-cert", str(ca))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and want in lines[0], proc.stderr
    assert f"{variant}.yaml" in lines[0]
    moving = subprocess.run(["docker", "image", "inspect", f"sparkforge-test/vllm:{variant}"], capture_output=True)
    assert moving.returncode != 0  # no tag was made
