"""The users' path, built for real: vLLM compiled from a git commit served over HTTPS, with its lock.

A git server on loopback (tests/gitserver.py, a test CA given as --ca-cert) holds the real vLLM
0.17.0 source (from the release sdist) under an annotated tag, and a small Python project as a git
component. The base holds a real CPU torch and numpy; `build.env` sets VLLM_TARGET_DEVICE=empty,
so the real `pip wheel` of the vLLM tree runs without CUDA. One source-phase mod edits setup.py and
vllm/__init__.py before the compile; the shipped install-phase mods follow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, image_id, sparkforge

sys.path.insert(0, str(ROOT / "tests"))
import gitserver  # noqa: E402

from sparkforge import sources  # noqa: E402

TORCH_BASE = "sparkforge-test/base-torch:bookworm"
NUMPY = "1.24.4"  # older than what the newest scipy needs, so an unconstrained install would upgrade it
VARIANT = "testgit"


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, **kw)


@pytest.fixture(scope="session")
def torch_base(base_image: str, tmp_path_factory) -> str:
    """The local base plus a real CPU torch 2.13.0 and numpy, as an NGC base holds its own builds."""
    if image_id(TORCH_BASE):
        return TORCH_BASE
    ctx = tmp_path_factory.mktemp("torch-base")
    proc = _run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "torch==2.13.0", "-d", str(ctx))
    if proc.returncode != 0:
        pytest.skip(f"no torch 2.13.0 wheel for this Python: {proc.stderr.strip()[-200:]}")
    (ctx / "Dockerfile").write_text(
        f"FROM {base_image}\n"
        "RUN --mount=type=bind,source=.,target=/ctx --mount=type=secret,id=ca \\\n"
        "    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \\\n"
        f"    python3 -m pip install --break-system-packages --no-cache-dir /ctx/torch-*.whl numpy=={NUMPY}\n")
    proc = _run("docker", "buildx", "build", "--load", "--network", "host", "--secret",
                "id=ca,src=/etc/ssl/certs/ca-certificates.crt", "-t", TORCH_BASE, str(ctx), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return TORCH_BASE


def _recipe(server: gitserver.GitServer, vllm_commit: str) -> str:
    return f"""# Written by tests/docker/test_git_source.py: the git-source path over HTTPS.
description: vLLM 0.17.0 compiled from git (VLLM_TARGET_DEVICE=empty), a git component, a source-phase mod
image: sparkforge-test/vllm
base:
  repository: sparkforge-test/base-torch
  tag: bookworm
  digest:
    unknown: made by the tests on this machine; no registry holds it
os_packages: [jq]
vllm:
  source: git
  repo: {server.repo_url("vllm")}
  ref: v0.17.0
  commit: {vllm_commit}
  version: "0.17.0"
  install_deps: false
components:
  sparkprobe:
    git: {server.repo_url("sparkprobe")}
    ref: v1.0.0
    commit:
      unknown: the tests resolve the annotated tag v1.0.0 in the build, and `lock` records it
    dest: /opt/src/sparkprobe
    pip_install: true
  scipy:
    pip: scipy
    version:
      unknown: the newest scipy that the protected numpy allows; `lock` pins what the build installed
protect: [torch, numpy]
build:
  torch_cuda_arch_list: 12.1a
  max_jobs: 2
  env:
    VLLM_TARGET_DEVICE: empty
mods:
  - probe-source-mark
  - uf17-eager-allreduce
  - fix-qwen35-tp4-marlin
  - serve-torchrun
