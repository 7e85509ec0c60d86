"""A process that has imported the command line once and forks a child for each run of it.

Starting `python build.py` costs about 0.4 s of imports (pydantic, typer, rich, jinja2), and the tests
run the command line a few hundred times. A child forked from here starts with those modules loaded and
nothing else done: it takes the run's argv, environment, working folder and stdio, then runs build.py
as `__main__` and ends as the interpreter would (exit code, uncaught traceback, atexit, thread joins).

Protocol, one message each way per run on this process's stdin and stdout, each a JSON object after its
length (ten decimal digits): request {"argv", "env", "cwd", "stdout", "stderr", "timeout"} (stdout and
stderr are file paths), reply {"status": wait status} or {"timeout": true} once the child was killed.
End of input ends this process.
`tests/support/cli.py` starts one per test process and decides which runs may come here.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build.py")


def _preload() -> None:
    # What build.py imports, and what --help imports on demand. A module that fails to import here is
    # imported again by the child, which then fails as `python build.py` would.
    sys.path[0] = ROOT
    for name in ("sparkforge.build.dockercli", "sparkforge.cli", "typer.rich_utils"):
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - the child shows it
            pass
    # What is loaded now stays out of the collector's reach: a child's collections and its exit then
    # leave these pages shared instead of copying them all (0.11 s less per run).
    gc.freeze()


def _become(request: dict[str, Any], channels: tuple[int, int]) -> None:
    """In the child: this run's stdio, environment, folder and argv."""
    for fd in channels:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [BUILD, *request["argv"]]
    sys.path[0] = ROOT


def _wait(pid: int, timeout: float) -> dict[str, Any]:
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    return {"timeout": True} if not ready else {"status": status}


def serve() -> None:
    # Ctrl-C on the test run reaches the run going on (same process group), not this server, which
    # ends when its test process closes the channel.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The channel moves off fds 0 and 1, which each child takes over for its own stdio.
    channels = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    while (request := receive(channels[0])) is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(request, channels)
            runpy.run_path(BUILD, run_name="__main__")
            return  # the child ends here like a script that ran to its end: exit 0
        send(channels[1], _wait(pid, request["timeout"]))


def send(fd: int, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    data = memoryview(b"%010d" % len(body) + body)
    while data:
        data = data[os.write(fd, data):]


def receive(fd: int) -> dict[str, Any] | None:
    """The next message on fd; None when the other end closed it, also in the middle of one."""
    head = _read_exactly(fd, 10)
    return None if head is None else json.loads(_read_exactly(fd, int(head)) or b"null")


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


if __name__ == "__main__":
    _preload()
    serve()
