"""What the tests need of the machine, in one table (NEEDS), and which tiers a run must cover.

A test says what it needs with its tier marker (`network`, `docker`, `root`, `cluster`, `gpu`: each is
the need of the same name), with `@pytest.mark.needs(NAME, ...)`, or, where a fixture needs more, with
`require(NAME)`. A missing need skips the test, and the reason starts with the need's name. Where the
run must cover the test's tier (SPARKFORGE_REQUIRED_TIERS, or CI=true for every tier but gpu), that
skip fails the test instead (tests/conftest.py), and so does any skip whose reason names no need here.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

import pytest

from tests.support.paths import BASE

DOCKER_INFO_LIMIT = 30.0  # seconds: an engine that does not answer `docker info` in this time is wedged
TEST_USER = os.environ.get("SPARKFORGE_TEST_USER", "sparkforge-user")
CUDA_DRIVER = (13, 0)  # PyPI's vLLM 0.33.0 and torch 2.14.0 are CUDA 13.0 builds (vllm/envs.py: VLLM_MAIN_CUDA_VERSION)


@dataclass(frozen=True)
class Need:
    what: str  # what the tests need, in a few words
    probe: Callable[[], str | None]  # why this machine lacks it, or None


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str] | str:
    """The finished command, or why it could not run within its time."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(argv[:2])}` did not answer within {timeout:.0f} s"
    except OSError as exc:
        return f"`{argv[0]}` cannot run: {exc.strerror or exc}"


