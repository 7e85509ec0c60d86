"""Patcher mods: a stdlib-only module (TARGETS, is_applied, transform) run in a child Python.

The child is bounded, not sandboxed (a patcher is trusted code): isolated (`-I`), in a fresh scratch folder (a
relative path it writes lands there, never in the mod folder), with PATH and the locale only, in its own process
group, within a time limit. It is a supervisor: it runs the patcher in a worker and adopts every orphan below it
(Linux's child subreaper), so when the run ends, on success too, it kills all the worker started, whatever session
or group those moved to; the runner then kills the group too. Whatever goes wrong fails, naming the mod.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from .contract import ModState
from .paths import ModFailure, inside, last_line, read_file
from .proc import Child, start
from .reaper import reaped

PATCHER_TIMEOUT = 60.0  # seconds for each run of a patcher, unless the caller says otherwise
STOP_TIMEOUT = 5.0  # seconds the supervisor has to end what the patcher started, and the runner waits for it
_RESULT_MARK = "sparkforge-patcher-result "
PACKAGE_DIR = Path(__file__).resolve().parent


def plan_patcher(patcher: Path, root: Path,
                 timeout: float = PATCHER_TIMEOUT) -> tuple[ModState, dict[Path, bytes]]:
    """Run a patcher in a child: it names its targets, gets their texts, decides and transforms (nothing written)."""
    deadline = time.monotonic() + timeout
    # The package folder run as a script (its __main__ loads it by path; -I adds no other folder).
    cmd = [sys.executable, "-I", "-B", str(PACKAGE_DIR), "patcher-child", str(patcher.resolve())]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}  # nothing else
    with tempfile.TemporaryDirectory(prefix="sparkforge-patcher-") as scratch, \
            tempfile.TemporaryFile() as errors:  # a file, not a pipe: a chatty patcher cannot block on it
        proc = start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, cwd=scratch, env=env)
        try:
            stdin, stdout = proc.stdin, proc.stdout
            assert stdin is not None and stdout is not None  # asked for as pipes
            first, _, rest = _read(stdout, deadline, line=True).partition(b"\n")
            targets = _answer(patcher, first, proc, errors).get("targets")
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ModFailure(f"patcher {patcher.name}: its TARGETS are not a list of file names")
            paths, sources = _read_targets(root, targets)
            out = _exchange(proc, stdin, stdout, json.dumps(sources).encode(), deadline)
            answer = _answer(patcher, rest + out, proc, errors)
            _check_answer(patcher, answer, sources)
        except subprocess.TimeoutExpired:
            raise ModFailure(f"patcher {patcher.name} did not finish within {timeout:g} s; stopped") from None
        finally:
            _stop(proc)
    if answer["state"] == ModState.ALREADY.value:
        return ModState.ALREADY, {}
    return ModState.APPLIED, {paths[rel]: text.encode("utf-8") for rel, text in answer["files"].items()
                              if text != sources[rel]}


def _check_answer(patcher: Path, answer: dict[str, Any], sources: dict[str, str]) -> None:
    """The child's answer has the shape the runner reads, else ModFailure (never a KeyError)."""
    state, files = answer.get("state"), answer.get("files", {})
    if state not in (ModState.APPLIED.value, ModState.ALREADY.value):
        raise ModFailure(f"patcher {patcher.name}: its answer has no state applied or already")
    if state == ModState.APPLIED.value and (
            not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
            or not set(files) <= set(sources)):
        raise ModFailure(f"patcher {patcher.name}: its answer names files outside its TARGETS or no texts")


def _read(stream: IO[bytes], deadline: float, *, line: bool = False) -> bytes:
    """What a pipe gives until its end or deadline; with line, until a first newline, or TimeoutExpired."""
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while not (line and b"\n" in data):
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                if line:
                    raise subprocess.TimeoutExpired("patcher", 0)
                break
            chunk = os.read(stream.fileno(), 1 << 16)
            if not chunk:
                break
            data += chunk
    return data


def _exchange(proc: Child[bytes], stdin: IO[bytes], stdout: IO[bytes], payload: bytes, deadline: float) -> bytes:
    """Send payload to the child and read its output until the child exits (a process the patcher started may
    hold the pipe open); then the group goes, and the rest is read."""
    out = b""
    view = memoryview(payload)
    os.set_blocking(stdin.fileno(), False)
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        selector.register(stdin, selectors.EVENT_WRITE)
        while _exit_code(proc, 0) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, 0)
            if not selector.get_map():  # stdout closed early: wait for the child to end
                time.sleep(min(left, 0.05))
                continue
            for key, _ in selector.select(min(left, 0.2)):
                if key.fileobj is stdin:
                    try:
                        view = view[os.write(stdin.fileno(), view[:1 << 16]):]
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        selector.unregister(stdin)
                        stdin.close()
                else:
                    chunk = os.read(stdout.fileno(), 1 << 16)
                    out += chunk
                    if not chunk:
                        selector.unregister(stdout)
    _kill_group(proc)
    return out + _read(stdout, time.monotonic() + 5)


def _answer(patcher: Path, data: bytes, proc: Child[bytes], errors: IO[bytes]) -> dict[str, Any]:
    """The last marked line of the child's output as a dict; ModFailure for an error or no answer."""
    marked = [line for line in data.decode("utf-8", "replace").splitlines() if line.startswith(_RESULT_MARK)]
    if not marked:
        code = _exit_code(proc, time.monotonic() + STOP_TIMEOUT)
        errors.seek(0)
        why = last_line(errors.read().decode("utf-8", "replace"), "no output")
        raise ModFailure(f"patcher {patcher.name} exited with code {code} without a result: {why}")
    answer = json.loads(marked[-1][len(_RESULT_MARK):])
    if not isinstance(answer, dict):
        raise ModFailure(f"patcher {patcher.name}: its answer is not a JSON object")
    if "error" in answer:
        raise ModFailure(answer["error"])
    return answer


