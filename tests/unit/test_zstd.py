"""The zstd decoder the kernel scan runs in an image (sparkforge/inimage/decompress.py: the system's
libzstd) within the bounds the scan relies on: frames of every strategy decode to their bytes and exactly
the size asked; more, less, cut, damaged and hostile frames are a DecodeError and nothing else."""

from __future__ import annotations

import ctypes
import ctypes.util
import random
import struct

import pytest

from sparkforge.inimage.decompress import DecodeError, zstd_decode
from tests.support.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "kernels"
MAGIC = 0xFD2FB528
pytestmark = pytest.mark.needs("libzstd")  # to decode, as in an image, and to compress with


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


@pytest.mark.parametrize("level", [-5, 1, 3, 9, 19])
def test_frames_of_every_strategy_decode_as_libzstd_wrote_them(level):
    for data in samples():
        frame = compress(data, level)
        assert zstd_decode(frame, len(data)) == data


def test_a_frame_that_gives_more_or_less_than_the_size_asked_is_an_error():
    data = samples()[7]
    frame = compress(data, 3)
    for size in (len(data) - 1, len(data) + 1, 0):
        with pytest.raises(DecodeError, match="size its header says"):
            zstd_decode(frame, size)


def test_a_frame_without_its_size_stops_at_the_room_given():
    """A frame that does not say its size (a raw block of 100 bytes, then RLE blocks of 128 KiB
    each, 128 MB in all) is refused once it passes the room, not decoded whole."""
    block_max = 128 * 1024
    frame = struct.pack("<I", MAGIC) + bytes([0x00, 0x00])  # no size, window descriptor
    frame += struct.pack("<I", 100 << 3)[:3] + bytes(100)    # a raw block
    rle = struct.pack("<I", (block_max << 3) | 2)[:3] + b"z"
    frame += rle * 1000 + struct.pack("<I", (1 << 3) | 2 | 1)[:3] + b"z"
    with pytest.raises(DecodeError, match="size its header says"):
        zstd_decode(frame, 300_000)


def test_skippable_frames_and_two_frames():
    skip = struct.pack("<II", 0x184D2A53, 3) + b"abc"
    frame = struct.pack("<I", MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (5 << 3) | 1)[:3] + b"hello"
    assert zstd_decode(skip + frame + frame, 10) == b"hellohello"
    with pytest.raises(DecodeError):
        zstd_decode(frame + frame, 9)


@pytest.mark.parametrize("bad", [
    b"",
    b"\x28\xb5\x2f",
    b"PK\x03\x04",
    struct.pack("<I", MAGIC) + bytes([0x23, 1, 2, 3, 4, 5]),  # a dictionary the frame names, not given
    struct.pack("<I", MAGIC) + bytes([0x28]),  # a reserved bit
    struct.pack("<I", MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (5 << 3) | 7)[:3],  # a reserved block type
    struct.pack("<I", MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (5 << 3) | 1)[:3] + b"hell",  # cut short
    # a compressed block of one byte whose literals header says it takes two, and three
    struct.pack("<I", MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (1 << 3) | 5)[:3] + b"\x04",
    struct.pack("<I", MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (1 << 3) | 5)[:3] + b"\x0c",
    struct.pack("<I", MAGIC) + bytes([0x20, 5]) + struct.pack("<I", (2 << 3) | 5)[:3] + b"\x0c\x00",
])
def test_input_that_is_not_a_whole_frame_is_one_error(bad):
    with pytest.raises(DecodeError):
        zstd_decode(bad, 5)


def _frames() -> list[tuple[bytes, int]]:
    """Real frames and the size each decodes to: nvcc 13.0's (the fixtures' zstd entries) and libzstd's at
    two levels."""
    from sparkforge.inimage import fatbin

    found = []
    for name in ("two_zstd.so", "mixed_compressed.so", "sm120_ptx_compressed.so", "rdc.so"):
        with fatbin.open_device_code(FIXTURES / name) as code:
            found += [(bytes(code.data[e.offset:e.offset + e.size]), e.plain_size) for e in code.entries
                      if e.flags & fatbin.FLAG_ZSTD]
    found += [(compress(samples()[6], 3), len(samples()[6])), (compress(samples()[5], 19), len(samples()[5]))]
    return found


def test_every_cut_of_a_real_frame_is_a_decode_error():
    for frame, size in _frames()[:6]:
        for cut in range(len(frame)):
            with pytest.raises(DecodeError):
                zstd_decode(frame[:cut], size)


def test_damaged_real_frames_give_a_decode_error_or_exactly_the_size_never_another_exception():
    rnd = random.Random(29)
    outcomes = {"error": 0, "bytes": 0}
    for frame, size in _frames():
        for _ in range(150):
            bad = bytearray(frame)
            for _ in range(rnd.randint(1, 6)):
                bad[rnd.randrange(len(bad))] = rnd.randrange(256)
            try:
                out = zstd_decode(bytes(bad), size)
            except DecodeError:
                outcomes["error"] += 1
            else:
                assert len(out) == size
                outcomes["bytes"] += 1
    assert outcomes["error"] > 100
