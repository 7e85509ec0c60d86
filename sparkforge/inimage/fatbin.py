"""The device code a CUDA extension carries, read from its fat binaries without a GPU or CUDA (stdlib only).

A CUDA extension keeps its device code in the ELF section `.nv_fatbin` (relocatable code of `nvcc -rdc`, nvlink's
input, in `__nv_relfatbin`): fat-binary containers (magic 0xBA55ED50), each a list of entries whose header gives
the kind (PTX or an ELF cubin), the SM arch and flags. From CUDA 12.9 the flags also mark an arch-specific
(`sm_120a`) and a family (`sm_120f`) target; with nvcc 13.0 that header is the one place the kind is written,
while CUDA 12.x output also marks an arch-specific cubin in its ELF e_flags, read as well. These facts were read
from nvcc 13.0's output for every target kind against `cuobjdump` (tests/fixtures/kernels). A kernel's name is a
cubin's section `.text.<mangled name>` or PTX's `.entry <mangled name>`; a payload may be LZ4 (flag 0x2000, CUDA
12.x) or zstd (flag 0x8000, CUDA 13) compressed. Every offset, length, entry count and decoded size is checked
against the file and the limits below before use: a damaged or hostile file is a FatbinError, never a guess.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from struct import unpack_from
from typing import Any

from .decompress import DecodeError, lz4_decode, zstd_decode

FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTION, RELOCATABLE_SECTION = ".nv_fatbin", "__nv_relfatbin"
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

# Limits, from the largest CUDA library read here, torch 2.14.0's libtorch_cuda.so (aarch64, 461 MB):
# 2,558 entries; its largest entry (an sm_100 cubin) decodes to 42,284,232 bytes; the entries of
# one major (sm_100, sm_100a, sm_103f), the most a check of one GPU can need, to 1,239,579,456.
MAX_ENTRIES = 100_000          # per file, ~40 times that
MAX_PLAIN = 256 << 20          # one entry's decoded size, 6 times that
MAX_DECODED = 2 << 30          # all that one file's check decodes, 1.7 times that
_CHUNK = 1 << 20               # padding is read a MiB at a time
SEEK_DATA = getattr(os, "SEEK_DATA", os.SEEK_SET)  # Linux: the next byte that is not in a hole
_NONZERO = re.compile(rb"[^\x00]")

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
    def parse(cls, name: str) -> Target:
        m = TARGET_RE.match(name)
        if not m:
            raise ValueError(f"not a target name: {name!r}")
        return cls("cubin" if m.group(1) == "sm" else "ptx", int(m.group(2)), m.group(3))


# ------------------------------------------------------------------ ELF


def sections(data: Any) -> list[tuple[str, int, int, int]]:
    """(name, type, offset, size) of every section of a 64-bit little-endian ELF, each checked to lie inside it
    (extended section numbering too: a cubin with many kernels may have over 65,279 sections)."""
    size = len(data)
    if size < 64 or data[:4] != ELF_MAGIC:
        raise FatbinError("not an ELF file")
    if data[4] != ELFCLASS64 or data[5] != ELFDATA2LSB:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = unpack_from("<HHH", data, 0x3A)
    if shoff == 0:
        return []
    if shentsize < 64 or shoff > size - 64:
        raise FatbinError("its section headers lie outside the file")
    if shnum == 0:  # extended numbering: the count is section 0's sh_size
        shnum, = unpack_from("<Q", data, shoff + 32)
    if shstrndx == 0xFFFF:  # SHN_XINDEX: the index is section 0's sh_link
        shstrndx, = unpack_from("<I", data, shoff + 40)
    if shnum == 0:
        return []
    if shnum > (size - shoff) // shentsize or shstrndx >= shnum:
        raise FatbinError("its section headers lie outside the file")
    raw = [unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    _, _, _, _, stroff, strsize = raw[shstrndx]
    if stroff > size or strsize > size - stroff:
        raise FatbinError("its section name table lies outside the file")
    out = []
    for name, typ, _flags, _addr, off, length in raw:
        if name >= strsize:
            raise FatbinError("a section name lies outside the name table")
        end = data.find(b"\0", stroff + name, stroff + strsize)
        label = bytes(data[stroff + name:end if end >= 0 else stroff + strsize]).decode("latin-1")
        if typ != SHT_NOBITS and (off > size or length > size - off):
            raise FatbinError(f"section {label} lies outside the file")
        out.append((label, typ, off, length))
    return out


# ------------------------------------------------------------------ fat-binary entries


@dataclass(frozen=True)
class Entry:
    """One fat-binary entry: its target and where its payload lies (flags say how it is packed)."""

    target: Target
    offset: int
    size: int
    flags: int
    plain_size: int    # the payload's size once decompressed (0 when the header does not say)
    container: int     # the offset of its container: one container per compiled file
    relocatable: bool  # in __nv_relfatbin: nvlink's input, never loaded from this file

    @property
    def where(self) -> str:
        kind = "cubin" if self.target.kind == "cubin" else "PTX"
        return f"the {self.target.name} {kind} at offset {self.offset:#x}"


def _entry(data: Any, pos: int, end: int, container: int, relocatable: bool) -> tuple[Entry | None, int]:
    """The entry at pos (None: neither PTX nor a cubin) and where the next starts. Header: kind u16, version u16,
    header size u32, payload size u64, packed size u32 @16, arch u32 @28, flags u64 @40, plain size u64 @56."""
    if end - pos < 48:
        raise FatbinError(f"a fat-binary entry header at offset {pos:#x} is cut short")
    kind, _version, header_size, size, packed, arch, flags = unpack_from("<HHIQI8xI8xQ", data, pos)
    if header_size < 48 or header_size > end - pos or size > end - pos - header_size:
        raise FatbinError(f"the fat-binary entry at offset {pos:#x} runs past its container")
    plain_size = unpack_from("<Q", data, pos + 56)[0] if header_size >= 64 else 0
    nxt = pos + header_size + size
    if kind not in (KIND_PTX, KIND_CUBIN):
        return None, nxt
    a, f = bool(flags & FLAG_ARCH_SPECIFIC), bool(flags & FLAG_FAMILY)
    variant = UNKNOWN if a and f else ARCH_SPECIFIC if a else FAMILY if f else PLAIN
    if kind == KIND_CUBIN and not flags & FLAG_COMPRESSED:
        variant = _checked_cubin(data, pos + header_size, size, arch, variant)
    payload = packed if flags & FLAG_COMPRESSED and 0 < packed <= size else size
    target = Target("cubin" if kind == KIND_CUBIN else "ptx", arch, variant)
    return Entry(target, pos + header_size, payload, flags, plain_size, container, relocatable), nxt


def _checked_cubin(data: Any, pos: int, size: int, arch: int, variant: str) -> str:
    """A cubin's variant: UNKNOWN (it counts for its own arch only) unless it is a CUDA ELF of the arch its
    header names; arch-specific when its header or its e_flags say so (nvcc 13.0 marks the header only)."""
    if size < 64 or data[pos:pos + 4] != ELF_MAGIC:
        return UNKNOWN
    machine, = unpack_from("<H", data, pos + 0x12)
    e_flags, = unpack_from("<I", data, pos + 0x30)
    abi_version = data[pos + 8]
    # The SM number sits in e_flags' low byte up to ELF ABI version 7, in the second from version 8.
    if abi_version >= 8:
        sm, specific = (e_flags >> 8) & 0xFF, bool(e_flags & EF_ARCH_SPECIFIC_V8)
    else:
        sm, specific = e_flags & 0xFF, bool(e_flags & EF_ARCH_SPECIFIC_OLD)
    if machine != 190 or sm != arch % 256:
        return UNKNOWN
    return {PLAIN: ARCH_SPECIFIC, FAMILY: UNKNOWN}.get(variant, variant) if specific else variant


def _skip_zeros(fd: int, pos: int, end: int) -> int:
    """The first position pos + 8k before end whose 8 bytes are not all zero, or end: padding read a MiB at a
    time and a sparse file's holes skipped unread (4 GiB of it takes seconds, not minutes)."""
    while end - pos >= 8:
        try:
            data_at = os.lseek(fd, pos, SEEK_DATA)
        except OSError as exc:  # ENXIO: a hole up to the end of the file
            data_at = end if exc.errno == errno.ENXIO else pos
        step = (min(data_at, end) - pos) // 8 * 8
        if step:
            pos += step
            continue
        n = min(_CHUNK, end - pos)
        chunk = os.pread(fd, n, pos)
        if len(chunk) != n:
            raise FatbinError("the file changed while it was read")
        m = _NONZERO.search(chunk)
        if m is not None:
            return pos + m.start() // 8 * 8
        pos += n
    return end


