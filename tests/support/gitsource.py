"""The git-source setup shared by tests/docker/test_git_source.py and bench/rebuild.py.

A git server on loopback (tests/support/gitserver.py, a test CA) holds the real vLLM 0.17.0 source (from
the release sdist) under an annotated tag, and a small Python project as a git component. The base
holds a real CPU torch and numpy; `build.env` sets VLLM_TARGET_DEVICE=empty, so the real
`pip wheel` of the vLLM tree runs without CUDA. One source-phase mod (tests/mods) edits setup.py
and vllm/__init__.py before the compile; the shipped install-phase mods follow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkforge.recipe import sources
from tests.support.cli import run_cli
from tests.support import gitserver
from tests.support.once import one_at_a_time
from tests.support.paths import CA, MODS, ROOT, TEST_MODS

TORCH_BASE = "sparkforge-test/base-torch:bookworm"
NUMPY = "1.24.4"  # older than what the newest scipy needs, so an unconstrained install would upgrade it
VARIANT = "testgit"
SYSTEM_CA = Path(CA)


def _run(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
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


def recipe(server: Served, vllm_commit: str) -> str:
    return f"""# Written by tests/support/gitsource.py: the git-source path over HTTPS.
description: vLLM 0.17.0 compiled from git (VLLM_TARGET_DEVICE=empty), a git component, a source-phase mod
image: sparkforge-test/vllm
platform: linux/amd64
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
    heads: dict[str, str] = {}  # step number -> its name
    cached: set[str] = set()
    for line in log.read_text().splitlines():
        if m := re.match(r"^#(\d+) \[([^\]]+)\] (RUN|COPY)", line):
            heads.setdefault(m.group(1), m.group(2))
        elif m := re.match(r"^#(\d+) CACHED$", line):
            cached.add(m.group(1))
    return [name for n, name in heads.items() if n not in cached]


@dataclass(frozen=True)
class Served:
    """The git server's repositories as the builds reach them: base URL, test CA, and what the tags point at."""

    url: str
    ca: Path
    commit: str      # vllm.git's one commit, tagged v0.17.0 by an annotated tag
    tag_object: str  # that tag's own object
    probe: str       # sparkprobe.git's one commit, tagged v1.0.0

    def repo_url(self, name: str) -> str:
        return f"{self.url}/{name}.git"


def _make_repos(repos: Path, work: Path) -> tuple[str, str, str]:
    """vllm.git (the 0.17.0 sdist) and sparkprobe.git under repos: (commit, tag object, probe commit)."""
    repos.mkdir(parents=True)
    tree = gitserver.extract_sdist(sources.download(sources.find_release("vllm", "0.17.0")), work / "sdist")
    commit = gitserver.init_repo(repos, "vllm", tree, tag="v0.17.0", message="vLLM 0.17.0 (release sdist)")
    shutil.rmtree(work / "sdist")
    tag_object = gitserver.git(repos / "vllm.git", "rev-parse", "v0.17.0")
    probe = gitserver.init_repo(repos, "sparkprobe", ROOT / "tests" / "gitrepos" / "sparkprobe", tag="v1.0.0")
    return commit, tag_object, probe


# One git server for a whole test run: the processes that build the git-source variant on one engine (the
# git-source tests and the users' path) then fetch from the same URLs, and BuildKit runs those fetch steps
# once (the repositories are made once, too). The run's controller names a folder and itself in these
# variables; the first process to ask starts the server as a process of its own, which ends when the
# controller does (or is stopped by it, `stop_shared`).
RUN_FOLDER = "SPARKFORGE_TESTS_RUN"
RUN_OWNER = "SPARKFORGE_TESTS_OWNER"


def shared(folder: Path, owner: int, timeout: float = 1800) -> Served:
    """The run's git server in folder, started by the first caller (the others wait for it, then reuse it)."""
    state = folder / "state.json"
    with one_at_a_time("git-server", folder):
        if not state.exists():
            with open(folder / "server.log", "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "tests.support.gitsource", str(folder), str(owner)],
                                        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True)
            deadline = time.monotonic() + timeout
            while not state.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    tail = (folder / "server.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"the shared git server did not start:\n{tail}")
                time.sleep(0.5)
    fields = json.loads(state.read_text())
    return Served(fields["url"], Path(fields["ca"]), fields["commit"], fields["tag_object"], fields["probe"])


def stop_shared(folder: Path) -> None:
    """Stop the run's git server, if one was started, and remove its folder."""
    try:
        pid = json.loads((folder / "state.json").read_text())["pid"]
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        pass
    shutil.rmtree(folder, ignore_errors=True)


def _serve(folder: Path, owner: int) -> None:
    """The shared server's process: make the repositories, serve them, say where, and end with the owner."""
    commit, tag_object, probe = _make_repos(folder / "repos", folder)
    server = gitserver.start(folder / "repos", folder / "certs")
    fields = {"url": server.url, "ca": str(server.ca), "commit": commit, "tag_object": tag_object, "probe": probe,
              "pid": os.getpid()}
    (folder / "state.tmp").write_text(json.dumps(fields))
    os.replace(folder / "state.tmp", folder / "state.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            break
        time.sleep(2)
    server.stop()


class GitSource:
    """A git server with its repositories (its own, or the run's shared one), and a recipe folder and mods
    folder of its own that use it."""

    def __init__(self, root: Path, served: Served | None = None) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._own: gitserver.GitServer | None = None
        if served is None:
            commit, tag_object, probe = _make_repos(root / "repos", root)
            self._own = gitserver.start(root / "repos", root / "certs")
            served = Served(self._own.url, self._own.ca, commit, tag_object, probe)
        self.server = served
        self.commit, self.tag_object, self.probe = served.commit, served.tag_object, served.probe
        self.ca_bundle = root / "ca-bundle.crt"  # the system's CAs plus the test CA: PyPI and the git server
        self.ca_bundle.write_bytes(SYSTEM_CA.read_bytes() + served.ca.read_bytes())
        self.images, self.mods = root / "images", root / "mods"
        self.images.mkdir()
        (self.images / f"{VARIANT}.yaml").write_text(recipe(served, self.commit))
        shutil.copytree(MODS, self.mods)
        shutil.copytree(TEST_MODS / "probe-source-mark", self.mods / "probe-source-mark")

    def cli(self, *args: str, timeout: float = 3600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """The real command line on this setup's recipes and mods (git trusts the test CA); `env` adds to ours."""
        return run_cli(*args, images=self.images, mods=self.mods, timeout=timeout,
                       env={"GIT_SSL_CAINFO": str(self.ca_bundle), **(env or {})})

    def build(self, variant: str = VARIANT, *extra: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.cli("build", variant, "--ca-cert", str(self.ca_bundle), *extra, env=env)

    def stop(self) -> None:
        if self._own is not None:
            self._own.stop()


if __name__ == "__main__":  # the shared server's process (`shared`): FOLDER OWNER_PID
    _serve(Path(sys.argv[1]), int(sys.argv[2]))
