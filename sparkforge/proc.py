"""The one way the host runs a command to its end: no shell, a time limit, no child left behind.

The command starts in a process group of its own, so that what it starts in turn (git's remote
helper, ssh's proxy, docker's plugins) is stopped with it: on the time limit, on Ctrl-C and on
SIGTERM (which the CLI turns into SystemExit), the whole group gets SIGTERM and, after a short grace,
SIGKILL, and is reaped before the exception goes on. A command that cannot run, or runs past its
limit, is one CommandError whose message names the command. Stdlib only.

Long streaming children (a build, `docker save | docker load`) are not run here: they are tracked
by build/dockercli.py and stopped with the CLI, and each has its own bound where it is started.
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


class CommandError(Exception):
    """A command could not run to its end: it is missing, could not start, or ran past its time limit."""

    def __init__(self, command: str, why: str):
        super().__init__(f"{command}: {why}")
        self.command = command
        self.why = why


class TimedOut(CommandError):
    """The command ran past its time limit and was stopped with everything it started."""

    def __init__(self, command: str, timeout: float):
        super().__init__(command, f"gave no answer within {timeout:.0f} s and was stopped")
        self.timeout = timeout


def name(argv: Sequence[str], words: int = 2) -> str:
    """How an error names a command: its program and first words (`git fetch`), never its whole line."""
    return " ".join(os.path.basename(str(argv[0])) if i == 0 else str(a) for i, a in enumerate(argv[:words]))


def stop_group(proc: subprocess.Popen[Any], grace: float = GRACE) -> None:
    """SIGTERM to the child's process group, SIGKILL to what is left of it after `grace` seconds (the
    leader may be gone while what it started is not); the child is reaped and its pipes closed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # no member left (PermissionError: a zombie, on some kernels)
            pass
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@contextmanager
def held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait while the body runs, and are raised as it ends. A child is started inside
    it: between the fork and Popen's return nothing knows the child yet, so a signal there would leave it
    running. Only the main thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before: dict[int, Any] = {}
    for wanted in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(wanted)):  # the default action and SIG_IGN are left as they are
            before[wanted] = signal.signal(wanted, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
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
    """Run argv (never through a shell) to its end within `timeout` seconds and return it, whatever its
    exit code. `what` names it in errors (default: its program and first argument). Other keywords go
    to Popen (stdin, stdout, stderr, env, cwd). Raises CommandError, or TimedOut."""
    what = what or name(argv)
    if capture_output:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    proc: subprocess.Popen[Any] | None = None
    try:
        with held():  # a signal that comes while the child starts is raised once `proc` names it
            proc = subprocess.Popen(list(argv), start_new_session=True, text=text, **kw)
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        assert proc is not None
        stop_group(proc)
        raise TimedOut(what, timeout) from None
    except BaseException as exc:  # Ctrl-C, SIGTERM's SystemExit: nothing of it is left running
        if proc is not None:
            stop_group(proc)
            raise
        if isinstance(exc, FileNotFoundError):
            raise CommandError(what, f"{argv[0]} is not installed") from None
        if isinstance(exc, OSError):
            raise CommandError(what, f"cannot start {argv[0]}: {exc.strerror or exc}") from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