def _entries(data: Any, fd: int, start: int, end: int, relocatable: bool, found: list[Entry]) -> None:
    """Append to found every entry of the containers laid end to end (zero padding between) in data[start:end]."""
    pos = start
    while end - pos >= 16:
        magic, _version, header_size, fat_size = unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            nxt = _skip_zeros(fd, pos, end)
            if nxt == pos:
                raise FatbinError(f"no fat-binary header at offset {pos:#x}")
            pos = nxt
            continue
        if header_size < 16 or header_size > end - pos or fat_size > end - pos - header_size:
            raise FatbinError(f"the fat binary at offset {pos:#x} runs past its section")
        body, stop = pos + header_size, pos + header_size + fat_size
        while body < stop:
            entry, body = _entry(data, body, stop, pos, relocatable)
            if entry is not None:
                found.append(entry)
                if len(found) > MAX_ENTRIES:
                    raise FatbinError(f"it holds more than {MAX_ENTRIES} fat-binary entries")
        pos = stop


# ------------------------------------------------------------------ an ELF file's device code


PTX_ENTRY_RE = re.compile(rb"\.entry\s+([A-Za-z_$][A-Za-z0-9_$.]*)")


class DeviceCode:
    """An ELF file's fat-binary entries and the file mapped; `decoded` counts bytes decompressed, up to MAX_DECODED."""

    def __init__(self, fd: int, data: mmap.mmap, entries: list[Entry]) -> None:
        self._fd, self.data, self.entries, self.decoded = fd, data, entries, 0

    def __enter__(self) -> DeviceCode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.data.close()
        os.close(self._fd)

    def payload(self, entry: Entry) -> bytes:
        """The entry's payload as nvcc wrote it, decompressed."""
        raw = self.data[entry.offset:entry.offset + entry.size]
        if not entry.flags & FLAG_COMPRESSED:
            return raw
        plain = entry.plain_size
        if plain == 0:
            raise FatbinError(f"{entry.where} is compressed, and its header gives no decoded size")
        if plain > MAX_PLAIN:
            raise FatbinError(f"{entry.where} says it decodes to {plain} bytes, more than the {MAX_PLAIN} "
                              "any entry of a real CUDA library does")
        if self.decoded + plain > MAX_DECODED:
            raise FatbinError(f"its entries to read decode to more than {MAX_DECODED} bytes")
        self.decoded += plain
        try:
            return lz4_decode(raw, plain) if entry.flags & FLAG_LZ4 else zstd_decode(raw, plain)
        except DecodeError as exc:
            raise FatbinError(f"{entry.where}: {exc}") from None
        except MemoryError:
            raise FatbinError(f"{entry.where}: out of memory decoding {plain} bytes") from None

    def kernel_names(self, entry: Entry) -> frozenset[str] | None:
        """The kernels an entry holds (mangled names), or None for a cubin that is no ELF file."""
        payload = self.payload(entry)
        if entry.target.kind == "ptx":
            return frozenset(m.decode("latin-1") for m in PTX_ENTRY_RE.findall(payload))
        try:
            found = sections(payload)
        except FatbinError:
            return None
        return frozenset(name[len(".text."):] for name, *_ in found if name.startswith(".text."))


