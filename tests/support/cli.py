"""The real command line, run as a user runs it, and the check of a one-line error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT


def run_cli(*args: str, images: Path | None = None, mods: Path | None = None, cwd: Path = ROOT,
            env: dict[str, str] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`python build.py [--images I] [--mods M] ARGS...`; env is added to this process's environment."""
    argv = [sys.executable, str(ROOT / "build.py")]
    if images is not None:
        argv += ["--images", str(images)]
    if mods is not None:
        argv += ["--mods", str(mods)]
    return subprocess.run([*argv, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str, code: int | None = 2) -> str:
    """The command failed with exactly one line on stderr, no traceback, naming every needle; the line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    if code is None:
        assert proc.returncode != 0, proc.stdout + proc.stderr
    else:
        assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}:\n{proc.stdout}{proc.stderr}"
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]
