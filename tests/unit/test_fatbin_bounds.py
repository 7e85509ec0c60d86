"""The fat-binary reader trusts no size the file gives (sparkforge/inimage/fatbin.py): damaged, cut and
hostile copies of real nvcc output are one line naming what is wrong, within a memory and a time
limit, and the check of the other files goes on."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from sparkforge.inimage import fatbin, kernels
from sparkforge.inimage.fatbin import FATBIN_MAGIC, FatbinError
from tests.support.fatbins import fuzz, limited
from tests.support.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "kernels"
MAGIC = struct.pack("<I", FATBIN_MAGIC)


def with_fatbin(base: bytes, path: Path, pieces: list[bytes | int]) -> Path:
    """Write base to path with its `.nv_fatbin` section moved to the end of the file and made of
    pieces (bytes, or a count of zero bytes left as a hole), the section headers after it."""
    shoff, = struct.unpack_from("<Q", base, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", base, 0x3A)
    index = next(i for i, (name, *_) in enumerate(fatbin.sections(base)) if name == fatbin.FATBIN_SECTION)
    headers = bytearray(base[shoff:shoff + shnum * shentsize])
    start = (len(base) + 7) // 8 * 8
    with path.open("wb") as out:
        out.write(base)
        out.seek(start)
        for piece in pieces:
            if isinstance(piece, int):
                out.seek(piece, 1)
            else:
                out.write(piece)
        end = (out.tell() + 7) // 8 * 8
        struct.pack_into("<QQ", headers, index * shentsize + 0x18, start, out.tell() - start)
        out.seek(end)
        out.write(headers)
        out.seek(0x28)
        out.write(struct.pack("<Q", end))
    return path


def containers(name: str) -> bytes:
    """The `.nv_fatbin` section of a fixture, as it is."""
    data = (FIXTURES / name).read_bytes()
    (_, _, off, size), = [s for s in fatbin.sections(data) if s[0] == fatbin.FATBIN_SECTION]
    return data[off:off + size]


def first_entry(section: bytes) -> int:
    """Where the first entry header of the first container starts."""
    assert section[:4] == MAGIC
    return struct.unpack_from("<H", section, 6)[0]


def _one_line_error(path: Path) -> str:
    with pytest.raises(FatbinError) as info:
        code = fatbin.open_device_code(path)
        with code:
            for entry in code.entries:
                code.kernel_names(entry)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_an_entry_header_cut_at_the_end_of_its_container(tmp_path):
    section = bytearray(containers("sm90.so"))
    at = first_entry(section)
    struct.pack_into("<Q", section, 8, at - 16 + 20)  # the container ends 20 bytes into its first entry
    path = with_fatbin((FIXTURES / "sm90.so").read_bytes(), tmp_path / "cut.so", [bytes(section[:at + 20])])
    assert "cut short" in _one_line_error(path)


@pytest.mark.parametrize("claim", [2**62, 2**31, fatbin.MAX_PLAIN + 1])
def test_a_compressed_entry_that_claims_too_much_is_refused_before_decoding(tmp_path, claim):
    section = bytearray(containers("two_lz4.so"))
    at = first_entry(section)
    struct.pack_into("<Q", section, at + 56, claim)  # the decompressed size of the first entry
    path = with_fatbin((FIXTURES / "two_lz4.so").read_bytes(), tmp_path / "big.so", [bytes(section)])
    message = _one_line_error(path)
    assert f"says it decodes to {claim} bytes" in message and "at offset 0x" in message
    record = kernels.scan([path, FIXTURES / "two.so"], ["12.1"])
    bad, good = record.extensions
    assert bad.error and "decodes to" in bad.error and good.error is None and good.coverage["12.1"].missing == 1


@pytest.mark.parametrize("name", ["two_lz4.so", "two_zstd.so"])
def test_a_payload_that_decodes_to_more_than_its_header_says_stops_there(tmp_path, name):
    section = bytearray(containers(name))
    at = first_entry(section)
    plain, = struct.unpack_from("<Q", section, at + 56)
    struct.pack_into("<Q", section, at + 56, plain // 2)
    path = with_fatbin((FIXTURES / name).read_bytes(), tmp_path / "more.so", [bytes(section)])
    assert "the size its header says" in _one_line_error(path)


def test_more_entries_than_a_real_library_holds(tmp_path):
    entry = struct.pack("<HHIQ", fatbin.KIND_PTX, 0x101, 48, 0) + bytes(32)  # an empty PTX entry, 48 bytes
    count = fatbin.MAX_ENTRIES + 1
    section = MAGIC + struct.pack("<HHQ", 1, 16, 48 * count) + entry * count
    path = with_fatbin((FIXTURES / "sm90.so").read_bytes(), tmp_path / "many.so", [section])
    assert f"more than {fatbin.MAX_ENTRIES}" in _one_line_error(path)


def test_four_gib_of_padding_is_skipped_in_bulk(tmp_path):
    """A section of 4 GiB of zeros (a hole in a sparse file) and 64 MiB of written zeros before real
    containers: read in seconds (reading 8 bytes a step took 35 CPU-seconds a GiB)."""
    path = with_fatbin((FIXTURES / "sm90.so").read_bytes(), tmp_path / "padded.so",
                       [4 << 30, bytes(64 << 20), containers("sm90.so")])
    proc = limited(f"print(sorted(t.name for t in fatbin.read_targets(Path({str(path)!r}))))", cpu=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['sm_90']"


def test_garbage_where_padding_should_be_names_the_offset(tmp_path):
    section = containers("sm90.so")
    path = with_fatbin((FIXTURES / "sm90.so").read_bytes(), tmp_path / "junk.so",
                       [section, bytes(4096), b"\x01" + bytes(15)])
    assert "no fat-binary header at offset" in _one_line_error(path)


# ------------------------------------------------------------------ fuzzed and truncated real binaries


def test_fuzzed_and_truncated_fixtures(tmp_path):
    sources = sorted(p for p in FIXTURES.glob("*.so") if p.name != "host_only.so")
    result = fuzz(sources, tmp_path, 240, seed=29, cpu=120)
    errors = [e for e in result["record"]["extensions"] if e["error"]]
    read = [e for e in result["record"]["extensions"] if not e["error"]]
    assert errors and read  # the damage was found where it was done, and the rest was read
