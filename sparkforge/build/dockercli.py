"""The Docker CLI as sparkforge runs it: a time limit on every call, one-line errors, no orphans.

The CLI is sparkforge's one channel to Docker: builds need buildx, which only the CLI drives, and the CLI
alone follows the user's DOCKER_HOST, contexts and credential helpers as every other docker command does.
A call that runs to its end goes through proc.run (its own process group, stopped on the limit and on
Ctrl-C).

Every call names what it was doing, so a wedged or missing engine becomes one line instead of a hang
or a traceback. An engine is asked `docker version` first, once per process, with a short limit (QUICK):
a dead or wedged one is said within seconds. A question to an engine that answered gets a longer limit
(ASK): a containerd-store engine busy exporting or unpacking a large image answers `docker image inspect`
slowly. Long-running children (a build, a `docker save`) are tracked so that Ctrl-C or SIGTERM stops
them with the CLI.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, Literal, NoReturn, overload

from ..errors import SparkforgeError
from ..inimage import proc
from ..inimage.contract import parse_json

QUICK = 10.0    # seconds: whether the engine answers at all (`docker version`)
ASK = 120.0     # seconds: calls that read or change the image store (inspect, tag, rm) of a live engine
LONG = 1800.0   # seconds: calls that move data (run a container, save, load, push, pull)
EXIT_GRACE = 60.0  # seconds a streaming child may take to exit once its output has ended

_children: set[proc.Child[Any]] = set()
_lock = threading.Lock()
_stopping = False  # the CLI is stopping: a child tracked from now on is stopped at once


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


# The engines (DOCKER_HOST, or the current context) that answered in this process, and their architecture.
_alive: dict[str, str] = {}


def _engine_key(host: str | None) -> str:
    return host or os.environ.get("DOCKER_HOST") or f"context {os.environ.get('DOCKER_CONTEXT') or 'current'}"


def answered(host: str | None) -> str | None:
    """The architecture of the engine at host (None: the CLI's own) as Docker names it (amd64, arm64), where
    that engine answered engine_problem in this process; else None."""
    return _alive.get(_engine_key(host))


def _require_alive(host: str | None) -> None:
    """Before the first longer call to an engine: raise EngineError, after at most QUICK seconds, unless it
    answers (a stopped or wedged engine is said within seconds, not after the longer call's limit)."""
    if answered(host):
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


def remove_container(name: str, *, host: str | None = None, within: float = ASK,
                     pause: float = 5.0) -> str | None:
    """`docker rm -f NAME` until the container is gone: None then, else the engine's last word after `within`
    seconds. A loaded engine may refuse at first (a kill whose exit event comes late), so a refusal is
    tried again, and a removal is believed only once `docker container inspect` no longer finds it."""
    deadline = time.monotonic() + within
    while True:
        try:
            done = run(["rm", "-f", name], what="docker rm", host=host, check=False)
            why = last_line(done.stderr, f"exit code {done.returncode}")
            if done.returncode == 0 or "no such container" in why.lower():  # before Docker 20.10, rm -f says so
                still = run(["container", "inspect", "--format", "{{.State.Status}}", name],
                            what="docker container inspect", host=host, check=False)
                if still.returncode != 0:
                    return None
                why = f"still there after docker rm -f ({still.stdout.strip()})"
        except EngineError as exc:
            why = str(exc)
        if time.monotonic() + pause >= deadline:
            return why
        time.sleep(pause)


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


def engine_problem(host: str | None = None, timeout: float = QUICK) -> str | None:
    """Why no engine can be used (no CLI, not answering), or None when one answers: `docker version` asks the
    engine the CLI would use (host, else DOCKER_HOST, else the current context) within timeout seconds. One
    that answers is remembered for run()."""
    where = _where(host)
    try:
        done = proc.run(["docker", "version", "--format", "{{.Server.Version}} {{.Server.Arch}}"],
                        what="docker version", timeout=timeout, env=_env(host), capture_output=True, text=True)
    except proc.TimedOut:
        return f"the Docker engine does not answer: the engine{where} did not answer within {timeout:.0f} s (is it wedged?)"
    except proc.CommandError as exc:
        return f"the Docker engine does not answer: {exc.why}"
    if done.returncode == 0 and done.stdout.strip():
        _alive[_engine_key(host)] = done.stdout.split()[-1]
        return None
    return f"the Docker engine does not answer: {_why_not(done.stderr, where)}"


@dataclass(frozen=True)
class ImageStore:
    """Where an engine keeps its images: the containerd image store (Docker 29's default for new installs) or
    the classic one, and its storage driver as `docker info` names it."""

    containerd: bool
    driver: str


def image_store(host: str | None = None, env: dict[str, str] | None = None) -> ImageStore:
    """The image store of the engine the CLI would use (host, else DOCKER_HOST, else the current context; env
    for the CLI, when given); EngineError, in one line, where the engine does not say."""
    done = run(["info", "--format", "{{json .DriverStatus}} {{.Driver}}"], what="docker info", host=host, env=env)
    status, _, driver = done.stdout.strip().rpartition(" ")
    try:
        pairs = dict(parse_json(status) or [])
    except (ValueError, TypeError):  # not JSON, or not a list of pairs: an engine that says nothing of it
        pairs = {}
    return ImageStore(pairs.get("driver-type") == "io.containerd.snapshotter.v1", driver)


def _where(host: str | None) -> str:
    """" on SOCKET" for an engine named by a unix socket, " at ENDPOINT" for another named one, else ""."""
    named = host or os.environ.get("DOCKER_HOST") or ""
    if named.startswith("unix://"):
        return f" on {named.removeprefix('unix://')}"
    return f" at {named}" if named else ""


def _why_not(stderr: str, where: str) -> str:
    """The docker CLI's reason an engine did not answer, in the words sparkforge uses for it."""
    said = last_line(stderr, "the docker CLI gave no reason")
    m = re.search(r"unix://(\S+?)[.:]?(\s|$)", said)
    where = f" on {m.group(1)}" if m else where
    lowered = said.lower()
    if "permission denied" in lowered:
        return f"no permission to use the engine{where} (add your user to the docker group, then log in again)"
    if "cannot connect to the docker daemon" in lowered or "no such file or directory" in lowered \
            or "connection refused" in lowered:
        return f"no engine listens{where} (is Docker started?)"
    return said


def start(args: Sequence[str], *, host: str | None = None, **kw: Any) -> proc.Child[Any]:
    """Start `docker ARGS` in the background; it is stopped with the CLI if the CLI is interrupted."""
    if shutil.which("docker") is None:
        raise EngineError("the docker CLI is not installed", field="docker " + " ".join(args[:2]))
    return spawn(["docker", *args], env=_env(host, kw.pop("env", None)), **kw)


def spawn(argv: Sequence[str], **kw: Any) -> proc.Child[Any]:
    """Start argv (proc.start: its own process group) in the background, tracked: stopped with the CLI if the
    CLI is interrupted. Raises OSError as Popen does."""
    with proc.held():  # tracked before a Ctrl-C can leave it unknown
        return track(proc.start(argv, **kw))


def _named(child: proc.Child[Any]) -> str:
    """A child's program and first two arguments, as errors name it."""
    args = child.args
    return " ".join(map(str, args[:3])) if isinstance(args, (list, tuple)) else str(args)


def lines_until_stall(child: proc.Child[str], stall: float, tick: float | None = None) -> Iterator[str]:
    """The lines a child from start() writes to its stdout; when it writes none for `stall` seconds, it is
    stopped (the lines end) and EngineError names it. A watchdog thread does the stopping, so a child
    that neither writes nor ends cannot hold the caller. With `tick`, an empty string comes after each
    `tick` seconds without a line, so that the caller can act on time passing."""
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
        for line in _with_ticks(child.stdout, tick) if tick and child.stdout else child.stdout or ():
            if line:
                last[0] = time.monotonic()
            yield line
    finally:
        done.set()
        watchdog.join()
    if stalled.is_set():
        raise EngineError(f"wrote nothing for {stall:.0f} s and was stopped", field=_named(child))


def _with_ticks(stream: IO[str], tick: float) -> Iterator[str]:
    """The lines of stream, read on a thread of its own, and "" after each `tick` seconds without one."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in stream:
                lines.put(line)
        except (OSError, ValueError):  # the stream was closed under the reader: the child was stopped
            pass
        finally:
            lines.put(None)

    threading.Thread(target=read, name="line-reader", daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=tick)
        except queue.Empty:
            yield ""
            continue
        if line is None:
            return
        yield line


def track(child: proc.Child[Any]) -> proc.Child[Any]:
    """Have a child started elsewhere stopped with the CLI, like those from start(); returns it. One a thread
    starts after the CLI began to stop (stop_all) is stopped at once."""
    with _lock:
        late = _stopping
        if not late:
            _children.add(child)
    if late:
        stop(child)
    return child


def finish(child: proc.Child[Any], timeout: float | None = None) -> int:
    """Wait for a child from start() and forget it; on a timeout, stop it and raise EngineError."""
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(child)
        raise EngineError(f"took longer than {timeout:.0f} s and was stopped", field=_named(child)) from None
    finally:
        with _lock:
            _children.discard(child)


def stop(child: proc.Child[Any], grace: float = 5.0) -> None:
    """Stop a child and what it started (its process group): SIGTERM, then SIGKILL after `grace` seconds."""
    proc.signal_group(child, grace)


def stop_all(*, exiting: bool) -> None:
    """Stop every child still running (on Ctrl-C or SIGTERM). Exiting, a child a thread starts from now on is
    stopped as it is tracked."""
    global _stopping
    with _lock:
        _stopping = _stopping or exiting
        children = list(_children)
        _children.clear()
    for child in children:
        stop(child)


def exit_on_sigterm() -> None:
    """Turn SIGTERM, and SIGHUP (the terminal or the ssh session went away), into SystemExit, so that `finally`
    blocks stop the children, which run in process groups of their own and hear neither. A SIGHUP that is
    ignored (nohup) stays ignored."""
    def handler(signum: int, frame: FrameType | None) -> NoReturn:  # noqa: ARG001 - the signal module's signature
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, handler)
