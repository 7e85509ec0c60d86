"""The git-source setup shared by tests/docker/test_git_source.py and bench/rebuild.py.

A git server on loopback (tests/support/gitserver.py, a test CA) holds the real vLLM 0.17.0 source (from
the release sdist) under an annotated tag, and a small Python project as a git component. The base
holds a real CPU torch and numpy; `build.env` sets VLLM_TARGET_DEVICE=empty, so the real
`pip wheel` of the vLLM tree runs without CUDA. One source-phase mod (tests/mods) edits setup.py
and vllm/__init__.py before the compile; the shipped install-phase mods follow.
"""

from __future__ import annotations

import re
import shutil
import importlib.util
import subprocess
import sys
from pathlib import Path

from sparkforge.recipe import sources
from tests.support.cli import run_cli
from tests.support import gitserver
from tests.support.paths import CA, MODS, ROOT, TEST_MODS

TORCH_BASE = "sparkforge-test/base-torch:bookworm"
NUMPY = "1.24.4"  # older than what the newest scipy needs, so an unconstrained install would upgrade it
VARIANT = "testgit"
SYSTEM_CA = Path(CA)


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, **kw)


def ensure_torch_base(base_image: str, workdir: Path) -> str:
    """The local base plus a real CPU torch 2.13.0 and numpy, as an NGC base holds its own builds."""
    if _run("docker", "image", "inspect", TORCH_BASE, timeout=60).returncode == 0:
        return TORCH_BASE
    workdir.mkdir(parents=True, exist_ok=True)
    # The base's Python is bookworm's 3.11, whatever runs the tests; a uv-made .venv has no pip of its own,
    # and a download into workdir installs nothing anywhere.
    pip = [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else ["python3", "-m", "pip"]
    proc = _run(*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                "torch==2.13.0", "-d", str(workdir), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download torch==2.13.0 failed:\n{proc.stderr[-3000:]}")
    (workdir / "Dockerfile").write_text(
        f"FROM {base_image}\n"
        "RUN --mount=type=bind,source=.,target=/ctx --mount=type=secret,id=ca \\\n"
        "    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \\\n"
        f"    python3 -m pip install --break-system-packages --no-cache-dir --no-compile /ctx/torch-*.whl numpy=={NUMPY}\n")
    proc = _run("docker", "buildx", "build", "--load", "--network", "host", "--secret",
                f"id=ca,src={SYSTEM_CA}", "-t", TORCH_BASE, str(workdir), timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"building {TORCH_BASE} failed:\n{proc.stderr[-3000:]}")
    return TORCH_BASE


def recipe(server: gitserver.GitServer, vllm_commit: str) -> str:
    return f"""# Written by tests/support/gitsource.py: the git-source path over HTTPS.
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
# VLLM_TARGET_DEVICE=empty builds no CUDA extension: no GPU to check kernels for.
gpus: []
mods:
  - probe-source-mark
  - uf17-eager-allreduce
  - fix-qwen35-tp4-marlin
  - serve-torchrun
"""


def ran_steps(log: Path) -> list[str]:
    """The names ("stage i/n") of the RUN and COPY steps BuildKit ran rather than took from its cache, from a build log."""
    heads, cached = {}, set()
    for line in log.read_text().splitlines():
        if m := re.match(r"^#(\d+) \[([^\]]+)\] (RUN|COPY)", line):
            heads.setdefault(m.group(1), m.group(2))
        elif m := re.match(r"^#(\d+) CACHED$", line):
            cached.add(m.group(1))
    return [name for n, name in heads.items() if n not in cached]


class GitSource:
    """A running git server with its repositories, and a recipe folder and mods folder that use it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        repos = root / "repos"
        repos.mkdir(parents=True)
        tree = gitserver.extract_sdist(sources.download(sources.find_release("vllm", "0.17.0")), root / "sdist")
        self.commit = gitserver.init_repo(repos, "vllm", tree, tag="v0.17.0", message="vLLM 0.17.0 (release sdist)")
        self.tag_object = gitserver.git(repos / "vllm.git", "rev-parse", "v0.17.0")
        self.probe = gitserver.init_repo(repos, "sparkprobe", ROOT / "tests" / "gitrepos" / "sparkprobe", tag="v1.0.0")
        self.server = gitserver.start(repos, root / "certs")
        self.ca_bundle = root / "ca-bundle.crt"  # the system's CAs plus the test CA: PyPI and the git server
        self.ca_bundle.write_bytes(SYSTEM_CA.read_bytes() + self.server.ca.read_bytes())
        self.images, self.mods = root / "images", root / "mods"
        self.images.mkdir()
        (self.images / f"{VARIANT}.yaml").write_text(recipe(self.server, self.commit))
        shutil.copytree(MODS, self.mods)
        shutil.copytree(TEST_MODS / "probe-source-mark", self.mods / "probe-source-mark")

    def cli(self, *args: str, timeout: float = 3600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """The real command line on this setup's recipes and mods (git trusts the test CA); `env` adds to ours."""
        return run_cli(*args, images=self.images, mods=self.mods, timeout=timeout,
                       env={"GIT_SSL_CAINFO": str(self.ca_bundle), **(env or {})})

    def build(self, variant: str = VARIANT, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return self.cli("build", variant, "--ca-cert", str(self.ca_bundle), *extra, env=env)

    def stop(self) -> None:
        self.server.stop()
