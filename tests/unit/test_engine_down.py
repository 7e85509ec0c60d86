"""With the Docker engine stopped or wedged, every command that needs it says so in one line: at once when nobody
listens, after one wait of its limit when the engine takes the connection and never answers."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkforge.build.dockercli import QUICK
from tests.support.paths import BASE, ROOT, VARIANTS, shipped_files
from tests.support.wedged import wedged

pytestmark = pytest.mark.needs("docker-cli")

COMMANDS = {
    "build": ["--images", str(VARIANTS), "build", "testvllm", "--base", BASE],
    "test": ["--images", str(VARIANTS), "test", "testvllm", "--base", BASE],
    "inspect": ["inspect", "sparkforge/vllm:testvllm"],
}


def _run(args: list[str], docker_host: str, cwd: Path, project: Path = ROOT) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_CONTEXT"}
    env["DOCKER_HOST"] = docker_host
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(project / "build.py"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)
    return proc, time.monotonic() - started


def _project_copy(dest: Path) -> Path:
    """The command line and what it reads, in a folder of its own: what it writes by default goes to
    that folder's build/, where no other test writes at the same time."""
    for name in ("build.py", "Dockerfile.j2", "sparkforge", "mods", "images", "tests/variants"):
        src = ROOT / name
        if src.is_dir():
            shipped = shipped_files(src)  # not a lock or recipe the user made there

            def ignore(folder: str, names: list[str], shipped: set[Path] | None = shipped) -> list[str]:
                return [n for n in names if n == "__pycache__" or (
                    shipped is not None and (Path(folder) / n).is_file() and Path(folder) / n not in shipped)]
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _one_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The engine is the world, not the input: exit 1, one line on stderr, no traceback; the line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, f"{command}: exit {proc.returncode}: {proc.stderr}"
    assert len(lines) == 1, f"{command}: {proc.stderr}"
    return lines[0]


# What each command says of a socket nobody listens on, and of one that takes the connection and never
# answers: the limit it waited out. Each asks the socket itself whether the engine is alive before any
# docker call, so all say it the same way.
STOPPED = "error: docker: the Docker engine does not answer: no engine listens on {sock} (is Docker started?)"
WEDGED = "error: docker: the Docker engine does not answer: the engine on {sock} did not answer within 10 s (is it wedged?)"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_stopped_engine_is_one_line_at_once(command: str, tmp_path: Path) -> None:
    """No limit is waited out: the line says nobody listens (the run's own time limit is only a guard)."""
    project = _project_copy(tmp_path / "project")
    args = [str(project / "tests" / "variants") if a == str(VARIANTS) else a for a in COMMANDS[command]]
    sock = tmp_path / "docker.sock"
    line = _one_line(_run(args, f"unix://{sock}", tmp_path, project)[0], command)
    assert line == STOPPED.format(sock=sock), line
    # contexts and logs go under the project's build/ by default: nothing is written for a failed command
    assert not (project / "build").exists(), sorted(str(p) for p in (project / "build").rglob("*"))


def test_wedged_engine_is_one_line_after_one_wait_of_its_limit(tmp_path: Path) -> None:
    """Every command at once, each on an engine of its own that takes connections and never answers: each
    waits out its limit on the engine's answer (10 s) once, and stops."""
    project = _project_copy(tmp_path / "project")
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(wedged(tmp_path / f"{name}.sock")) for name in COMMANDS}
        with ThreadPoolExecutor(len(COMMANDS)) as pool:
            runs = {name: pool.submit(_run, [str(project / "tests" / "variants") if a == str(VARIANTS) else a
                                             for a in args], engines[name].host, tmp_path, project)
                    for name, args in COMMANDS.items()}
            done = {name: run.result() for name, run in runs.items()}
    for name, (proc, seconds) in sorted(done.items()):
        sock = engines[name].path
        assert _one_line(proc, name) == WEDGED.format(sock=sock)
        assert seconds >= QUICK, f"{name} gave up after {seconds:.1f} s, before its limit"
    # each asks the engine once (one `docker version`, however many connections the CLI opens for it), never
    # again: no docker call follows a dead answer
    with wedged(tmp_path / "one.sock") as one:
        subprocess.run(["timeout", "-s", "KILL", str(int(QUICK)), "docker", "version"], capture_output=True,
                       env={**os.environ, "DOCKER_HOST": one.host}, timeout=60)
        once = one.accepted
    assert once >= 1
    assert {name: engine.accepted for name, engine in engines.items()} == dict.fromkeys(COMMANDS, once)
