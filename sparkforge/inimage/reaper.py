"""Run a function in a worker process and leave nothing of it behind: every process it started is
killed when it ends, whatever session or process group that process moved to.

The calling process becomes a child subreaper (Linux's PR_SET_CHILD_SUBREAPER, through ctypes), so
an orphan below it (a daemon that forked twice, a `sleep &` of a shell that has exited) is given to
it rather than to init, and can still be found among its children and killed. Where that cannot be
set (no ctypes, not Linux), the caller's process group is all that is left to kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def reaped(work: Callable[[], int], grace: float) -> int:
    """Run work() in a forked worker and return its exit code (or die by its signal); once it has
    ended, or this process is told to stop (SIGTERM), kill and reap everything below this process,
    giving up after grace seconds."""
    adopt_orphans()
    worker = os.fork()
    if worker == 0:
        code = 1
        try:
            code = work()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    status: int | None = None
    while status is None and not stop:
        pid, code = os.waitpid(worker, os.WNOHANG)
        if pid:
            status = code
        else:
            time.sleep(0.02)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_children(time.monotonic() + grace)
    if status is None:
        return 1
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status)


def adopt_orphans() -> bool:
    """Make this process the one that orphans below it are given to; False where that cannot be set."""
    try:
        import ctypes

        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (ImportError, OSError, AttributeError):
        return False


def children(parent: int) -> list[int]:
    """The processes whose parent is parent, from /proc (none where there is no /proc)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    fields = fh.read().rpartition(b")")[2].split()  # the name before ")" may hold anything
            except OSError:
                continue
            if len(fields) > 1 and fields[1] == str(parent).encode():
                found.append(int(entry))
    return found


def end_children(deadline: float) -> None:
    """Kill every child of this process, round after round (a subreaper inherits the children of each
    one killed), and reap them, until none is left or deadline passes."""
    me = os.getpid()
    while True:
        for pid in children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child left
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)