"""


class Setup:
    def __init__(self, root: Path, server: gitserver.GitServer, commit: str, tag_object: str, probe: str) -> None:
        self.root, self.server, self.commit, self.tag_object, self.probe = root, server, commit, tag_object, probe
        self.images, self.mods = root / "images", root / "mods"

    def cli(self, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
        env = dict(os.environ, GIT_SSL_CAINFO=str(self.ca_bundle))
        return subprocess.run([sys.executable, str(ROOT / "build.py"), "--images", str(self.images), "--mods",
                               str(self.mods), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=env)

    @property
    def ca_bundle(self) -> Path:
        """The system CA bundle plus the test CA: PyPI and the git server both verify."""
        return self.root / "ca-bundle.crt"

    def build(self, variant: str = VARIANT, *extra: str) -> subprocess.CompletedProcess:
        return self.cli("build", variant, "--ca-cert", str(self.ca_bundle), *extra)


@pytest.fixture(scope="module")
def git_setup(torch_base: str, tmp_path_factory):
    root = tmp_path_factory.mktemp("gitsrc")
    repos = root / "repos"
    repos.mkdir()
    tree = gitserver.extract_sdist(sources.download(sources.find_release("vllm", "0.17.0")), root / "sdist")
    commit = gitserver.init_repo(repos, "vllm", tree, tag="v0.17.0", message="vLLM 0.17.0 (release sdist)")
    tag_object = gitserver.git(repos / "vllm.git", "rev-parse", "v0.17.0")
    probe = gitserver.init_repo(repos, "sparkprobe", ROOT / "tests" / "gitrepos" / "sparkprobe", tag="v1.0.0")
    server = gitserver.start(repos, root / "certs")
    setup = Setup(root, server, commit, tag_object, probe)
    setup.ca_bundle.write_bytes(Path("/etc/ssl/certs/ca-certificates.crt").read_bytes() + server.ca.read_bytes())
    setup.images.mkdir()
    (setup.images / f"{VARIANT}.yaml").write_text(_recipe(server, commit))
    short = f"extends: {VARIANT}\nvllm:\n  ref: {commit[:9]}\n  commit:\n    unknown: only the short SHA is on record\n"
    (setup.images / f"{VARIANT}-short.yaml").write_text(short)
    shutil.copytree(ROOT / "mods", setup.mods)
    shutil.copytree(ROOT / "tests" / "mods" / "probe-source-mark", setup.mods / "probe-source-mark")
    yield setup
    server.stop()


@pytest.fixture(scope="module")
def built(git_setup: Setup) -> dict:
    proc = git_setup.build()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    tag = json.loads(git_setup.cli("show", VARIANT, "--json").stdout)["tag"]
    record = json.loads(sparkforge("inspect", tag, "--json").stdout)["record"]
    return {"tag": tag, "record": record, "stdout": proc.stdout}


def test_annotated_tag_is_recorded_as_its_commit(git_setup: Setup, built: dict) -> None:
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


def test_short_sha_is_resolved_to_the_full_commit(git_setup: Setup, built: dict) -> None:
    proc = git_setup.build(f"{VARIANT}-short")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tag = json.loads(git_setup.cli("show", f"{VARIANT}-short", "--json").stdout)["tag"]
    record = json.loads(sparkforge("inspect", tag, "--json").stdout)["record"]
    assert record["vllm"]["built_commit"] == git_setup.commit


def test_a_short_sha_that_names_no_commit_fails_in_one_line(git_setup: Setup, built: dict) -> None:
    (git_setup.images / "testgit-nosuch.yaml").write_text(
        f"extends: {VARIANT}\nvllm:\n  ref: 0000000ab\n  commit:\n    unknown: a short SHA that is in no branch\n")
    proc = git_setup.build("testgit-nosuch")
    assert proc.returncode == 1
    assert "no commit starting with 0000000ab" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_rebuilds_rerun_only_what_a_change_touches(git_setup: Setup, built: dict) -> None:
    again = git_setup.build()
    assert again.returncode == 0 and ": 0 steps ran," in again.stdout, again.stdout[-2000:]
    install_mod = git_setup.mods / "uf17-eager-allreduce" / "mod.yaml"
    install_mod.write_text(install_mod.read_text().replace("summary: ", "summary: (edited) ", 1))
    proc = git_setup.build()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [s for s in _ran_steps(proc.stdout) if s.startswith("vllm-")]
    assert [s for s in _ran_steps(proc.stdout) if s.startswith("runtime")]
    source_mod = git_setup.mods / "probe-source-mark" / "mod.yaml"
    source_mod.write_text(source_mod.read_text().replace("summary: ", "summary: (edited) ", 1))
    proc = git_setup.build()
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = _ran_steps(proc.stdout)
    assert any(s.startswith("vllm-source") for s in ran) and any(s.startswith("vllm-build") for s in ran), ran


def _ran_steps(stdout: str) -> list[str]:
    """The names ("stage i/n") of the steps BuildKit ran rather than took from its cache, from the build log."""
    log = Path(next(line for line in stdout.splitlines() if "; log: " in line).rsplit("; log: ", 1)[1])
    heads, cached = {}, set()
    for line in log.read_text().splitlines():
        if m := re.match(r"^#(\d+) \[([^\]]+)\] (RUN|COPY)", line):
            heads.setdefault(m.group(1), m.group(2))
        elif m := re.match(r"^#(\d+) CACHED$", line):
            cached.add(m.group(1))
    return [name for n, name in heads.items() if n not in cached]


def test_with_a_lock_every_command_names_one_tag(git_setup: Setup, built: dict, registry) -> None:
    proc = git_setup.cli("lock", VARIANT, "--image", built["tag"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lock = json.loads((git_setup.images / f"{VARIANT}.lock.json").read_text())
    assert lock["components"]["sparkprobe"]["commit"] == git_setup.probe
    assert lock["vllm"]["commit"] == git_setup.commit
    shown = json.loads(git_setup.cli("show", VARIANT, "--json").stdout)["tag"]
    assert shown != built["tag"]  # the lock pins more (packages, epoch), so it is another plan
    dry = git_setup.cli("build", VARIANT, "--dry-run", "--ca-cert", str(git_setup.ca_bundle))
    assert dry.stdout.splitlines()[0].split()[1] == shown
    proc = git_setup.build(VARIANT, "--locked")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"tagged {shown}" in proc.stdout
    test = git_setup.cli("test", VARIANT)
    assert test.returncode == 0, test.stdout + test.stderr
    push = git_setup.cli("push", VARIANT, "--registry", registry.address)
    assert push.returncode == 0, push.stdout + push.stderr
    assert registry.has_tag("sparkforge-test/vllm", shown.rpartition(":")[2])
    status = git_setup.cli("status", VARIANT, "--nodes", "unix:///run/docker.sock")
    assert status.returncode == 0, status.stdout + status.stderr
    assert shown.rpartition(":")[2] in status.stdout
