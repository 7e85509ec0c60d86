"""The decoders of compressed fat-binary entries: LZ4 blocks (CUDA 12.x) and zstd frames (CUDA 13).

Stdlib only: the system's liblz4 and libzstd through ctypes (every base has both: dpkg pre-depends on libzstd1,
apt depends on liblz4-1). Each decoder writes at most the room it is given and gives exactly the size the entry's
header says, or raises DecodeError.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any
from collections.abc import Callable


class DecodeError(ValueError):
    """A payload that does not decode to the size its header says, or that nothing here can decode."""


# Each codec's library file, the Debian/Ubuntu package that installs it, and its decoder with its C signature.
CODECS: dict[str, tuple[str, str, str, list[Any], Any]] = {
    "lz4": ("liblz4.so.1", "liblz4-1", "LZ4_decompress_safe",
            [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "zstd": ("libzstd.so.1", "libzstd1", "ZSTD_decompress",
             [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_size_t),
}
SYSTEM: dict[str, Callable[..., Any] | None] = {}  # each codec's function once looked up (None: not there)


def system(codec: str) -> Callable[..., Any]:
    """The system's decoder of codec ("lz4" or "zstd"); DecodeError, naming the library's package, without it."""
    library, package, symbol, argtypes, restype = CODECS[codec]
    if codec not in SYSTEM:
        try:
            fn = getattr(ctypes.CDLL(ctypes.util.find_library(codec) or library), symbol)
            fn.argtypes, fn.restype = argtypes, restype
        except (OSError, AttributeError):
            fn = None
        SYSTEM[codec] = fn
    found = SYSTEM[codec]
    if found is None:
        raise DecodeError(f"{codec}: {library} is not in the image; add {package} to the recipe's os_packages")
    return found


def lz4_decode(src: bytes, plain_size: int) -> bytes:
    """Decode one LZ4 block (no frame) of exactly plain_size bytes."""
    fn = system("lz4")
    if plain_size >= 2**31 or len(src) >= 2**31:  # liblz4 counts in int
        raise DecodeError("an LZ4 block says it is 2 GiB or more, which liblz4 does not decode")
    out = ctypes.create_string_buffer(max(plain_size, 1))
    if fn(src, out, len(src), plain_size) != plain_size:
        raise DecodeError("an LZ4 block does not decode to the size its header says")
    return out.raw[:plain_size]


def zstd_decode(src: bytes, plain_size: int) -> bytes:
    """Decode zstd frames (skippable ones skipped) of exactly plain_size bytes."""
    fn = system("zstd")
    buf = ctypes.create_string_buffer(max(plain_size, 1))
    got = fn(buf, plain_size, src, len(src))
    if got > plain_size:  # a libzstd error code (a size_t near 2**64), also for more than the room
        raise DecodeError("zstd: the payload is not whole zstd frames of the size its header says")
    if got != plain_size:
        raise DecodeError("a zstd payload does not decode to the size its header says")
    return buf.raw[:plain_size]
