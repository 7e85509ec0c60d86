"""The device code a CUDA extension carries, read from its fat binaries without a GPU or CUDA.

Stdlib only: it runs inside images, under kernels.py, and the host imports it to read wheels.

A CUDA extension (`*.so`) carries its device code in the ELF section `.nv_fatbin`: one or more
fat-binary containers (magic 0xBA55ED50), each a list of entries. An entry header gives the kind
(PTX or an ELF cubin), the SM arch and flags; from CUDA 12.9 the flags also mark an
arch-specific target (`sm_120a`, `compute_120a`) and a family target (`sm_120f`). Those facts
were read from kernels compiled here with nvcc 13.0 for every target kind and compared with
`cuobjdump --list-elf/--list-ptx` (tests/fixtures/kernels); cuobjdump names a family cubin
plain `sm_120`. With nvcc 13.0 the cubin's own ELF e_flags are the same for all three kinds, so
there the entry header is the one place the kind is written; CUDA 12.x output (vLLM's wheels)
also marks an arch-specific cubin in e_flags, which is read as well.

The kernel names an entry holds are a cubin's ELF sections `.text.<mangled name>` and PTX's
`.entry <mangled name>`. A payload may be compressed: LZ4 block format (flag 0x2000, CUDA 12.x;
decoded here) or zstd (flag 0x8000, CUDA 13; no stdlib decoder before Python 3.14, so those
kernel names are unknown).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTION = ".nv_fatbin"
ELF_MAGIC = b"\x7fELF"
ELFCLASS64, ELFDATA2LSB, SHT_NOBITS = 2, 1, 8

KIND_PTX, KIND_CUBIN = 1, 2
# Entry flags: read from nvcc 13.0's own output (see the module docstring).
FLAG_ARCH_SPECIFIC = 0x100000   # sm_120a / compute_120a
FLAG_FAMILY = 0x200000          # sm_120f / compute_120f
FLAG_LZ4, FLAG_ZSTD = 0x2000, 0x8000
FLAG_COMPRESSED = FLAG_LZ4 | FLAG_ZSTD
# The cubin's ELF e_flags mark of an arch-specific target (CUDA 12.x output, read from vLLM
# 0.17.0's _C): bit 0x800 up to ELF ABI version 7 (sm_90a 0xd00, sm_90 0x500), bit 0x8 from
# version 8 (sm_100a and sm_120a 0xa, plain 0x2). nvcc 13.0 sets neither.
EF_ARCH_SPECIFIC_OLD, EF_ARCH_SPECIFIC_V8 = 0x800, 0x8

PLAIN, ARCH_SPECIFIC, FAMILY, UNKNOWN = "", "a", "f", "?"
TARGET_RE = re.compile(r"\A(sm|compute)_([0-9]+)([af?]?)\Z")


class FatbinError(ValueError):
    """A file that claims to hold device code and cannot be read."""


@dataclass(frozen=True, order=True)
class Target:
    """One piece of device code: a cubin (SASS) or PTX for an arch, plain, `a`, `f` or unknown."""

    kind: str      # "cubin" | "ptx"
    arch: int      # 120 for sm_120
    variant: str   # PLAIN | ARCH_SPECIFIC | FAMILY | UNKNOWN

    @property
    def name(self) -> str:
        return f"{'sm' if self.kind == 'cubin' else 'compute'}_{self.arch}{self.variant}"

    @classmethod
    def parse(cls, name: str) -> "Target":
        m = TARGET_RE.match(name)
        if not m:
            raise ValueError(f"not a target name: {name!r}")
        return cls("cubin" if m.group(1) == "sm" else "ptx", int(m.group(2)), m.group(3))



def _sections(data) -> list[tuple[str, int, int, int]]:
    """(name, type, offset, size) of every section of a 64-bit little-endian ELF."""
    if len(data) < 64 or data[:4] != ELF_MAGIC:
        raise FatbinError("not an ELF file")
    if data[4] != ELFCLASS64 or data[5] != ELFDATA2LSB:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shnum == 0:
        return []
    if shentsize < 64 or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise FatbinError("its section headers lie outside the file")
    raw = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    _, _, _, _, stroff, strsize = raw[shstrndx]
    if stroff + strsize > len(data):
        raise FatbinError("its section name table lies outside the file")
    out = []
    for name, typ, _flags, _addr, off, size in raw:
        if name >= strsize:
            raise FatbinError("a section name lies outside the name table")
        end = data.find(b"\0", stroff + name, stroff + strsize)
        label = bytes(data[stroff + name:end if end >= 0 else stroff + strsize]).decode("latin-1")
        if typ != SHT_NOBITS and off + size > len(data):
            raise FatbinError(f"section {label} lies outside the file")
        out.append((label, typ, off, size))
    return out


@dataclass(frozen=True)
class Entry:
    """One fat-binary entry: its target and where its payload lies (flags say how it is packed)."""

    target: Target
    offset: int
    size: int
    flags: int
    plain_size: int  # the payload's size once decompressed (0 when the header does not say)


def _entry(data, pos: int, end: int) -> tuple[Entry | None, int]:
    """The entry at pos (None for a kind that is neither PTX nor a cubin) and where the next
    entry starts. Header: kind u16, version u16, header size u32, payload size u64, compressed
    size u32 (at 16), arch u32 (at 28), flags u64 (at 40), decompressed size u64 (at 56)."""
    if pos + 48 > end:
        raise FatbinError("a fat-binary entry header is cut short")
    kind, _version, header_size, size = struct.unpack_from("<HHIQ", data, pos)
    packed, = struct.unpack_from("<I", data, pos + 16)
    arch, = struct.unpack_from("<I", data, pos + 28)
    flags, = struct.unpack_from("<Q", data, pos + 40)
    plain_size = struct.unpack_from("<Q", data, pos + 56)[0] if header_size >= 64 else 0
    if header_size < 48 or pos + header_size + size > end:
        raise FatbinError("a fat-binary entry runs past its container")
    nxt = pos + header_size + size
    if kind not in (KIND_PTX, KIND_CUBIN):
        return None, nxt
    a, f = bool(flags & FLAG_ARCH_SPECIFIC), bool(flags & FLAG_FAMILY)
    variant = UNKNOWN if a and f else ARCH_SPECIFIC if a else FAMILY if f else PLAIN
    if kind == KIND_CUBIN and not flags & FLAG_COMPRESSED:
        variant = _checked_cubin(data, pos + header_size, size, arch, variant)
    payload = packed if flags & FLAG_COMPRESSED and 0 < packed <= size else size
    target = Target("cubin" if kind == KIND_CUBIN else "ptx", arch, variant)
    return Entry(target, pos + header_size, payload, flags, plain_size), nxt


def _checked_cubin(data, pos: int, size: int, arch: int, variant: str) -> str:
    """An uncompressed cubin must be a CUDA ELF (EM_CUDA) of the arch its header names; one that
    is not keeps its arch but loses its kind (UNKNOWN), so it only ever counts for its own arch.
    A cubin is arch-specific when its entry header or its e_flags say so (nvcc 13.0 writes the
    mark in the header only, CUDA 12.x in both)."""
    if size < 64 or data[pos:pos + 4] != ELF_MAGIC:
        return UNKNOWN
    machine, = struct.unpack_from("<H", data, pos + 0x12)
    e_flags, = struct.unpack_from("<I", data, pos + 0x30)
    abi_version = data[pos + 8]
    # The SM number sits in e_flags' low byte up to ELF ABI version 7, in the second from version 8.
    if abi_version >= 8:
        sm, specific = (e_flags >> 8) & 0xFF, bool(e_flags & EF_ARCH_SPECIFIC_V8)
    else:
        sm, specific = e_flags & 0xFF, bool(e_flags & EF_ARCH_SPECIFIC_OLD)
    if machine != 190 or sm != arch % 256:
        return UNKNOWN
    if specific and variant == PLAIN:
        return ARCH_SPECIFIC
    if specific and variant == FAMILY:
        return UNKNOWN
    return variant


def _entries(data, start: int, end: int) -> list[Entry]:
    """Every entry of the fat-binary containers laid end to end in data[start:end]; zero padding
    between containers comes in steps of 8 bytes."""
    found: list[Entry] = []
    pos = start
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            if any(data[pos:pos + 8]):
                raise FatbinError(f"no fat-binary header at offset {pos:#x}")
            pos += 8
            continue
        body, stop = pos + header_size, pos + header_size + fat_size
        if header_size < 16 or stop > end:
            raise FatbinError(f"the fat binary at offset {pos:#x} runs past its section")
        while body < stop:
            entry, body = _entry(data, body, stop)
            if entry is not None:
                found.append(entry)
        pos = stop
    return found


def _system_lz4():
    """The system's liblz4 (Debian and Ubuntu ship it with apt), or None: it decodes in C what
    lz4_block decodes in Python, about 100 times faster."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("lz4")
    try:
        lib = ctypes.CDLL(name or "liblz4.so.1")
        fn = lib.LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_LZ4 = []


