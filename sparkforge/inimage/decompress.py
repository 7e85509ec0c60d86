"""The decoders of compressed fat-binary entries: LZ4 blocks (CUDA 12.x) and zstd frames (CUDA 13).

Stdlib only. Each uses the system's library when there is one (liblz4, libzstd: Debian and Ubuntu
ship both), through ctypes, else a decoder in Python (lz4_block here, zstd.py). Every decoder
writes at most the room it is given and gives exactly the size the entry's header says, or raises
DecodeError.
"""

from __future__ import annotations

from typing import Any, Callable

from . import zstd


class DecodeError(ValueError):
    """A payload that does not decode to the size its header says."""


def _c_function(names: tuple[str, ...], symbol: str, argtypes: list[Any], restype: Any) -> Callable[..., Any] | None:
    """A function of a system library (the first of names ctypes finds), or None without one."""
    import ctypes
    import ctypes.util

    for name in names:
        try:
            fn = getattr(ctypes.CDLL(ctypes.util.find_library(name) or f"lib{name}.so.1"), symbol)
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = argtypes, restype
        return fn  # type: ignore[no-any-return]  # ctypes gives a library's function as Any
    return None


SYSTEM: dict[str, Callable[..., Any] | None] = {}


def system(codec: str) -> Callable[..., Any] | None:
    """The system's decoder of codec ("lz4" or "zstd"), found once: liblz4's LZ4_decompress_safe,
    libzstd's ZSTD_decompress (Debian and Ubuntu ship both). They decode in C what this module and
    zstd.py decode in Python, and write at most the room they are given."""
    import ctypes

    if codec not in SYSTEM:
        if codec == "lz4":
            SYSTEM[codec] = _c_function(("lz4",), "LZ4_decompress_safe",
                                        [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int], ctypes.c_int)
        else:
            SYSTEM[codec] = _c_function(("zstd",), "ZSTD_decompress",
                                        [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t],
                                        ctypes.c_size_t)
    return SYSTEM[codec]


def lz4_decode(src: bytes, plain_size: int) -> bytes:
    """Decode one LZ4 block of exactly plain_size bytes, with the system's liblz4 when there is one."""
    fn = system("lz4")
    if fn is None or plain_size >= 2**31 or len(src) >= 2**31:
        return lz4_block(src, plain_size)
    import ctypes

    out = ctypes.create_string_buffer(plain_size)
    if fn(src, out, len(src), plain_size) != plain_size:
        raise DecodeError("an LZ4 block does not decode to the size its header says")
    return out.raw


def zstd_decode(src: bytes, plain_size: int) -> bytes:
    """Decode zstd frames of exactly plain_size bytes, with the system's libzstd when there is one."""
    fn = system("zstd")
    if fn is None:
        try:
            out = zstd.decompress(src, plain_size)
        except zstd.ZstdError as exc:
            raise DecodeError(f"zstd: {exc}") from None
    else:
        import ctypes

        buf = ctypes.create_string_buffer(max(plain_size, 1))
        got = fn(buf, plain_size, src, len(src))
        out = buf.raw[:got] if got <= plain_size else b""
        if got > plain_size:  # a libzstd error code (a size_t near 2**64)
            raise DecodeError("zstd: the payload is not a whole zstd frame of the size its header says")
    if len(out) != plain_size:
        raise DecodeError("a zstd payload does not decode to the size its header says")
    return out


def _lz4_length(src: bytes, i: int, length: int) -> tuple[int, int]:
    """An LZ4 length of 15 continues in the bytes at i, each added, until one is below 255: (length, next i)."""
    b = 255
    while b == 255:
        b = src[i]
        i += 1
        length += b
    return length, i


def lz4_block(src: bytes, plain_size: int) -> bytes:
    """Decode one LZ4 block (no frame) that must give exactly plain_size bytes."""
    src = bytes(src)
    out = bytearray(plain_size)
    i, o, n = 0, 0, len(src)
    try:
        while True:
            token = src[i]
            i += 1
            length = token >> 4
            if length == 15:
                length, i = _lz4_length(src, i, length)
            if o + length > plain_size or i + length > n:
                raise DecodeError("an LZ4 block does not decode to the size its header says")
            out[o:o + length] = src[i:i + length]
            i += length
            o += length
            if i >= n:
                break  # the last sequence holds literals only
            offset = src[i] | src[i + 1] << 8
            i += 2
            length = token & 15
            if length == 15:
                length, i = _lz4_length(src, i, length)
            length += 4
            begin = o - offset
            if offset == 0 or begin < 0 or o + length > plain_size:
                raise DecodeError("an LZ4 block does not decode to the size its header says")
            if offset >= length:
                out[o:o + length] = out[begin:begin + length]
            else:  # the match overlaps what it writes: the last `offset` bytes repeat
                out[o:o + length] = (out[begin:o] * (length // offset + 1))[:length]
            o += length
    except IndexError:
        raise DecodeError("an LZ4 block is cut short") from None
    if o != plain_size:
        raise DecodeError("an LZ4 block does not decode to the size its header says")
    return bytes(out)
