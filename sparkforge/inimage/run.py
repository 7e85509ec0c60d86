"""How the image side runs a command to its end: proc.run with its input closed, its output captured, a time limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from . import proc
from .paths import last_line

# The limits of the image's commands, in seconds. Each is far above what its command takes on a loaded
# machine; it is there so that a command that never ends fails the build or the check, naming it.
IMPORT_TIMEOUT = 300.0  # `import torch` to read its CUDA build (seconds where the disk is cold)
CUDA_TIMEOUT = 300.0  # torch's first CUDA call in the gpu tier: the driver loads and may JIT the PTX
VERIFY_TIMEOUT = 600.0  # a mod's python check, which may import vllm and with it torch and its extensions


class TimeLimit(Exception):
    """A command ran past its time limit and was stopped; the message says which, in one line."""


def run(cmd: list[str], *, limit: float, what: str, cwd: str | Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """cmd run to its end, or TimeLimit once it has run limit seconds (stopped with all it started)."""
    try:
        return proc.run(cmd, timeout=limit, what=what, stdin=subprocess.DEVNULL, capture_output=True, cwd=cwd,
                        env=env)
    except proc.TimedOut:
        raise TimeLimit(f"{what} did not finish within {limit:g} s; stopped") from None
    except proc.CommandError as exc:
        raise OSError(exc.why) from None


def python(code: str, *, limit: float, what: str, cwd: Path | None = None) -> tuple[bool, str, str]:
    """`python -c code` run to its end: (it exited 0, its output, the last line of its errors or of TimeLimit)."""
    try:
        done = run([sys.executable, "-c", code], limit=limit, what=what, cwd=cwd)
    except TimeLimit as exc:
        return False, "", str(exc)
    out, err = (data.decode("utf-8", "replace") for data in (done.stdout, done.stderr))  # not UTF-8: replacement characters
    return done.returncode == 0, out, last_line(err)
