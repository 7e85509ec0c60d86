"""The tiers, the fixtures every tier shares, and a check around the whole run that the tests left the
machine's apt, system Python and Docker settings as they were.

A test declares what it needs with a marker (registered in pyproject.toml, `--strict-markers`):
`network` (the package index), `docker` (an engine with buildx), `root`, `cluster` (network
namespaces, sshd, extra dockerd), `gpu`. A test without one is in the pure unit tier. Where the
machine lacks what a marker needs, its tests skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path

import pytest

from tests.support import hoststate
from tests.support.cli import run_cli
from tests.support.docker import BuiltImage, built, docker_missing, image_id
from tests.support.once import one_at_a_time
from tests.support.paths import BASE, ROOT, TEST_MODS

_before: dict[str, str] = {}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller of an xdist run, or a plain run
        _before.update(hoststate.snapshot())
    # Builds run by the tests keep their compiled wheels in a wheel cache of their own, never the user's.
    os.environ.setdefault("SPARKFORGE_WHEEL_CACHE", tempfile.mkdtemp(prefix="sparkforge-test-wheels-"))


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    shutil.rmtree(os.environ.get("SPARKFORGE_WHEEL_CACHE", "/nonexistent"), ignore_errors=True)
    if not _before:
        return
    changed = hoststate.changed(_before, hoststate.snapshot())
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the test run changed this machine: " + ", ".join(changed)
        if reporter:
            reporter.write_line(message, red=True)
        session.exitstatus = 1


# ------------------------------------------------------------------ tiers

@cache
def _network_missing() -> str | None:
    """Why the package index cannot be read, asked the way sparkforge asks it (urllib: proxies, CA)."""
    url = os.environ.get("SPARKFORGE_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return None
    except urllib.error.HTTPError:
        return None  # the index answered
    except (OSError, ValueError) as exc:
        return f"the package index {url} cannot be read: {exc}"


def _root_missing() -> str | None:
    return None if os.geteuid() == 0 else "needs root (extra daemons, network namespaces, users)"


@cache
def _cluster_missing() -> str | None:
    from tests.infra.netns import missing

    return missing() or docker_missing()


def _gpu_missing() -> str | None:
    return None if shutil.which("nvidia-smi") else "no NVIDIA GPU on this host (nvidia-smi not found)"


# A test's tier, for the summary: the first of its markers in this order, else unit.
TIERS = ("gpu", "cluster", "docker", "root", "network")
ENGINE_TIERS = ("gpu", "cluster", "docker", "root")
NEEDS = {"network": _network_missing, "docker": cache(docker_missing), "root": _root_missing,
         "cluster": _cluster_missing, "gpu": _gpu_missing}


# Tests that use the engine run in four xdist groups, each on one worker and in order, so that what a
# group's modules share (images, daemons, namespaces) is made once per worker: the tests that move
# images between hosts, the git-source builds, the wheel-cache builds, and the rest of the builds (by
# the durations of a CI run, the git-source builds were the longest chain, so the wheel tests left it;
# their builder prune runs on an engine of their own). Two groups may build one plan: the second build
# waits for the first (sparkforge's own lock) and is served from BuildKit's cache; the bases are made by
# one worker while the others wait. Every worker also takes the tests outside the groups (`make test`).
HOSTS_GROUP = ("tests/cluster/", "tests/infra/", "tests/docker/test_distribute.py", "tests/docker/test_containerd_head.py")
GROUPS = {"tests/docker/test_git_source.py": "engine-git", "tests/docker/test_wheel_builds.py": "engine-wheels"}


def _engine_group(item) -> str:
    path = item.path.relative_to(ROOT).as_posix()
    if path.startswith(HOSTS_GROUP):
        return "engine-hosts"
    return GROUPS.get(path, "engine-builds")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns xdist_group markers into test IDs
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = next((t for t in TIERS if item.get_closest_marker(t)), "unit")
        item.user_properties.append(("tier", tier))  # reports carry it to the summary, also from xdist workers
        if tier in ENGINE_TIERS:
            item.add_marker(pytest.mark.xdist_group(_engine_group(item)))
        for name, missing in NEEDS.items():
            if item.get_closest_marker(name) is None:
                continue
            reason = missing()
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"{name}: {reason}"))
                break


# ------------------------------------------------------------------ fixtures every tier shares

@pytest.fixture
def cli():
    """Run `python build.py ARGS...` as a user would, and return the completed process."""

    def run(*args: str, cwd: Path = ROOT, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = run_cli(*args, cwd=cwd, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"build.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run


@pytest.fixture(scope="session")
def base_image() -> str:
    """The local Debian base; made by scripts/base-local.sh (debootstrap, root) when it is missing, by one
    worker while the others wait."""
    with one_at_a_time("base-local"):
        if image_id(BASE):
            return BASE
        if os.geteuid() != 0 or shutil.which("debootstrap") is None:
            pytest.skip(f"{BASE} is missing, and making it needs root and debootstrap: run `sudo make base-local` once")
        subprocess.run(["bash", str(ROOT / "scripts" / "base-local.sh"), BASE], check=True, timeout=1800)
    return BASE


@pytest.fixture(scope="session")
def torch_base(base_image: str, tmp_path_factory) -> str:
    """The local base with a real CPU torch and numpy (tests/support/gitsource.py), made once."""
    from tests.support.gitsource import Unavailable, ensure_torch_base

    try:
        with one_at_a_time("torch-base"):
            return ensure_torch_base(base_image, tmp_path_factory.mktemp("torch-base"))
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def git_setup(torch_base: str, tmp_path_factory):
    """The git-source setup (tests/support/gitsource.py), shared by the git-source and wheel tests, so
    that the wheel tests find the compile of the same source in BuildKit's cache."""
    from tests.support.gitsource import GitSource

    setup = GitSource(tmp_path_factory.mktemp("gitsrc"))
    yield setup
    setup.stop()


@pytest.fixture(scope="session")
def test_image(base_image: str) -> BuiltImage:
    """The test variant (real vLLM 0.17.0 wheel, real install-phase mods), built once per session."""
    return built("testvllm", base_image)


@pytest.fixture(scope="session")
def small_image(base_image: str) -> BuiltImage:
    """The small test variant (vLLM 0.2.7 wheel, a test patch mod), built once per session: what the
    distribution tests move between engines, a quarter of the test variant's 436 MB. 0.2.7 has no `vllm`
    command, which the static smoke tier asks for, so it is built with --no-smoke."""
    return built("testsmall", base_image, TEST_MODS, "--no-smoke")


# ------------------------------------------------------------------ time per tier, at the end of a run

_tier_time: dict[str, list[float]] = {}


def pytest_runtest_logreport(report):
    entry = _tier_time.setdefault(dict(report.user_properties).get("tier", "unit"), [0, 0.0])
    entry[0] += report.when == "call"
    entry[1] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _tier_time:
        return
    parts = [f"{tier} {n} tests {seconds:.0f}s" for tier, (n, seconds) in sorted(_tier_time.items())]
    terminalreporter.write_line("time per tier (sum of test times): " + ", ".join(parts))
