"""The table of needs and the tiers a run must cover: a run that must cover a tier fails, naming the test and
the need, where a test of that tier would skip; a skip from outside the table fails any run; elsewhere a
missing need is a skip that says why.

The run-level tests run pytest itself, with tests/conftest.py as its plugin, on test files of their own,
against an engine that is not there (DOCKER_HOST naming a socket nobody listens on).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import needs
from tests.support.limits import ended
from tests.support.paths import ROOT
from tests.support.wedged import wedged

ALL_BUT_GPU = frozenset({"unit", "network", "docker", "root", "cluster"})


@pytest.mark.parametrize("environ, tiers", [
    ({}, frozenset()),
    ({"CI": "true"}, ALL_BUT_GPU),
    ({"CI": "false"}, frozenset()),
    ({"SPARKFORGE_REQUIRED_TIERS": "docker, unit"}, frozenset({"docker", "unit"})),
    ({"SPARKFORGE_REQUIRED_TIERS": "all"}, ALL_BUT_GPU | {"gpu"}),
    ({"SPARKFORGE_REQUIRED_TIERS": "", "CI": "true"}, frozenset()),  # said outright: none
])
def test_the_required_tiers_come_from_the_environment(environ: dict[str, str], tiers: frozenset[str]) -> None:
    assert needs.Required.of(environ).tiers == tiers


def test_a_required_tier_that_is_no_tier_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as err:
        needs.Required.of({"SPARKFORGE_REQUIRED_TIERS": "unit,dokcer"})
    assert str(err.value) == ("SPARKFORGE_REQUIRED_TIERS: 'dokcer' is no tier; the tiers are unit, network, docker, "
                              "root, cluster, gpu (or all)")


def test_a_skip_fails_only_where_its_tier_is_required_or_it_names_no_need() -> None:
    required = needs.Required.of({"CI": "true"})
    assert required.problem("gpu", "gpu: no NVIDIA GPU on this host") is None
    assert required.problem("docker", "docker: the Docker engine is wedged") == (
        "the docker tier must run here (CI=true: every tier but gpu), but a need is missing: docker: the Docker "
        "engine is wedged")
    assert needs.Required.of({}).problem("docker", "docker: the Docker engine is wedged") is None
    for run in (required, needs.Required.of({})):
        assert run.problem("gpu", "nothing to do here") == (
            "skipped outside the table of needs (tests/support/needs.py): nothing to do here")
        assert run.problem("unit", "gpus: looks like a need") is not None


def test_the_driver_s_cuda_version_is_read_from_nvidia_smi() -> None:
    header = "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0     |"
    assert needs.driver_cuda(header) == (13, 0)
    assert needs.driver_cuda("| NVIDIA-SMI 550.54   Driver Version: 550.54   CUDA Version: 12.4 |") < needs.CUDA_DRIVER
    assert needs.driver_cuda("no header") is None


@pytest.mark.needs("docker-cli")
def test_a_wedged_engine_is_a_missing_need_after_the_limit(tmp_path: Path, monkeypatch) -> None:
    with wedged(tmp_path / "wedged.sock") as engine:
        monkeypatch.setenv("DOCKER_HOST", engine.host)
        problem, seconds = ended(lambda: needs.docker_problem(limit=2))
    assert problem == "the Docker engine is wedged: `docker info` did not answer within 2 s"
    assert seconds >= 2


@pytest.mark.needs("docker-cli")
def test_an_engine_that_is_not_there_is_a_missing_need(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")
    problem = needs.docker_problem()
    assert problem is not None and problem.startswith("the Docker engine does not answer: "), problem
    assert f"{tmp_path}/docker.sock" in problem


# ------------------------------------------------------------------ whole runs of pytest

TESTS = '''
import pytest

from tests.support.needs import require


@pytest.fixture(scope="session")
def on_a_gpu():
    require("gpu")


@pytest.mark.docker
def test_on_the_engine():
    pass


@pytest.mark.gpu
def test_on_the_gpu():
    pass


def test_with_a_fixture_that_needs_a_gpu(on_a_gpu):
    pass


def test_plain():
    pass
'''
OUTSIDE = '''
import pytest


def test_that_skips_on_its_own():
    pytest.skip("no reason from the table")
'''


def pytest_run(tmp_path: Path, *args: str, **env: str) -> tuple[int, str]:
    """pytest with tests/conftest.py as its plugin on tmp_path's test files, the engine out of reach, and a
    PATH that holds only the docker CLI (so no nvidia-smi either, whatever this host has)."""
    if not (tmp_path / "test_tiers.py").exists():
        (tmp_path / "test_tiers.py").write_text(TESTS)
        (tmp_path / "test_outside.py").write_text(OUTSIDE)
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "docker").symlink_to(shutil.which("docker") or "/nonexistent")
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("PYTEST_") and k not in ("CI", "SPARKFORGE_REQUIRED_TIERS", "DOCKER_CONTEXT",
                                                           "SPARKFORGE_TESTS_RUN", "SPARKFORGE_TESTS_OWNER")}
    environ.update(env, PYTHONPATH=str(ROOT), PATH=str(tmp_path / "bin"), COLUMNS="300",
                   DOCKER_HOST=f"unix://{tmp_path}/no-engine.sock")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-rA", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), *args], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=900)  # a guard against a hang, not a measure
    return proc.returncode, proc.stdout + proc.stderr


def outcomes(output: str) -> dict[str, str]:
    """test name -> the line pytest's summary (-rA) gives it: PASSED, SKIPPED with the reason, FAILED or (at setup)
    ERROR with the message."""
    found = {}
    for line in output.splitlines():
        if m := re.match(r"(PASSED|FAILED|ERROR) \S+::(\w+)(?: - Failed: (.*))?$", line):
            found[m.group(2)] = f"{m.group(1)} {m.group(3) or ''}".strip()
        elif m := re.match(r"SKIPPED \[1\] test_tiers.py:(\d+): (.*)$", line):
            found[_test_at(int(m.group(1)))] = f"SKIPPED {m.group(2)}"
    return found


def _test_at(line: int) -> str:
    """The test of TESTS that starts at a line (its first decorator's, as pytest reports a skip)."""
    return next(text[4:].split("(")[0] for text in TESTS.splitlines()[line - 1:] if text.startswith("def test_"))


@pytest.mark.needs("docker-cli")
def test_a_developer_run_skips_with_the_reason_and_fails_only_a_skip_outside_the_table(tmp_path: Path) -> None:
    code, output = pytest_run(tmp_path)
    assert code == 1, output
    assert "tiers that must run: none" in output
    found = outcomes(output)
    assert found["test_plain"] == "PASSED"
    assert found["test_that_skips_on_its_own"] == (
        "FAILED skipped outside the table of needs (tests/support/needs.py): no reason from the table")
    assert found["test_on_the_engine"].startswith("SKIPPED docker: the Docker engine does not answer: "), output
    assert found["test_on_the_gpu"] == "SKIPPED gpu: no NVIDIA GPU on this host (nvidia-smi not found)"
    assert found["test_with_a_fixture_that_needs_a_gpu"] == found["test_on_the_gpu"]
    assert "1 failed, 1 passed, 3 skipped" in output


@pytest.mark.needs("docker-cli")
@pytest.mark.parametrize("env, source", [
    ({"CI": "true"}, "CI=true: every tier but gpu"),
    ({"SPARKFORGE_REQUIRED_TIERS": "unit,docker"}, "SPARKFORGE_REQUIRED_TIERS=unit,docker"),
], ids=["CI", "named"])
def test_a_run_that_must_cover_a_tier_fails_each_test_of_it_that_would_skip(tmp_path: Path, env: dict[str, str],
                                                                            source: str) -> None:
    code, output = pytest_run(tmp_path, "-n", "2", **env)  # as `make test` runs: the reports come from workers
    assert code == 1, output
    found = outcomes(output)
    assert found["test_plain"] == "PASSED"
    assert found["test_on_the_engine"].startswith(
        f"ERROR the docker tier must run here ({source}), but a need is missing: docker: the Docker engine does not "
        f"answer: "), output
    assert found["test_with_a_fixture_that_needs_a_gpu"] == (
        f"ERROR the unit tier must run here ({source}), but a need is missing: gpu: no NVIDIA GPU on this host "
        "(nvidia-smi not found)")
    assert found["test_on_the_gpu"] == "SKIPPED gpu: no NVIDIA GPU on this host (nvidia-smi not found)"
    assert re.search(r"^1 tests of the docker tier could not run: the docker tier must run here", output, re.M), output
    assert re.search(r"^1 tests of the unit tier could not run: the unit tier must run here .*: gpu: ", output,
                     re.M), output
    assert found["test_that_skips_on_its_own"].startswith("FAILED skipped outside the table of needs")
    assert "1 failed, 1 passed, 1 skipped, 2 errors" in output


def test_a_required_tier_that_is_no_tier_stops_the_run_before_any_test(tmp_path: Path) -> None:
    code, output = pytest_run(tmp_path, SPARKFORGE_REQUIRED_TIERS="dokcer")
    assert code == pytest.ExitCode.USAGE_ERROR, output
    assert "SPARKFORGE_REQUIRED_TIERS: 'dokcer' is no tier" in output
    assert "passed" not in output
