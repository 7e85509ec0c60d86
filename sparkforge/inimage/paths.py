"""Confinement: every path a mod names stays inside the folder it is read against."""

from __future__ import annotations

import os
from pathlib import Path


class ModFailure(Exception):
    """The mod cannot be applied; the message says which file or hunk and why."""


def parts(rel: str, what: str, *, absolute_ok: bool = False) -> list[str]:
    """The components of a path a mod names; refused when it could leave the folder it is read against."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise ModFailure(f"{what} {rel!r} is not a path")
    if rel.startswith("/") and not absolute_ok:
        raise ModFailure(f"{what} {rel!r} is an absolute path; name it relative to the tree")
    found = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in found:
        raise ModFailure(f"{what} {rel!r} climbs out of its root with '..'")
    if not found:
        raise ModFailure(f"{what} {rel!r} names no file")
    return found


def inside(root: Path, rel: str, what: str, *, absolute_ok: bool = False) -> Path:
    """root/rel with every link resolved; refused when it, or a link on its way, leads out of root.

    Links inside the tree are followed only while they stay in it (a merged /usr root has /bin ->
    usr/bin); the path returned is the real one, so later reads and writes follow no link."""
    names = parts(rel, what, absolute_ok=absolute_ok)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, *names))
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise ModFailure(f"{what} {rel!r} leads out of the tree through a link")
    return Path(real)


def asset(folder: Path, rel: str, what: str) -> Path:
    """A file of the mod's own folder; refused when its path leaves the folder or passes a link."""
    path = folder
    for part in parts(rel, what):
        path = path / part
        if path.is_symlink():
            raise ModFailure(f"{what} {rel!r} is or passes through a link; a mod folder holds only regular files")
    return path


def check_folder(folder: Path) -> None:
    """Refuse a mod folder that holds a link or anything but folders and regular files."""
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(parent) / name
            if path.is_symlink():
                raise ModFailure(f"{path.relative_to(folder)} is a link; a mod folder holds only regular files")
            if name in files and not path.is_file():
                raise ModFailure(f"{path.relative_to(folder)} is not a regular file")


def read_file(path: Path) -> bytes:
    """A file's bytes, refusing a link at the last step (the path was resolved by inside())."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def last_line(text: str, default: str = "") -> str:
    """The last non-blank line of a command's output: usually the error that matters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else default
