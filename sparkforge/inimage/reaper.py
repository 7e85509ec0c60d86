"""Run a function in a worker process and leave nothing of it behind, whatever session or group it moved to.

The caller becomes a child subreaper (Linux's PR_SET_CHILD_SUBREAPER, through ctypes), so an orphan below it (a
daemon that forked twice) is given to it rather than to init, and can still be found and killed. Where that
cannot be set, the caller's process group is all that is left to kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def reaped(work: Callable[[], int], grace: float) -> int:
    """Run work() in a forked worker and return its exit code (or die by its signal); once it has ended, or on
    SIGTERM, kill and reap everything below this process, giving up after grace seconds."""
    try:  # orphans below this process are given to it (where this cannot be set, its group is all there is to kill)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass
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
    """Kill and reap every child of this process, round after round (a subreaper inherits theirs), until deadline."""
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
