"""With the Docker engine stopped or wedged, every command that needs it says so in one line, in time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ROOT / "tests" / "variants"
BASE = "sparkforge/base-local:bookworm"

COMMANDS = {
    "build": ["--images", str(VARIANTS), "build", "testvllm", "--base", BASE],
    "test": ["--images", str(VARIANTS), "test", "testvllm", "--base", BASE],
    "inspect": ["inspect", "sparkforge/vllm:testvllm"],
}


def _run(args: list[str], docker_host: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_CONTEXT"}
    env["DOCKER_HOST"] = docker_host
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)
    return proc, time.monotonic() - started


def _assert_one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert any(w in lines[0] for w in words), lines[0]


def _written() -> dict[str, int]:
    """Every file the command line writes by default (contexts, logs: under build/ of the project), with
    its modification time."""
    out = ROOT / "build"
    return {str(p): p.stat().st_mtime_ns for p in out.rglob("*")} if out.is_dir() else {}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_stopped_engine_is_one_line_within_10_s(command: str, tmp_path: Path) -> None:
    before = _written()
    proc, seconds = _run(COMMANDS[command], f"unix://{tmp_path}/docker.sock", tmp_path)
    _assert_one_line(proc, "Cannot connect to the Docker daemon", "does not answer", "no engine listens")
    assert seconds < 10, f"{command} took {seconds:.1f} s"
    assert _written() == before, "nothing is written for a command that failed"


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


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_wedged_engine_is_one_line_not_a_hang(command: str, wedged_engine: str, tmp_path: Path) -> None:
    proc, seconds = _run(COMMANDS[command], wedged_engine, tmp_path)
    _assert_one_line(proc, "did not answer", "no answer within", "does not answer")
    assert seconds < 40, f"{command} took {seconds:.1f} s"