def lz4_decode(src, plain_size: int) -> bytes:
    """Decode one LZ4 block with the system's liblz4 when there is one, else in Python."""
    if not _LZ4:
        _LZ4.append(_system_lz4())
    fn = _LZ4[0]
    if fn is None or plain_size >= 2**31 or len(src) >= 2**31:
        return lz4_block(src, plain_size)
    import ctypes

    out = ctypes.create_string_buffer(plain_size)
    got = fn(bytes(src), out, len(src), plain_size)
    if got != plain_size:
        raise FatbinError("an LZ4 block does not decode to the size its header says")
    return out.raw


def _lz4_length(src: bytes, i: int, length: int) -> tuple[int, int]:
    """An LZ4 length of 15 continues in the bytes at i, each added, until one is below 255: (length, next i)."""
    b = 255
    while b == 255:
        b = src[i]
        i += 1
        length += b
    return length, i


def lz4_block(src, plain_size: int) -> bytes:
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
                raise FatbinError("an LZ4 block does not decode to the size its header says")
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
                raise FatbinError("an LZ4 block does not decode to the size its header says")
            if offset >= length:
                out[o:o + length] = out[begin:begin + length]
            else:  # the match overlaps what it writes: the last `offset` bytes repeat
                out[o:o + length] = (out[begin:o] * (length // offset + 1))[:length]
            o += length
    except IndexError:
        raise FatbinError("an LZ4 block is cut short") from None
    if o != plain_size:
        raise FatbinError("an LZ4 block does not decode to the size its header says")
    return bytes(out)


PTX_ENTRY_RE = re.compile(rb"\.entry\s+([A-Za-z_$][A-Za-z0-9_$.]*)")


def _payload(data, entry: Entry) -> bytes | None:
    """The entry's payload as written by nvcc, or None when it is zstd (no stdlib decoder)."""
    raw = data[entry.offset:entry.offset + entry.size]
    if entry.flags & FLAG_ZSTD:
        return None
    if entry.flags & FLAG_LZ4:
        return lz4_decode(raw, entry.plain_size)
    return bytes(raw)


def kernel_names(data, entry: Entry) -> frozenset[str] | None:
    """The kernels an entry holds (mangled names), or None when they cannot be read."""
    payload = _payload(data, entry)
    if payload is None:
        return None
    if entry.target.kind == "ptx":
        return frozenset(m.decode("latin-1") for m in PTX_ENTRY_RE.findall(payload))
    try:
        sections = _sections(payload)
    except (FatbinError, struct.error):
        return None
    return frozenset(name[len(".text."):] for name, *_ in sections if name.startswith(".text."))


def open_fatbins(path: Path):
    """(file, mmap, [Entry]) of an ELF file's fat binaries, or None when it has no device code."""
    fh = open(path, "rb")
    try:
        if fh.read(4) != ELF_MAGIC:
            fh.close()
            return None
        if os.fstat(fh.fileno()).st_size < 64:
            raise FatbinError("an ELF file cut short")
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except BaseException:
        fh.close()
        raise
    try:
        sections = [s for s in _sections(data) if s[0] == FATBIN_SECTION and s[1] != SHT_NOBITS]
        entries = [e for _, _, off, size in sections for e in _entries(data, off, off + size)]
    except BaseException:
        data.close()
        fh.close()
        raise
    if not sections:
        data.close()
        fh.close()
        return None
    return fh, data, entries


def read_targets(path: Path) -> list[Target] | None:
    """The device code an ELF file carries (sorted, without repeats), or None when it has none
    (not ELF, or no fat binary). Raises FatbinError for an ELF file that cannot be read."""
    opened = open_fatbins(path)
    if opened is None:
        return None
    fh, data, entries = opened
    with fh, data:
        return sorted({e.target for e in entries}, key=lambda t: (t.kind, t.arch, t.variant))
