"""Helpers of the fat-binary reader's tests: the reader with its Python decoders alone."""

from __future__ import annotations

import contextlib
from typing import Iterator

from sparkforge.inimage import fatbin


@contextlib.contextmanager
def python_decoders() -> Iterator[None]:
    """Decode LZ4 and zstd in Python only, as in an image without liblz4 and libzstd."""
    saved = dict(fatbin._SYSTEM)
    fatbin._SYSTEM.update(lz4=None, zstd=None)
    try:
        yield
    finally:
        fatbin._SYSTEM.clear()
        fatbin._SYSTEM.update(saved)