def _read_targets(root: Path, targets: list[str]) -> tuple[dict[str, Path], dict[str, str]]:
    """A patcher's targets resolved in root (refusing any that leave it, and two that are one file), and texts."""
    paths = {rel: inside(root, rel, "patcher TARGETS entry") for rel in targets}
    named: dict[Path, str] = {}
    sources = {}
    for rel, path in paths.items():
        if path in named:
            raise ModFailure(f"patcher TARGETS name one file twice, as {named[path]} and as {rel}; name it once")
        named[path] = rel
        if not os.path.lexists(path):
            raise ModFailure(f"{rel}: file to patch not found")
        try:
            sources[rel] = read_file(path, rel).decode("utf-8")
        except UnicodeDecodeError:
            raise ModFailure(f"{rel}: not UTF-8 text; a patcher edits text files") from None
    return paths, sources


def _exit_code(proc: Child[bytes], deadline: float) -> int | None:
    """The child's exit code (negative: its signal), None if it runs at deadline; unreaped, its group keeps its id."""
    while True:
        if proc.returncode is not None:
            return proc.returncode
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return proc.poll()
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _kill_group(proc: Child[bytes]) -> None:
    """Kill the patcher's process group, whether its leader still runs or not: what it started dies with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: Child[bytes]) -> None:
    """End a run: the supervisor given STOP_TIMEOUT to end all it started, then the group killed, the child reaped."""
    if _exit_code(proc, 0) is None:
        os.kill(proc.pid, signal.SIGTERM)  # unreaped, so its number is still its own
        _exit_code(proc, time.monotonic() + STOP_TIMEOUT)
    _kill_group(proc)
    for stream in (proc.stdin, proc.stdout):  # read and written past their buffers: closing writes nothing
        if stream is not None:
            stream.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


# ------------------------------------------------------------------ the child's side


def _is_applied(module: ModuleType, name: str, sources: dict[str, str]) -> bool:
    answer = module.is_applied(dict(sources))
    if not isinstance(answer, bool):
        raise ModFailure(f"patcher {name}: is_applied() returned {type(answer).__name__} {answer!r}, not a bool")
    return answer


def _patcher_run(module: ModuleType, name: str, sources: dict[str, str]) -> dict[str, object]:
    """What the child answers once it has the texts; runs the patcher's own code."""
    if _is_applied(module, name, sources):
        return {"state": ModState.ALREADY.value}
    try:
        result = module.transform(dict(sources))
    except ValueError as exc:
        raise ModFailure(str(exc)) from None
    if not isinstance(result, dict) or not all(isinstance(v, str) for v in result.values()):
        raise ModFailure("transform() must return a dict of path -> text")
    extra = sorted(set(result) - set(sources))
    if extra:
        raise ModFailure(f"patcher changed files it does not list in TARGETS: {extra}")
    if not _is_applied(module, name, {**sources, **result}):
        raise ModFailure("patcher ran, but is_applied() is still false on its result")
    return {"state": ModState.APPLIED.value, "files": result}


def child_main(patcher: str) -> int:
    """The child side of plan_patcher: the patcher in a worker, all it started killed once it ends or on SIGTERM."""
    return reaped(lambda: _worker_main(patcher), STOP_TIMEOUT)


def _worker_main(patcher: str) -> int:
    """Import the patcher, print its targets, read their texts from stdin, print the answer (marked JSON lines)."""
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # the patcher's prints must not mix with the answer

    def say(answer: dict[str, object]) -> None:
        print(_RESULT_MARK + json.dumps(answer), file=real_stdout, flush=True)

    path, stage = Path(patcher), "import"
    try:
        spec = importlib.util.spec_from_file_location("sparkforge_patcher", path)
        if spec is None or spec.loader is None:
            raise ModFailure(f"cannot load patcher {path.name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        missing = [a for a in ("TARGETS", "is_applied", "transform") if not hasattr(module, a)]
        if missing:
            raise ModFailure(f"patcher {path.name} does not define {', '.join(missing)}")
        stage, targets = "run", module.TARGETS
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise ModFailure("TARGETS must be a list of relative paths")
        say({"targets": list(targets)})
        answer = _patcher_run(module, path.name, json.loads(sys.stdin.buffer.read()))
    except ModFailure as exc:
        answer = {"error": str(exc)}
    except SystemExit as exc:
        answer = {"error": f"patcher {path.name} called sys.exit({exc.code!r}) during {stage}"}
    except BaseException as exc:  # the patcher's own code: anything it raises is its failure
        answer = {"error": f"patcher {path.name} raised {type(exc).__name__} during {stage}: {exc}"}
    say(answer)
    return 0


def literal_targets(patcher: Path) -> list[str]:
    """TARGETS of a patcher module when it is assigned a literal list of strings; else none (checked at run time)."""
    import ast

    try:
        tree = ast.parse(read_file(patcher), filename=str(patcher))
    except SyntaxError as exc:
        raise ModFailure(f"patcher {patcher.name} does not parse: line {exc.lineno}: {exc.msg}") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "TARGETS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return []
            return [v for v in value if isinstance(v, str)] if isinstance(value, (list, tuple)) else []
    return []
