"""The Docker CLI as sparkforge runs it: a time limit on every call, one-line errors, no orphans.

A call that runs to its end goes through proc.run (its own process group, stopped on the limit and on
Ctrl-C).

Every call names what it was doing, so a wedged or missing engine becomes one line instead of a hang
or a traceback. A local engine is pinged first, once per process, with a short limit (QUICK): a dead
or wedged one is said within seconds. A question to an engine that answered gets a longer limit (ASK):
a containerd-store engine busy exporting or unpacking a large image answers `docker image inspect`
slowly. Long-running children (a build, a `docker save`) are tracked so that Ctrl-C or SIGTERM stops
them with the CLI.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal, NoReturn, overload

from .. import proc
from ..errors import SparkforgeError
from ..files import read_regular
from ..inimage.contract import parse_json

QUICK = 10.0    # seconds: whether the engine answers at all (a ping, `docker info`)
ASK = 120.0     # seconds: calls that read or change the image store (inspect, tag, rm) of a live engine
LONG = 1800.0   # seconds: calls that move data (run a container, save, load, push, pull)
EXIT_GRACE = 60.0  # seconds a streaming child may take to exit once its output has ended

_children: set[subprocess.Popen[Any]] = set()
_lock = threading.Lock()


class EngineError(SparkforgeError):
    """The Docker engine is missing, does not answer in time, or refused a call."""

    exit_code = 1


def _env(host: str | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `env` (default: ours), pointed at `host` when one is given."""
    env = dict(os.environ if env is None else env)
    if host:
        env["DOCKER_HOST"] = host
    return env


