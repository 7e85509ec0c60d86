"""The tests' command-line runner: a run forked from the server gives what a fresh `python build.py` gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cli
from tests.support.paths import ROOT

CASES = {
    "help": ("--help",),
    "list": ("list",),
    "unknown variant": ("show", "nope"),
    "usage error": ("show",),
    "show with a flag": ("show", "ng17", "--json"),
}


def fresh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_a_forked_run_is_a_fresh_run(args: tuple[str, ...]) -> None:
    forked, started = cli.run_cli(*args), fresh(*args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (started.returncode, started.stdout, started.stderr)


def test_the_run_gets_its_own_folder_and_environment(tmp_path: Path) -> None:
    """A relative output folder is the working folder's; the wheel cache is the environment's."""
    proc = cli.run_cli("render", "ng17", "-o", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "Dockerfile").is_file()
    proc = cli.run_cli("wheels", "list", env={"SPARKFORGE_WHEEL_CACHE": str(tmp_path / "wheels")})
    assert proc.returncode == 0 and f"{tmp_path / 'wheels'} is empty" in proc.stdout, proc.stdout + proc.stderr


def test_a_run_past_its_time_is_killed_and_raises() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        cli.run_cli("list", timeout=0.001)
    assert cli.run_cli("list").returncode == 0  # the server serves the next run


def test_an_environment_read_at_start_gets_a_fresh_process(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "33")
    assert not cli._fork_server().takes(dict(os.environ))
    assert cli.run_cli("list").returncode == 0
