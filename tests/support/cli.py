"""The real command line, run as a user runs it, and the check of a one-line error.

Each run is its own process. Most are forked from tests/support/forkserver.py, which has the package
imported already (0.4 s saved per run); a run whose environment differs in what Python or the consoles
read when they start (PYTHON*, LC_*, LANG, the terminal's size and colours) starts `python build.py`
afresh, as does a second run at the same time.
"""

from __future__ import annotations

import atexit
import locale
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.support.forkserver import receive, send
from tests.support.paths import ROOT

BUILD = ROOT / "build.py"
# Read once, when the interpreter or a rich Console starts: a child forked later would not see a change.
_AT_START = ("LANG", "COLUMNS", "LINES", "JUPYTER_COLUMNS", "JUPYTER_LINES", "NO_COLOR", "FORCE_COLOR",
             "TTY_COMPATIBLE", "TTY_INTERACTIVE", "TERM", "COLORTERM")


# The environment of the test process before any test changed it: the fork server starts with it.
_ENV = dict(os.environ)


def _read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in _AT_START or k.startswith(("PYTHON", "LC_"))}


class _ForkServer:
    def __init__(self) -> None:
        self.owner = os.getpid()
        self.env = _ENV
        self.lock = threading.Lock()
        self.folder = tempfile.TemporaryDirectory(prefix="sparkforge-cli-")
        self.outputs = Path(self.folder.name) / "stdout", Path(self.folder.name) / "stderr"
        for path in self.outputs:
            path.touch()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "forkserver.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=self.env)

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a run in env may be forked from here: what is read at start is the same."""
        return _read_at_start(env) == _read_at_start(self.env)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None  # started with stdin=PIPE
        send(self.proc.stdin.fileno(), {"argv": argv, "env": env, "cwd": str(cwd), "timeout": timeout,
                                        "stdout": str(self.outputs[0]), "stderr": str(self.outputs[1])})
        reply = self._reply(timeout + 60)
        stdout, stderr = (_text(path.read_bytes()) for path in self.outputs)
        command = [sys.executable, str(BUILD), *argv]
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(reply["status"]), stdout, stderr)

    def _reply(self, limit: float) -> dict[str, Any]:
        assert self.proc.stdout is not None  # started with stdout=PIPE
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], limit)
        reply = receive(fd) if ready else None
        if reply is None:  # the server died or hangs: no later run may use it
            self.proc.kill()
            raise RuntimeError(f"the fork server gave no answer within {limit:.0f} s (exit {self.proc.wait()})")
        return reply

    def close(self) -> None:
        if os.getpid() == self.owner:
            assert self.proc.stdin is not None  # started with stdin=PIPE
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.folder.cleanup()


def _text(data: bytes) -> str:
    # As subprocess.run(text=True) decodes: the locale's encoding, universal newlines.
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


_server: _ForkServer | None = None
_starting = threading.Lock()


def _fork_server() -> _ForkServer:
    global _server
    with _starting:
        if _server is None or _server.owner != os.getpid() or _server.proc.poll() is not None:
            _server = _ForkServer()
            atexit.register(_server.close)
        return _server


def run_cli(*args: str, images: Path | None = None, mods: Path | None = None, cwd: Path = ROOT,
            env: dict[str, str] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """`python build.py [--images I] [--mods M] ARGS...`; env is added to this process's environment."""
    argv = [*(["--images", str(images)] if images is not None else []),
            *(["--mods", str(mods)] if mods is not None else []), *args]
    environ = {**os.environ, **(env or {})}
    server = _fork_server()
    if server.takes(environ) and Path(cwd).is_dir() and server.lock.acquire(blocking=False):
        try:
            return server.run(argv, environ, cwd, timeout)
        finally:
            server.lock.release()
    return subprocess.run([sys.executable, str(BUILD), *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=environ)


def assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str, code: int = 2,
                    progress: tuple[str, ...] = ()) -> str:
    """The command failed with exactly one line on stderr, `error: ...` naming every needle, and no traceback;
    the line. Besides it, stderr may hold only lines that start with one of the progress prefixes (or say how a
    download goes), and right above
    it the lines the error shows of its cause (`  | `: a failed build step's last output)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}:\n{proc.stdout}{proc.stderr}"
    lines = [line for line in proc.stderr.splitlines() if not line.startswith((*progress, "  downloading "))]
    while len(lines) > 1 and lines[-2].startswith("  | "):
        del lines[-2]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]