def _last(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _network() -> str | None:
    """The package index, asked the way sparkforge asks it (urllib: proxies, CA)."""
    url = os.environ.get("SPARKFORGE_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return None
    except urllib.error.HTTPError:
        return None  # the index answered
    except (OSError, ValueError) as exc:
        return f"the package index {url} cannot be read: {exc}"


def docker_problem(limit: float = DOCKER_INFO_LIMIT) -> str | None:
    """Why no Docker engine with buildx can be used here: none answers `docker info` (a wedged one within
    `limit` seconds), or the CLI has no buildx."""
    if _docker_cli():
        return _docker_cli()
    info = _run("docker", "info", "--format", "{{.ServerVersion}}", timeout=limit)
    if isinstance(info, str):
        return f"the Docker engine is wedged: {info}" if "did not answer" in info else info
    if info.returncode != 0:
        return f"the Docker engine does not answer: {_last(info.stderr)}"
    buildx = _run("docker", "buildx", "version", timeout=limit)
    if isinstance(buildx, str) or buildx.returncode != 0:
        return f"the docker CLI has no buildx: {buildx if isinstance(buildx, str) else _last(buildx.stderr)}"
    return None


def _docker_cli() -> str | None:
    return None if shutil.which("docker") else "the docker CLI is not installed"


def _root() -> str | None:
    return None if os.geteuid() == 0 else "needs root (extra daemons, network namespaces, users)"


def _cluster() -> str | None:
    from tests.infra.netns import missing as netns_missing

    return netns_missing() or missing("docker")


def _dockerd() -> str | None:
    if os.geteuid() != 0:
        return "starting engines of the tests' own needs root"
    return None if shutil.which("dockerd") else "dockerd is not on PATH"


def _base_local() -> str | None:
    from tests.support.docker import image_id

    if missing("docker") or image_id(BASE):
        return missing("docker")  # no engine to hold the base, or the base is there
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        return f"{BASE} is missing, and making it needs root and debootstrap: run `sudo make base-local` once"
    return None


def _docker_registry() -> str | None:
    if shutil.which("docker-registry") is None:
        return "docker-registry is not installed (Debian package docker-registry)"
    return None


def _test_user() -> str | None:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "switching to the non-root user needs root and runuser"
    try:
        user = pwd.getpwnam(TEST_USER)
    except KeyError:
        return f"no user {TEST_USER} (`.ci/provision` adds it, in the docker group)"
    try:
        docker = grp.getgrnam("docker")
    except KeyError:
        return "no group docker"
    if user.pw_uid == 0 or not (user.pw_name in docker.gr_mem or user.pw_gid == docker.gr_gid):
        return f"{TEST_USER} must be a non-root member of the docker group"
    return None


def _git() -> str | None:
    absent = [tool for tool in ("git", "openssl") if shutil.which(tool) is None]
    return f"{' and '.join(absent)} not installed" if absent else None


def _torch() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch is not installed in this Python ({exc})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no GLOO backend"
    return None


def _gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this host (nvidia-smi not found)"
    listed = _run("nvidia-smi", "-L", timeout=30)
    if isinstance(listed, str):
        return listed
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return f"nvidia-smi lists no GPU: {_last(listed.stdout + listed.stderr)}"
    return None


def _gpu_runtime() -> str | None:
    """What `docker run --gpus` needs: the NVIDIA runtime in the engine, or the toolkit's hook on PATH."""
    if missing("docker"):
        return missing("docker")
    runtimes = _run("docker", "info", "--format", "{{json .Runtimes}}", timeout=DOCKER_INFO_LIMIT)
    if not isinstance(runtimes, str) and '"nvidia"' in runtimes.stdout:
        return None
    if shutil.which("nvidia-container-runtime-hook"):
        return None
    return ("the engine cannot give a container the GPU: no nvidia runtime in `docker info` and no "
            "nvidia-container-runtime-hook on PATH (install the NVIDIA Container Toolkit)")


def driver_cuda(nvidia_smi_output: str) -> tuple[int, int] | None:
    """The newest CUDA the driver runs, from the header of `nvidia-smi` ("CUDA Version: 13.0")."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi_output)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _cuda_driver() -> str | None:
    if missing("gpu"):
        return missing("gpu")
    header = _run("nvidia-smi", timeout=30)
    if isinstance(header, str):
        return header
    have = driver_cuda(header.stdout)
    if have is None:
        return "nvidia-smi shows no CUDA version"
    if have < CUDA_DRIVER:
        return (f"the NVIDIA driver runs CUDA up to {have[0]}.{have[1]}; the gpu tests' image needs "
                f"{CUDA_DRIVER[0]}.{CUDA_DRIVER[1]}")
    return None


def _x86_64() -> str | None:
    import platform

    return None if platform.machine() == "x86_64" else f"this machine is {platform.machine()}"


def _libzstd() -> str | None:
    from sparkforge.inimage import decompress

    return None if decompress.system("zstd") is not None else "libzstd cannot be loaded (Debian package libzstd1)"


def bare_python() -> str | None:
    """An interpreter without the project's dependencies (the venv's base, else the machine's python3), or None."""
    import sys

    for candidate in (getattr(sys, "_base_executable", ""), "/usr/bin/python3", shutil.which("python3") or ""):
        if candidate and os.path.exists(candidate) and os.path.realpath(candidate) != os.path.realpath(sys.executable):
            probe = _run(candidate, "-c", "import typer", timeout=60)
            if not isinstance(probe, str) and probe.returncode != 0:
                return candidate
    return None


def _bare_python() -> str | None:
    return None if bare_python() else "every python3 here has typer installed"


# The tier markers first (their names are needs too), then what fixtures and single tests need.
NEEDS: dict[str, Need] = {
    "network": Need("the package index (PyPI or SPARKFORGE_INDEX_URL)", _network),
    "docker": Need(f"a Docker engine with buildx that answers `docker info` within {DOCKER_INFO_LIMIT:.0f} s",
                   docker_problem),
    "root": Need("root (extra daemons, users, mounts)", _root),
    "cluster": Need("network namespaces, sshd and dockerd for a cluster of hosts (root)", _cluster),
    "gpu": Need("an NVIDIA GPU (`nvidia-smi -L` lists one)", _gpu),
    "gpu-runtime": Need("an engine that gives containers the GPU (the NVIDIA Container Toolkit)", _gpu_runtime),
    "cuda-driver": Need(f"an NVIDIA driver that runs CUDA {CUDA_DRIVER[0]}.{CUDA_DRIVER[1]}", _cuda_driver),
    "docker-cli": Need("the docker CLI (no engine needed)", _docker_cli),
    "dockerd": Need("root and dockerd on PATH, for engines of the tests' own", _dockerd),
    "old-dockerd": Need("an older engine for a node of the tests' own: dockerd-26 on PATH (.ci/provision)",
                        lambda: _dockerd() or (None if shutil.which("dockerd-26") else "dockerd-26 is not on PATH")),
    "base-local": Need(f"the local base {BASE}, or root and debootstrap to make it", _base_local),
    "docker-registry": Need("Debian's docker-registry", _docker_registry),
    "test-user": Need(f"root, runuser and a non-root member of the docker group ({TEST_USER})", _test_user),
    "git": Need("git and openssl", _git),
    "diff": Need("the diff command (GNU diffutils)", lambda: None if shutil.which("diff") else "diff is not installed"),
    "x86-64": Need("an x86-64 machine (the reference cuobjdump of the kernel tests is an x86-64 wheel)", _x86_64),
    "libzstd": Need("libzstd, to compress test data and to decode all 1.1 GB of torch's sm_120 code", _libzstd),
    "bare-python": Need("a python3 without typer, to show build.py finding .venv", _bare_python),
    "torch": Need("torch with the GLOO backend in the tests' Python (CPU is fine)", _torch),
}
TIERS = ("unit", "network", "docker", "root", "cluster", "gpu")  # unit: a test with no tier marker
MARKED = ("gpu", "cluster", "docker", "root", "network")  # a test's tier: the first of its markers in this order
CI_TIERS = frozenset(TIERS) - {"gpu"}


@cache
def missing(name: str) -> str | None:
    """Why this machine lacks the need, or None; asked once per process."""
    return NEEDS[name].probe()


def skip_reason(name: str) -> str | None:
    """The skip reason of a missing need, `NAME: why`, or None when the need is met."""
    why = missing(name)
    return f"{name}: {why}" if why else None


def require(*names: str) -> None:
    """Skip the test (or every test of a fixture) unless the machine has each need."""
    for name in names:
        reason = skip_reason(name)
        if reason:
            pytest.skip(reason)


def need_of(reason: str) -> str | None:
    """The need a skip reason names, or None for a skip outside the table."""
    name = reason.split(":", 1)[0]
    return name if name in NEEDS and reason.startswith(f"{name}: ") else None


@dataclass(frozen=True)
class Required:
    """The tiers a run must cover, and where that was said."""

    tiers: frozenset[str]
    source: str

    @classmethod
    def of(cls, environ: Mapping[str, str]) -> Required:
        """From SPARKFORGE_REQUIRED_TIERS (names, comma or space separated; `all`; empty: none), else from CI=true
        (every tier but gpu). A name that is no tier raises ValueError."""
        raw = environ.get("SPARKFORGE_REQUIRED_TIERS")
        if raw is None:
            if environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
                return cls(CI_TIERS, "CI=true: every tier but gpu")
            return cls(frozenset(), "")
        names = {name for name in re.split(r"[\s,]+", raw.strip()) if name}
        if "all" in names:
            names = (names - {"all"}) | set(TIERS)
        unknown = sorted(names - set(TIERS))
        if unknown:
            raise ValueError(f"SPARKFORGE_REQUIRED_TIERS: {', '.join(map(repr, unknown))} is no tier; the tiers are "
                             f"{', '.join(TIERS)} (or all)")
        return cls(frozenset(names), f"SPARKFORGE_REQUIRED_TIERS={raw.strip()}")

    def problem(self, tier: str, reason: str) -> str | None:
        """Why a test of `tier` that skipped for `reason` fails this run instead, or None when the skip stands."""
        if need_of(reason) is None:
            return f"skipped outside the table of needs (tests/support/needs.py): {reason}"
        if tier in self.tiers:
            return f"the {tier} tier must run here ({self.source}), but a need is missing: {reason}"
        return None

    def describe(self) -> str:
        if not self.tiers:
            return "tiers that must run: none (tests whose needs are missing skip; CI=true or " \
                   "SPARKFORGE_REQUIRED_TIERS makes such a skip fail)"
        return f"tiers that must run: {', '.join(t for t in TIERS if t in self.tiers)} ({self.source})"