def open_device_code(path: Path) -> DeviceCode | None:
    """An ELF file's fat binaries, or None when it has none (not a regular ELF file, or no fat-binary section)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # never waits on a FIFO
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or os.pread(fd, 4, 0) != ELF_MAGIC:
            os.close(fd)
            return None
        if info.st_size < 64:
            raise FatbinError("an ELF file cut short")
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except BaseException:
        os.close(fd)
        raise
    code = DeviceCode(fd, data, [])
    try:
        found = [s for s in sections(data) if s[0] in (FATBIN_SECTION, RELOCATABLE_SECTION) and s[1] != SHT_NOBITS]
        for name, _typ, off, size in found:
            _entries(data, fd, off, off + size, name == RELOCATABLE_SECTION, code.entries)
    except BaseException as exc:
        code.close()
        if isinstance(exc, MemoryError):
            raise FatbinError("out of memory reading its fat-binary entries") from None
        raise
    if not found:
        code.close()
        return None
    return code


def read_targets(path: Path, relocatable: bool = False) -> list[Target] | None:
    """The targets an ELF file carries to be loaded (or its relocatable ones), sorted; None without a fat binary."""
    code = open_device_code(path)
    if code is None:
        return None
    with code:
        return sorted({e.target for e in code.entries if e.relocatable == relocatable})
