"""The stdlib zstd decoder (sparkforge/inimage/zstd.py) against the real encoder: frames libzstd
writes at every strategy decode to the same bytes; cut, damaged and hostile frames are a ZstdError
and nothing else, within the output cap."""

from __future__ import annotations

import ctypes
import ctypes.util
import random
import struct

import pytest

from sparkforge.inimage import zstd
from sparkforge.inimage.zstd import ZstdError
from tests.support.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "kernels"


def _libzstd() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
    except OSError:
        return None
    lib.ZSTD_compress.restype = lib.ZSTD_compressBound.restype = ctypes.c_size_t
    lib.ZSTD_compress.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    lib.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    return lib


LIB = _libzstd()
needs_libzstd = pytest.mark.needs("libzstd")  # to compress with


def compress(data: bytes, level: int) -> bytes:
    assert LIB is not None
    bound = LIB.ZSTD_compressBound(len(data))
    out = ctypes.create_string_buffer(bound)
    n = LIB.ZSTD_compress(out, bound, data, len(data), level)
    assert not LIB.ZSTD_isError(n)
    return out.raw[:n]


def samples() -> list[bytes]:
    rnd = random.Random(8878)
    text = (ROOT / "sparkforge" / "inimage" / "kernels.py").read_bytes()
    return [b"", b"a", b"abc" * 1000, bytes(range(256)) * 40, rnd.randbytes(5000),
            (FIXTURES / "mixed.so").read_bytes(),                       # a host library with cubins in it
            text * 3,                                                   # text: Huffman-coded literals
            bytes(rnd.choice(b"ACGT") for _ in range(300_000)),        # several blocks, few symbols
            bytes(200_000) + b"x" + bytes(70_000)]                     # RLE blocks


@needs_libzstd
@pytest.mark.parametrize("level", [-5, 1, 3, 9, 19])
def test_frames_of_every_strategy_decode_as_libzstd_wrote_them(level):
    for data in samples():
        frame = compress(data, level)
        assert zstd.decompress(frame, len(data)) == data


@needs_libzstd
def test_output_comes_a_block_at_a_time_and_stops_at_the_cap():
    data = samples()[7]
    frame = compress(data, 3)
    pieces = list(zstd.blocks(frame, len(data)))
    assert len(pieces) > 2 and max(map(len, pieces)) <= zstd.BLOCK_MAX and b"".join(pieces) == data
    with pytest.raises(ZstdError, match="says it decodes to 300000 bytes, past the limit"):
        next(zstd.blocks(frame, len(data) - 1))


def test_a_frame_without_its_size_stops_at_the_cap():
    """A frame that does not say its size (a raw block of 100 bytes, then RLE blocks of 128 KiB
    each) decodes no further than the cap."""
    frame = struct.pack("<I", zstd.MAGIC) + bytes([0x00, 0x00])  # no size, window descriptor
    frame += struct.pack("<I", 100 << 3)[:3] + bytes(100)        # a raw block
    rle = struct.pack("<I", (zstd.BLOCK_MAX << 3) | 2)[:3] + b"z"
    frame += rle * 1000 + struct.pack("<I", (1 << 3) | 2 | 1)[:3] + b"z"
    out = zstd.blocks(frame, 300_000)
    assert len(next(out)) == 100 and len(next(out)) == zstd.BLOCK_MAX and len(next(out)) == zstd.BLOCK_MAX
    with pytest.raises(ZstdError, match="more than its limit of 300000 bytes"):
        next(out)


def test_skippable_frames_and_two_frames():
    skip = struct.pack("<II", 0x184D2A53, 3) + b"abc"
    frame = struct.pack("<I", zstd.MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (5 << 3) | 1)[:3] + b"hello"
    assert zstd.decompress(skip + frame + frame, 10) == b"hellohello"
    with pytest.raises(ZstdError, match="limit"):
        zstd.decompress(frame + frame, 9)


@pytest.mark.parametrize("bad, message", [
    (b"", "no zstd frame"),
    (b"\x28\xb5\x2f", "cut short"),
    (b"PK\x03\x04", "bad magic"),
    (struct.pack("<I", zstd.MAGIC) + bytes([0x23, 1, 2, 3, 4, 5]), "dictionary"),
    (struct.pack("<I", zstd.MAGIC) + bytes([0x28]), "reserved bit"),
    (struct.pack("<I", zstd.MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (5 << 3) | 7)[:3], "reserved type"),
    (struct.pack("<I", zstd.MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (5 << 3) | 1)[:3] + b"hell", "cut short"),
    # a compressed block of one byte whose literals header says it takes two, and three
    (struct.pack("<I", zstd.MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (1 << 3) | 5)[:3] + b"\x04", "cut short"),
    (struct.pack("<I", zstd.MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (1 << 3) | 5)[:3] + b"\x0c", "cut short"),
    (struct.pack("<I", zstd.MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (2 << 3) | 5)[:3] + b"\x0c\x00", "cut short"),
])
def test_input_that_is_not_a_whole_frame_is_one_error(bad, message):
    with pytest.raises(ZstdError, match=message):
        zstd.decompress(bad, 1 << 20)


def _frames() -> list[bytes]:
    """Real frames: nvcc 13.0's (the fixtures' zstd entries) and libzstd's at two levels."""
    from sparkforge.inimage import fatbin

    found = []
    for name in ("two_zstd.so", "mixed_compressed.so", "sm120_ptx_compressed.so", "rdc.so"):
        with fatbin.open_device_code(FIXTURES / name) as code:
            found += [code.data[e.offset:e.offset + e.size] for e in code.entries if e.flags & fatbin.FLAG_ZSTD]
    if LIB is not None:
        found += [compress(samples()[6], 3), compress(samples()[5], 19)]
    return found


def test_every_cut_of_a_real_frame_is_a_zstd_error():
    for frame in _frames()[:6]:
        for cut in range(len(frame)):
            with pytest.raises(ZstdError):
                zstd.decompress(frame[:cut], 1 << 20)


def test_damaged_real_frames_give_a_zstd_error_or_bytes_never_another_exception():
    rnd = random.Random(29)
    outcomes = {"error": 0, "bytes": 0}
    for frame in _frames():
        for _ in range(150):
            bad = bytearray(frame)
            for _ in range(rnd.randint(1, 6)):
                bad[rnd.randrange(len(bad))] = rnd.randrange(256)
            try:
                out = zstd.decompress(bytes(bad), 1 << 20)
            except ZstdError:
                outcomes["error"] += 1
            else:
                assert len(out) <= 1 << 20
                outcomes["bytes"] += 1
    assert outcomes["error"] > 100
