"""Reading files the user names: only regular files, so that a FIFO or a device can never block a command."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO
from collections.abc import Callable, Iterator

from .errors import BuildError, ConfigError
from .inimage.paths import kind_of


class NotRegularFile(ConfigError):
    """A path that should be a file is a folder, a FIFO, a socket or a device."""


def open_regular(path: Path | str, *, field: str | None = None) -> BinaryIO:
    """path opened for reading, refused (NotRegularFile) unless it is a regular file (links followed): checked
    before opening and on the open file (O_NONBLOCK: a FIFO swapped in between does not block the open). Other
    OSErrors (missing, no permission) go to the caller."""

    def check(mode: int) -> None:
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"is {kind_of(mode)}, not a regular file", path=path, field=field)

    check(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path | str, *, field: str | None = None) -> bytes:
    """The bytes of a regular file (see open_regular)."""
    with open_regular(path, field=field) as fh:
        return fh.read()


def is_regular(path: Path | str) -> bool:
    """True for a regular file (links followed); never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def name_path(exc: BaseException, path: Path | str) -> None:
    """Give an OSError that names no file (a write that hit a full disk) the path it was about, for its one line."""
    if isinstance(exc, OSError) and exc.filename is None:
        exc.filename = str(path)


def write_atomic(path: Path, data: bytes, mode: int = 0o644, *, new: bool = False) -> None:
    """Put data at path whole, or leave path as it was (a temporary file beside it, renamed over it): a reader
    sees the old file or the new, never half; on any failure the temporary file is gone and the OSError names path.
    With `new`, only where no file is (linked, not renamed): FileExistsError when another process made path first."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, mode)
        (os.link if new else os.replace)(tmp, path)
    except OSError as exc:  # about path, whichever step failed (not about a temporary name)
        exc.filename, exc.filename2 = str(path), None
        raise
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # after a rename it is gone already; after a link, path holds the data


@contextlib.contextmanager
def locked(lock_file: Path, *, timeout: float, what: str, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive lock (flock) on lock_file, for work two processes sharing a cache must not do at
    once (two git fetches into one mirror). Waits at most timeout seconds, then fails in one line."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        end = time.monotonic() + timeout
        for attempt in itertools.count():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 0:
                    on_wait()
                if time.monotonic() > end:
                    raise BuildError(f"another sparkforge process has held this lock for over {timeout:.0f}s while "
                                     f"it {what}; try again when it is done", path=lock_file) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing the file drops the lock
