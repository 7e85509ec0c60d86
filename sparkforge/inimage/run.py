"""The one way the image side runs a command: with its input closed, its output captured, and a time
limit, past which the command and every process of its session are killed and TimeLimit says so in one
line. (A patcher's child has its own runner, patcher.py, since it talks with it both ways.)"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

# The limits of the image's commands, in seconds. Each is far above what its command takes on a loaded
# machine; it is there so that a command that never ends fails the build or the check, naming it.
IMPORT_TIMEOUT = 300.0  # `import torch` to read its CUDA build (seconds where the disk is cold)
CUDA_TIMEOUT = 300.0  # torch's first CUDA call in the gpu tier: the driver loads and may JIT the PTX
VERIFY_TIMEOUT = 600.0  # a mod's python check, which may import vllm and with it torch and its extensions


class TimeLimit(Exception):
    """A command ran past its time limit and was stopped; the message says which, in one line."""


def run(cmd: list[str], *, limit: float, what: str, cwd: str | Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """cmd run to its end, or TimeLimit once it has run for limit seconds. It runs in a session of its
    own, so that what it started goes with it and no process left holding its output keeps this waiting."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise TimeLimit(f"{what} did not finish within {limit:g} s; stopped") from None
    except BaseException:  # Ctrl-C, or SIGTERM made an exception: the command does not outlive its caller
        _kill(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command's session (its process group) and reap the command; its pipes are closed, not
    read to their end, which a process that left the group could hold open."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    try:
        proc.wait(timeout=5)  # killed, it ends at once, unless the kernel holds it in a read of a dead disk
    except subprocess.TimeoutExpired:
        pass


def text(data: bytes) -> str:
    """A command's output as text (bytes that are not UTF-8 shown as replacement characters)."""
    return data.decode("utf-8", "replace")
