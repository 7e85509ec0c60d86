"""With the Docker engine stopped or wedged, every command that needs it says so in one line, in time."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.paths import BASE, ROOT, VARIANTS

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
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _assert_one_line(proc: subprocess.CompletedProcess, *words: str, command: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, f"{command}: {proc.stderr}"
    assert len(lines) == 1, f"{command}: {proc.stderr}"
    assert any(w in lines[0] for w in words), f"{command}: {lines[0]}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_stopped_engine_is_one_line_within_10_s(command: str, tmp_path: Path) -> None:
    project = _project_copy(tmp_path / "project")
    args = [str(project / "tests" / "variants") if a == str(VARIANTS) else a for a in COMMANDS[command]]
    proc, seconds = _run(args, f"unix://{tmp_path}/docker.sock", tmp_path, project)
    _assert_one_line(proc, "Cannot connect to the Docker daemon", "does not answer", "no engine listens",
                     command=command)
    assert seconds < 10, f"{command} took {seconds:.1f} s"
    # contexts and logs go under the project's build/ by default: nothing is written for a failed command
    assert not (project / "build").exists(), sorted(str(p) for p in (project / "build").rglob("*"))


@pytest.fixture
def wedged_engine(tmp_path: Path):
    """A unix socket that accepts connections and never answers: an engine that hangs."""
    path = tmp_path / "wedged.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"unix://{path}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_wedged_engine_is_one_line_not_a_hang(wedged_engine: str, tmp_path: Path) -> None:
    """Every command, run at once: each waits out its own limit on the engine's answer (10 s)."""
    with ThreadPoolExecutor(len(COMMANDS)) as pool:
        runs = {name: pool.submit(_run, args, wedged_engine, tmp_path) for name, args in COMMANDS.items()}
    for name, run in sorted(runs.items()):
        proc, seconds = run.result()
        _assert_one_line(proc, "did not answer", "no answer within", "does not answer", command=name)
        assert seconds < 40, f"{name} took {seconds:.1f} s"
