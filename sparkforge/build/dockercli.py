"""The Docker CLI as sparkforge runs it: a time limit on every call, one-line errors, no orphans.

Only the CLI drives buildx and follows the user's DOCKER_HOST, contexts and credential helpers. An engine is
asked `docker version` first, once per process, within QUICK seconds, so a wedged one is said at once; a live
one gets ASK (a busy containerd store answers `image inspect` slowly). Long-running children are tracked so
that Ctrl-C or SIGTERM stops them with the CLI.
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
from typing import Any, Literal, NoReturn, overload

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


def _require_cli(what: str) -> None:
    if shutil.which("docker") is None:
        raise EngineError("the docker CLI is not installed", field=what)


@overload
def run(args: Sequence[str], *, what: str | None = None, timeout: float = ASK, host: str | None = None,
        check: bool = True, text: Literal[True] = True, **kw: Any) -> subprocess.CompletedProcess[str]: ...
@overload
def run(args: Sequence[str], *, what: str | None = None, timeout: float = ASK, host: str | None = None,
        check: bool = True, text: Literal[False], **kw: Any) -> subprocess.CompletedProcess[bytes]: ...
def run(args: Sequence[str], *, what: str | None = None, timeout: float = ASK, host: str | None = None,
        check: bool = True, text: bool = True, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """Run `docker ARGS`; EngineError on a timeout, a missing CLI or (with check) a failure."""
    what = what or "docker " + " ".join(args[:2])
    _require_cli(what)
    if timeout > QUICK and kw.get("env") is None:
        require_engine(host)
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
    """The architecture (amd64, arm64) of the engine at host if it answered engine_problem in this process."""
    return _alive.get(_engine_key(host))


def require_engine(host: str | None) -> None:
    """EngineError within QUICK seconds, not after a longer call's limit, unless the engine answers."""
    if not answered(host) and (problem := engine_problem(host)):
        raise EngineError(problem, field="docker")


def inspect_images(*refs: str, host: str | None = None,
                   env: dict[str, str] | None = None) -> dict[str, dict[str, Any] | None]:
    """`docker image inspect` of each reference, None where there is no such image, in one call."""
    done = run(["image", "inspect", *refs], what="docker image inspect", host=host, env=env, check=False)
    try:
        return read_inspect(refs, done.returncode, done.stdout, done.stderr)
    except ValueError as exc:
        raise EngineError(str(exc), field="docker image inspect") from None


def remove_container(name: str, *, host: str | None = None, within: float = ASK,
                     pause: float = 5.0) -> str | None:
    """`docker rm -f NAME` until `docker container inspect` no longer finds it (a loaded engine may refuse at
    first): None then, else the engine's last word after `within` s."""
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
    """The data `docker image inspect REFS...` gave for each reference, None for each it named missing; whole
    when each is found or named missing (over ssh a login script may add lines), else a ValueError."""
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
    """Why the engine the CLI would use cannot be (no CLI, no answer within timeout), or None; remembered."""
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
    """An engine's image store (containerd: Docker 29's default, else classic) and its storage driver."""

    containerd: bool
    driver: str


def image_store(host: str | None = None, env: dict[str, str] | None = None) -> ImageStore:
    """The image store of the engine the CLI would use; EngineError where the engine does not say."""
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
    _require_cli("docker " + " ".join(args[:2]))
    return spawn(["docker", *args], env=_env(host, kw.pop("env", None)), **kw)


def spawn(argv: Sequence[str], **kw: Any) -> proc.Child[Any]:
    """Start argv in its own process group, tracked: stopped with the CLI if the CLI is interrupted."""
    with proc.held():  # tracked before a Ctrl-C can leave it unknown
        return track(proc.start(argv, **kw))


def _named(child: proc.Child[Any]) -> str:
    args = child.args
    return " ".join(map(str, args[:3])) if isinstance(args, (list, tuple)) else str(args)


def lines_until_stall(child: proc.Child[str], stall: float, tick: float | None = None) -> Iterator[str]:
    """The lines of a child's stdout, read on a thread of its own; silent for `stall` s, the child is stopped and
    EngineError names it. The caller waits for a line at most `tick` (else 5) s at a time, so a child that neither
    writes nor ends cannot hold it; with `tick`, "" comes after each such wait, so the caller can act on time."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in child.stdout or ():
                lines.put(line)
        except (OSError, ValueError):  # the stream was closed under the reader: the child was stopped
            pass
        finally:
            lines.put(None)

    threading.Thread(target=read, name="line-reader", daemon=True).start()
    last = time.monotonic()
    while True:
        try:
            line = lines.get(timeout=tick or min(stall, 5.0))
        except queue.Empty:
            if time.monotonic() - last > stall:
                stop(child)
                raise EngineError(f"wrote nothing for {stall:.0f} s and was stopped", field=_named(child)) from None
            if tick:
                yield ""
            continue
        if line is None:
            return
        last = time.monotonic()
        yield line


def track(child: proc.Child[Any]) -> proc.Child[Any]:
    """Have a child started elsewhere stopped with the CLI (at once, if the CLI is stopping); returns it."""
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
    """Stop every child still running (Ctrl-C, SIGTERM); exiting, any child tracked later is stopped at once."""
    global _stopping
    with _lock:
        _stopping = _stopping or exiting
        children = list(_children)
        _children.clear()
    for child in children:
        stop(child)


def exit_on_sigterm() -> None:
    """Turn SIGTERM and SIGHUP (unless ignored, as by nohup) into SystemExit, so that `finally` blocks stop the
    children, which run in process groups of their own and hear neither."""
    def handler(signum: int, frame: FrameType | None) -> NoReturn:  # noqa: ARG001 - the signal module's signature
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, handler)
