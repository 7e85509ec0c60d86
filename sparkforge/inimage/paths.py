"""Confinement: every path a mod names stays inside the folder it is read against, and every file
the applier reads is a regular file reached without a link at its last step."""

from __future__ import annotations

import errno
import os
import stat
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
    """root/rel with every link resolved (a merged /usr has /bin -> usr/bin), refused when it leads out of root;
    the path returned is the real one, so later reads and writes follow no link."""
    names = parts(rel, what, absolute_ok=absolute_ok)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, *names))
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise ModFailure(f"{what} {rel!r} leads out of the tree through a link")
    return Path(real)


def unlinked(root: Path, rel: str, what: str) -> Path:
    """root/rel, refused when a link stands anywhere on its way: a patch changes no file through a link."""
    path = Path(os.path.realpath(root))
    for part in parts(rel, what):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISLNK(mode):
            raise ModFailure(f"{what} {rel!r}: {path.relative_to(os.path.realpath(root))} is a link in the tree; "
                             "a patch changes no file through a link (name the file itself)")
    return path


def asset(folder: Path, rel: str, what: str) -> Path:
    """A file of the mod's own folder; refused when its path leaves the folder or passes a link."""
    path = folder
    for part in parts(rel, what):
        path = path / part
        if path.is_symlink():
            raise ModFailure(f"{what} {rel!r} is or passes through a link; a mod folder holds only regular files")
    return path


def check_folder(folder: Path) -> None:
    """Refuse a mod folder holding a link, anything but folders and regular files, or a name that is not UTF-8."""
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(parent) / name
            rel = os.fsencode(path.relative_to(folder)).decode("utf-8", "backslashreplace")  # not UTF-8: as \xff escapes
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise ModFailure(f"{rel}: the file name is not UTF-8; a mod folder holds UTF-8 names only") from None
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) or (name in files and not stat.S_ISREG(mode)):
                raise ModFailure(f"{rel} is {kind_of(mode)}; a mod folder holds only regular files")


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words: a link, a FIFO, a folder, ..."""
    for test, what in ((stat.S_ISLNK, "a link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return what
    return "of an unknown type"


def regular(mode: int, name: str) -> None:
    """Refuse anything but a regular file (a link, a folder, a FIFO, a socket, a device)."""
    if not stat.S_ISREG(mode):
        raise ModFailure(f"{name} is {kind_of(mode)}, not a regular file; it is not followed or opened")


def read_file(path: Path, what: str | None = None) -> bytes:
    """A regular file's bytes; anything else (a link too) is refused before it is opened and, should it take the
    file's place meanwhile, opened without waiting and refused once open."""
    name = what or str(path)
    regular(os.lstat(path).st_mode, name)  # a device or FIFO is refused before it is opened at all
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link took its place since
            regular(stat.S_IFLNK, name)
        raise
    with os.fdopen(fd, "rb") as fh:
        regular(os.fstat(fd).st_mode, name)
        return fh.read()


def last_line(text: str, default: str = "") -> str:
    """The last non-blank line of a command's output: usually the error that matters."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else default