def last_line(text: str | bytes | None, fallback: str) -> str:
    """The last non-blank line of a child's output, or fallback."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else fallback


# The output is str, or bytes with text=False.
@overload
def run(args: Sequence[str], *, what: str | None = None, timeout: float = ASK, host: str | None = None,
        check: bool = True, text: Literal[True] = True, **kw: Any) -> subprocess.CompletedProcess[str]: ...
@overload
def run(args: Sequence[str], *, what: str | None = None, timeout: float = ASK, host: str | None = None,
        check: bool = True, text: Literal[False], **kw: Any) -> subprocess.CompletedProcess[bytes]: ...
def run(args: Sequence[str], *, what: str | None = None, timeout: float = ASK, host: str | None = None,
        check: bool = True, text: bool = True, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """Run `docker ARGS` through proc.run and return it; raise EngineError on a timeout, a missing CLI or
    (with check) a failure."""
    what = what or "docker " + " ".join(args[:2])
    if shutil.which("docker") is None:
        raise EngineError("the docker CLI is not installed", field=what)
    if timeout > QUICK and kw.get("env") is None:
        _require_alive(host)
    kw.setdefault("capture_output", "stdin" not in kw and "stdout" not in kw)
    try:
        done = proc.run(["docker", *args], what=what, env=_env(host, kw.pop("env", None)), timeout=timeout,
                        text=text, **kw)
    except proc.TimedOut:
        raise EngineError(f"no answer within {timeout:.0f} s (is the Docker engine wedged or "
                          "unreachable?)", field=what) from None
    except proc.CommandError as exc:
        raise EngineError(exc.why, field=what) from None
    if check and done.returncode != 0:
        raise EngineError(last_line(done.stderr, f"exit code {done.returncode}"), field=what)
    return done


_alive: set[str] = set()  # the local engine sockets that answered a ping in this process


def _require_alive(host: str | None) -> None:
    """Before the first longer call to a local engine: raise EngineError, after at most QUICK seconds, unless
    it answers a ping (a wedged engine is said within seconds, not after the longer call's limit)."""
    path = _unix_socket(host)
    if path is None or path in _alive:
        return
    problem = engine_problem(host)
    if problem:
        raise EngineError(problem, field="docker")


def inspect_images(*refs: str, host: str | None = None,
                   env: dict[str, str] | None = None) -> dict[str, dict[str, Any] | None]:
    """What `docker image inspect` says of each reference on the engine (None where there is no such
    image), in one call: the one way the head asks about its images."""
    done = run(["image", "inspect", *refs], what="docker image inspect", host=host, env=env, check=False)
    try:
        return read_inspect(refs, done.returncode, done.stdout, done.stderr)
    except ValueError as exc:
        raise EngineError(str(exc), field="docker image inspect") from None


def read_inspect(refs: tuple[str, ...], code: int, stdout: str, stderr: str) -> dict[str, dict[str, Any] | None]:
    """The data `docker image inspect REFS...` gave for each reference, None for each it named missing.

    docker prints what it found as JSON on stdout and, on stderr, one line for each reference it did
    not find ("No such image", or a line saying "not found"), exiting 1 when one is
    missing. Over ssh a node's shell may add lines of its own (a login script's noise), so the answer
    is whole when every reference is either found or named missing. A ValueError says why it is not.
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    missing = [line for line in lines if "No such image" in line or "not found" in line.lower()]
    try:
        found = parse_json(stdout or "[]")
    except ValueError:
        found = None
    if not isinstance(found, list) or not all(isinstance(data, dict) for data in found):
        raise ValueError(f"no JSON list of images in the answer: {last_line(stdout, 'no output')}")
    if code != 0 and len(found) + len(missing) < len(refs):
        # The line that says what went wrong, not a "No such image" beside it.
        raise ValueError(next((line for line in lines if line not in missing), f"exit code {code}"))
    if len(found) == len(refs):  # docker answers in the order it was asked
        return dict(zip(refs, found))

    def names(data: dict[str, Any]) -> set[str]:
        return {data.get("Id", ""), *(data.get("RepoTags") or []), *(data.get("RepoDigests") or [])}

    return {ref: next((data for data in found if ref in names(data)), None) for ref in refs}


def _unix_socket(host: str | None) -> str | None:
    """The engine's unix socket when the CLI would use one without a context; else None."""
    host = host or os.environ.get("DOCKER_HOST")
    if not host:
        if os.environ.get("DOCKER_CONTEXT") or _current_context() not in (None, "default"):
            return None
        return "/var/run/docker.sock"
    return host.removeprefix("unix://") if host.startswith("unix://") else None


def _current_context() -> str | None:
    config = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    try:
        context = parse_json(read_regular(config)).get("currentContext")
        return None if context is None else str(context)
    except (OSError, ValueError, AttributeError, SparkforgeError):  # SparkforgeError: a FIFO or a folder
        return None


def _ping(path: str, timeout: float) -> str | None:
    """GET /_ping on a unix socket: None when the engine answers OK, else why not."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            head = sock.recv(64)
    except FileNotFoundError:
        return f"no engine listens on {path} (is Docker started?)"
    except PermissionError:
        return f"no permission to use {path} (add your user to the docker group, then log in again)"
    except TimeoutError:
        return f"the engine on {path} did not answer within {timeout:.0f} s (is it wedged?)"
    except OSError as exc:
        return f"cannot reach the engine on {path}: {exc.strerror or exc}"
    return None if head.split(b" ")[1:2] == [b"200"] else f"the engine on {path} answered {head[:40]!r}"


def engine_problem(host: str | None = None, timeout: float = QUICK) -> str | None:
    """Why no engine can be used (no CLI, not answering), or None when one answers.

    A local unix socket is asked directly (about a millisecond), and one that answers is remembered for
    run(); anything else through `docker info`.
    """
    path = _unix_socket(host)
    if path is not None:
        problem = _ping(path, timeout)
        if problem is None:
            _alive.add(path)
        return f"the Docker engine does not answer: {problem}" if problem else None
    try:
        run(["info", "--format", "{{.ServerVersion}}"], what="docker info", timeout=timeout, host=host)
    except EngineError as exc:
        return f"the Docker engine does not answer: {exc.detail}"
    return None


def start(args: Sequence[str], *, host: str | None = None, **kw: Any) -> subprocess.Popen[Any]:
    """Start `docker ARGS` in the background; it is stopped with the CLI if the CLI is interrupted."""
    if shutil.which("docker") is None:
        raise EngineError("the docker CLI is not installed", field="docker " + " ".join(args[:2]))
    with proc.held():  # tracked before a Ctrl-C can leave it unknown
        return track(subprocess.Popen(["docker", *args], env=_env(host, kw.pop("env", None)), **kw))


def _named(child: subprocess.Popen[Any]) -> str:
    """A child's program and first two arguments, as errors name it."""
    args = child.args
    return " ".join(map(str, args[:3])) if isinstance(args, (list, tuple)) else str(args)


def lines_until_stall(child: subprocess.Popen[str], stall: float) -> Iterator[str]:
    """The lines a child from start() writes to its stdout; when it writes none for `stall` seconds, it is
    stopped (the lines end) and EngineError names it. A watchdog thread does the stopping, so a child
    that neither writes nor ends cannot hold the caller."""
    last = [time.monotonic()]
    done = threading.Event()
    stalled = threading.Event()

    def watch() -> None:
        while not done.wait(min(stall, 5.0)):
            if time.monotonic() - last[0] > stall:
                stalled.set()
                stop(child)
                return

    watchdog = threading.Thread(target=watch, name="stall-watchdog", daemon=True)
    watchdog.start()
    try:
        for line in child.stdout or ():
            last[0] = time.monotonic()
            yield line
    finally:
        done.set()
        watchdog.join()
    if stalled.is_set():
        raise EngineError(f"wrote nothing for {stall:.0f} s and was stopped", field=_named(child))


def track(child: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    """Have a child started elsewhere stopped with the CLI, like those from start(); returns it."""
    with _lock:
        _children.add(child)
    return child


def finish(child: subprocess.Popen[Any], timeout: float | None = None) -> int:
    """Wait for a child from start() and forget it; on a timeout, stop it and raise EngineError."""
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(child)
        raise EngineError(f"took longer than {timeout:.0f} s and was stopped", field=_named(child)) from None
    finally:
        with _lock:
            _children.discard(child)


def stop(child: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """Stop a child: SIGTERM, then SIGKILL after `grace` seconds."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def stop_all() -> None:
    """Stop every child still running (on Ctrl-C or SIGTERM)."""
    with _lock:
        children = list(_children)
        _children.clear()
    for child in children:
        stop(child)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` blocks and subprocess.run stop their children."""
    def handler(signum: int, frame: FrameType | None) -> NoReturn:  # noqa: ARG001 - the signal module's signature
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
