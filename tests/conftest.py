"""Shared fixtures: the project root and a runner for the real command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
