"""Work that several test processes (xdist workers) may ask for at once, done by one at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from collections.abc import Iterator


@contextlib.contextmanager
def one_at_a_time(name: str, folder: Path | None = None) -> Iterator[None]:
    """Hold a machine-wide lock named name (an flock under the temp folder, or in `folder`) for the block: the
    second process to ask waits, then finds what the first made (a base image, say) and makes nothing."""
    path = (folder or Path(tempfile.gettempdir())) / f"sparkforge-tests-{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
