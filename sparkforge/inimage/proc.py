"""The one way sparkforge starts a process, on the host and in the image: no shell, a process group of its own,
and nothing of it left running.

start() makes every child, in a process group of its own so that what it starts in turn (git's remote helper,
ssh's proxy, a patcher's workers) is stopped with it; a Ctrl-C or SIGTERM landing while it starts waits until the
child has a name (held). run() takes a command to its end within a time limit: on the limit, Ctrl-C or SIGTERM
the group gets SIGTERM, then SIGKILL, and is reaped before the exception goes on. Long streaming children are
started here too and stopped by signal_group (build/dockercli.py tracks them). Stdlib only: the image side
imports it, and gitfetch.py runs beside a copy of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, overload

GRACE = 2.0  # seconds between SIGTERM and SIGKILL: git removes its lock files on SIGTERM
# The signals that stop sparkforge: Ctrl-C, SIGTERM, and SIGHUP (the terminal or the ssh session went away).
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class CommandError(Exception):
    """A command could not run to its end: it is missing, could not start, or ran past its time limit."""

    def __init__(self, command: str, why: str):
        super().__init__(f"{command}: {why}")
        self.why = why


class TimedOut(CommandError):
    """The command ran past its time limit and was stopped with everything it started."""

    def __init__(self, command: str, timeout: float):
        super().__init__(command, f"gave no answer within {timeout:.0f} s and was stopped")


Child = subprocess.Popen  # what start() gives: a child in its own process group


def start(argv: Sequence[str], **kw: Any) -> Child[Any]:
    """Start argv (never through a shell) in a process group of its own; keywords go to Popen, and OSError
    comes as from Popen. A Ctrl-C or SIGTERM that lands while it starts stops the child's group and goes on as it ends."""
    child: Child[Any] | None = None
    try:
        with held():  # a signal that comes while the child starts is raised once `child` names it
            child = subprocess.Popen(list(argv), start_new_session=True, **kw)
    except BaseException:
        if child is not None:
            stop_group(child)
        raise
    return child


def signal_group(proc: Child[Any], grace: float = GRACE) -> None:
    """SIGTERM to the child's group, SIGKILL to what is left after `grace` seconds; the child is reaped, its pipes
    left open (another thread may still read them). A child already reaped is left alone: its number may be
    another process's by now."""
    if proc.returncode is not None:
        return
    # Killed, it ends at once, unless the kernel holds it in a read of a dead disk.
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace + 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # no member left (PermissionError: a zombie, on some kernels)
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def stop_group(proc: Child[Any], grace: float = GRACE) -> None:
    """signal_group, then the child's pipes closed."""
    signal_group(proc, grace)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@contextmanager
def held() -> Iterator[None]:
    """The signals that stop sparkforge (STOPPING, where Python handles them) wait while the body runs and are
    raised as it ends: between the fork and Popen's return nothing knows the child, so a signal there would leave
    it running. Only the main thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before: dict[int, Any] = {}
    for wanted in STOPPING:
        if callable(signal.getsignal(wanted)):  # the default action and SIG_IGN are left as they are
            before[wanted] = signal.signal(wanted, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        # Blocked while the handlers go back: one landing between two of them would be raised with the others
        # still recording, and every later one lost.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, before)
        try:
            for number, handler in before.items():
                signal.signal(number, handler)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for number in came:
            signal.raise_signal(number)  # its handler runs here: KeyboardInterrupt, or the CLI's SystemExit


# The output is bytes, or str with text=True.
@overload
def run(argv: Sequence[str], *, timeout: float, what: str | None = None, input: bytes | str | None = None,
        capture_output: bool = False, text: Literal[False] = False,
        **kw: Any) -> subprocess.CompletedProcess[bytes]: ...
@overload
def run(argv: Sequence[str], *, timeout: float, what: str | None = None, input: bytes | str | None = None,
        capture_output: bool = False, text: Literal[True], **kw: Any) -> subprocess.CompletedProcess[str]: ...
@overload
def run(argv: Sequence[str], *, timeout: float, what: str | None = None, input: bytes | str | None = None,
        capture_output: bool = False, text: bool, **kw: Any) -> subprocess.CompletedProcess[Any]: ...
def run(argv: Sequence[str], *, timeout: float, what: str | None = None, input: bytes | str | None = None,
        capture_output: bool = False, text: bool = False, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """Run argv (no shell) to its end within `timeout` seconds, whatever its exit code; else CommandError/TimedOut."""
    # An error names a command by its program and first word (`git fetch`), never by its whole line.
    what = what or " ".join([os.path.basename(str(argv[0])), *map(str, argv[1:2])])
    if capture_output:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    proc: Child[Any] | None = None
    try:
        with held():  # a signal as the child starts is raised once `proc` names it, inside this try
            proc = start(argv, text=text, **kw)
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException as exc:  # its time limit, Ctrl-C, SIGTERM's SystemExit: nothing of it is left running
        if proc is not None:
            stop_group(proc)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise TimedOut(what, timeout) from None
            raise
        if isinstance(exc, FileNotFoundError):
            raise CommandError(what, f"{argv[0]} is not installed") from None
        if isinstance(exc, OSError):
            raise CommandError(what, f"cannot start {argv[0]}: {exc.strerror or exc}") from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
