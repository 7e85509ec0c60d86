"""Byte-compile what pip installed with --no-compile, on every core.

pip compiles each wheel's files one at a time, in one process: for a few thousand modules that is most of the
install (most of the build under emulation). compileall writes the same bytes, with the same settings (the
invalidation mode follows SOURCE_DATE_EPOCH, as pip's does), in a process per core. A file the image's Python
cannot compile is left as pip leaves it: named, not fatal.
"""

from __future__ import annotations

import compileall
import os
import sysconfig
from pathlib import Path


def site_dirs() -> list[Path]:
    """Where pip installs for the running Python (its venv's site-packages in a venv)."""
    # lib64 is often a link to lib: one folder, compiled once
    paths = dict.fromkeys(Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib"))
    return [path for path in paths if path.is_dir()]


def main(dirs: list[str]) -> int:
    paths = [Path(d) for d in dirs] or site_dirs()
    count = sum(1 for d in paths for _root, _dirs, files in os.walk(d) for f in files if f.endswith(".py"))
    ok = True
    for d in paths:
        # quiet=1: only the files that fail are named; force: as pip does, whatever is there already
        ok = compileall.compile_dir(str(d), quiet=1, force=True, workers=0) and ok
    where = ", ".join(str(p) for p in paths)
    print(f"bytecode: {count} .py files under {where}, on {os.cpu_count()} cores"
          + ("" if ok else "; the files named above do not compile for this Python and stay as pip leaves them"))
    return 0
