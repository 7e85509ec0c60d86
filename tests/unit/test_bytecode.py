"""inimage compile: what pip installed with --no-compile, compiled on every core, byte for byte as pip's serial
compile writes it (hash-based under SOURCE_DATE_EPOCH), with a file that does not compile named and left."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

MODULES = {f"pkg/m{i}.py": f"X = {i}\n\ndef f(a, b={i}):\n    return [a * b for _ in range({i})]\n" for i in range(40)}


def tree(root: Path) -> Path:
    for rel, text in MODULES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "pkg" / "sub").mkdir()
    (root / "pkg" / "sub" / "broken.py").write_text("def (:\n")
    return root


def compiled(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.pyc"))}


def test_compile_writes_what_a_serial_compile_writes_and_names_what_does_not_compile(tmp_path: Path) -> None:
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    site = tree(tmp_path / "site")
    run = subprocess.run([sys.executable, "-I", "-B", str(ROOT / "sparkforge" / "inimage"), "compile", str(site)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"bytecode: 41 .py files under {site}" in run.stdout
    assert "broken.py" in run.stdout + run.stderr and "do not compile" in run.stdout
    parallel = compiled(site)
    assert len(parallel) == 40 and not any("broken" in name for name in parallel)
    for pyc in site.rglob("*.pyc"):
        pyc.unlink()
    serial = subprocess.run([sys.executable, "-c", "import py_compile, sys\nfor p in sys.argv[1:]: "
                             "py_compile.compile(p, doraise=False, quiet=2)", *(str(site / r) for r in MODULES)],
                            env=env, timeout=120)
    assert serial.returncode == 0
    assert compiled(site) == parallel
    flags = int.from_bytes(next(iter(parallel.values()))[4:8], "little")
    assert flags == 0b11  # hash-based and checked, from SOURCE_DATE_EPOCH, as pip's are
    assert next(iter(parallel.values()))[:4] == importlib.util.MAGIC_NUMBER


def test_compile_without_folders_takes_the_running_pythons_site_packages(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    tree(site)
    run = subprocess.run([str(venv / "bin" / "python"), "-I", "-B", str(ROOT / "sparkforge" / "inimage"), "compile"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"41 .py files under {site}" in run.stdout
    assert len(compiled(site)) == 40
