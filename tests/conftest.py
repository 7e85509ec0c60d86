"""Shared fixtures: the project root and a runner for the real command line; and a check, around the
whole run, that the tests left the machine's apt, system Python and Docker settings as they were."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import hoststate  # noqa: E402 - the tests folder is not a package

_before: dict[str, str] = {}


def pytest_sessionstart(session):
    _before.update(hoststate.snapshot())
    # Builds run by the tests keep their compiled wheels in a wheel cache of their own, never the user's.
    import os
    import tempfile

    os.environ["SPARKFORGE_WHEEL_CACHE"] = tempfile.mkdtemp(prefix="sparkforge-test-wheels-")


def pytest_sessionfinish(session, exitstatus):
    import os
    import shutil

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


@pytest.fixture
def cli():
    """Run `python build.py ARGS...` as a user would, and return the completed process."""

    def run(*args: str, cwd: Path = ROOT, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"build.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run
