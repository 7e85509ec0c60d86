"""build.py finds the project environment itself: started by a Python that lacks the dependencies, it runs
again under .venv/bin/python; without a .venv (or with one that lacks them) it says in one line to run
`make venv`, and nothing else happens.

The Python that lacks them is the one .venv was made from (its base interpreter), or the machine's
python3: neither has typer installed where the tests run (checked first, else the test skips).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


from sparkforge import __version__
from tests.support.needs import bare_python, require
from tests.support.paths import ROOT


def _bare_python() -> str:
    """An interpreter without the project's dependencies."""
    require("bare-python")
    python = bare_python()
    assert python is not None
    return python


def _run(python: str, build: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8"}
    return subprocess.run([python, str(build), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _project_without_venv(dest: Path) -> Path:
    """The project's tracked files, copied without its .venv."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "build.py", "sparkforge"], capture_output=True,
                           text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_another_python_runs_build_py_under_the_project_environment(tmp_path: Path) -> None:
    python = _bare_python()
    proc = _run(python, ROOT / "build.py", "--version", cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"sparkforge {__version__}\n", "")
    # A verb that needs every dependency (pydantic, yaml, rich) runs too: only .venv has them.
    proc = _run(python, ROOT / "build.py", "show", "ng17", "--json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert '"variant": "ng17"' in proc.stdout


def test_build_py_runs_as_a_program(tmp_path: Path) -> None:
    """`./build.py`, as the README writes it: executable, with a shebang that finds python3 on PATH."""
    assert os.access(ROOT / "build.py", os.X_OK)
    assert (ROOT / "build.py").read_text().startswith("#!/usr/bin/env python3\n")
    proc = subprocess.run(["./build.py", "--version"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert (proc.returncode, proc.stdout) == (0, f"sparkforge {__version__}\n"), proc.stderr


def test_without_a_venv_one_line_says_to_run_make_venv(tmp_path: Path) -> None:
    project = _project_without_venv(tmp_path / "project")
    proc = _run(_bare_python(), project / "build.py", "list", cwd=project)
    assert proc.returncode == 1 and proc.stdout == "", proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: typer is not installed in "), lines[0]
    assert f"there is no project environment {project / '.venv'} yet: run `make venv` in {project}" in lines[0]


def test_a_venv_without_the_dependencies_is_one_line_not_a_loop(tmp_path: Path) -> None:
    project = _project_without_venv(tmp_path / "project")
    python = _bare_python()
    made = subprocess.run([python, "-m", "venv", "--without-pip", str(project / ".venv")], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    proc = _run(python, project / "build.py", "list", cwd=project)
    assert proc.returncode == 1 and proc.stdout == "", proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: typer is not installed in the project environment {project / '.venv'}: "
                               "run `make venv`"), lines[0]


@pytest.mark.network  # the dependencies from PyPI
def test_pip_install_of_the_project_gives_a_working_sparkforge_script(tmp_path: Path) -> None:
    uv = Path(sys.executable).parent / "uv"
    env = {**os.environ, "VIRTUAL_ENV": ""}
    made = subprocess.run([str(uv), "venv", "--quiet", "--python", sys.executable, str(tmp_path / "venv")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert made.returncode == 0, made.stderr
    python = tmp_path / "venv" / "bin" / "python"
    source = tmp_path / "src"  # what the package is made of, so that its build writes nothing into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "sparkforge"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    installed = subprocess.run([str(uv), "pip", "install", "--quiet", "--python", str(python), str(source)],
                               capture_output=True, text=True, timeout=900, env=env)
    assert installed.returncode == 0, installed.stderr
    script = tmp_path / "venv" / "bin" / "sparkforge"
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert (version.returncode, version.stdout) == (0, f"sparkforge {__version__}\n"), version.stderr
    helped = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert helped.returncode == 0 and "bump" in helped.stdout and "check-mods" in helped.stdout, helped.stderr
