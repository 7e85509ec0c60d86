"""A fingerprint of what a test run must leave alone on the machine it runs on.

Taken before and after the whole session (tests/conftest.py): apt's configuration, the system
Python's installed packages, and the Docker engine's settings. A difference fails the run and
names what changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

WATCHED_DIRS = (Path("/etc/apt"), Path("/etc/docker"))
SYSTEM_PYTHON = Path("/usr/bin/python3")
ENGINE_SETTINGS = ("{{json .RegistryConfig}} {{.Driver}} {{json .DriverStatus}} {{json .Runtimes}} "
                   "{{.DefaultRuntime}} {{json .Labels}} {{.LoggingDriver}} {{.CgroupDriver}}")


def tree_digest(root: Path) -> str:
    """sha256 over every path, link target and file content under root (links are not followed)."""
    h = hashlib.sha256()
    if not root.exists():
        return "absent"
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            path = Path(dirpath) / name
            h.update(str(path.relative_to(root)).encode() + b"\0")
            if path.is_symlink():
                h.update(b"link:" + os.readlink(path).encode())
            elif path.is_file():
                try:
                    h.update(path.read_bytes())
                except PermissionError:
                    h.update(b"unreadable:%d" % path.stat().st_size)
            h.update(b"\0")
    return h.hexdigest()


def python_packages(python: Path = SYSTEM_PYTHON) -> str:
    """name==version of every distribution the given Python sees, one per line."""
    if not python.exists():
        return "absent"
    code = ("import importlib.metadata as m; "
            "print(chr(10).join(sorted(str(d.metadata['Name']) + '==' + d.version for d in m.distributions())))")
    proc = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=60)
    return proc.stdout if proc.returncode == 0 else f"error: {proc.stderr.strip()[-200:]}"


def engine_settings() -> str:
    """The default engine's settings as `docker info` reports them ('absent' without an engine)."""
    try:
        proc = subprocess.run(["docker", "info", "--format", ENGINE_SETTINGS], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "absent"
    return proc.stdout.strip() if proc.returncode == 0 else "absent"


def snapshot() -> dict[str, str]:
    """Everything watched, by a name that says what it is."""
    state = {str(d): tree_digest(d) for d in WATCHED_DIRS}
    state[f"packages of {SYSTEM_PYTHON}"] = python_packages()
    state["Docker engine settings"] = engine_settings()
    return state


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The names whose state differs, engine settings only where an engine answered both times."""
    out = []
    for key, old in before.items():
        new = after.get(key)
        if key == "Docker engine settings" and "absent" in (old, new):
            continue
        if new != old:
            out.append(key)
    return out
