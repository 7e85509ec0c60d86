"""Which GPUs an image's CUDA extensions can run on, read from their fat binaries without a GPU.

Stdlib only: it runs inside images (`python3 kernels.py scan ROOT... --out FILE`, then
`python3 kernels.py check --home /opt/sparkforge`), and the host imports it for the rule and the
record's format.

A CUDA extension (`*.so`) carries its device code in the ELF section `.nv_fatbin`: one or more
fat-binary containers (magic 0xBA55ED50), each a list of entries. An entry header gives the kind
(PTX or an ELF cubin), the SM arch and flags; from CUDA 12.9 the flags also mark an
arch-specific target (`sm_120a`, `compute_120a`) and a family target (`sm_120f`). Those facts
were read from kernels compiled here with nvcc 13.0 for every target kind and compared with
`cuobjdump --list-elf/--list-ptx` (tests/fixtures/kernels); cuobjdump names a family cubin
plain `sm_120`. With nvcc 13.0 the cubin's own ELF e_flags are the same for all three kinds, so
there the entry header is the one place the kind is written; CUDA 12.x output (vLLM's wheels)
also marks an arch-specific cubin in e_flags, which is read as well.

The targets alone do not say whether a GPU runs an extension: vLLM's `_C` holds its generic
kernels as plain `sm_120` and its SM12x-only kernels only as `sm_120a`, which a 12.1 cannot run.
So for each listed GPU the scan also reads the kernel names: a cubin's ELF sections
`.text.<mangled name>`, PTX's `.entry <mangled name>`, and finds the kernels present in code of
the GPU's major that no piece of code the GPU runs holds. A payload may be compressed: LZ4 block
format (flag 0x2000, CUDA 12.x; decoded here) or zstd (flag 0x8000, CUDA 13; no stdlib decoder
before Python 3.14, so those kernel names are unknown). Only entries of a listed GPU's major, and
PTX a listed GPU can JIT, are decompressed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

FORMAT = 2
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
GPU_RE = re.compile(r"\A([0-9]+)\.([0-9])\Z")
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


# ------------------------------------------------------------------ reading


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


def _open_fatbins(path: Path):
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
    opened = _open_fatbins(path)
    if opened is None:
        return None
    fh, data, entries = opened
    with fh, data:
        return sorted({e.target for e in entries}, key=lambda t: (t.kind, t.arch, t.variant))


def coverage(data, entries: list[Entry], gpus: list[str]) -> dict[str, dict]:
    """Per GPU, the kernels that code of the GPU's major holds and no code the GPU runs holds.

    The answer per GPU: `kernels` (how many kernels code of its major holds, None if unknown),
    `missing` (how many of them it cannot run), `examples` (two of those names, shortest first),
    `only_in` (the targets that hold them) and `unread` (targets of its major whose kernel names
    could not be read, which leaves the answer open when it has code of that major it cannot run).
    Only entries of a listed GPU's major and PTX a listed GPU can JIT are decompressed."""
    names: dict[int, frozenset[str] | None] = {}

    def names_of(i: int) -> frozenset[str] | None:
        if i not in names:
            names[i] = kernel_names(data, entries[i])
        return names[i]

    out: dict[str, dict] = {}
    for gpu in gpus:
        major = parse_gpu(gpu)[0]
        mine = [i for i, e in enumerate(entries) if e.target.arch // 10 == major]
        runnable = [i for i, e in enumerate(entries) if runs_on(e.target, gpu)]
        blocked = [i for i in mine if i not in runnable]
        answer = {"kernels": None, "missing": 0, "examples": [], "only_in": [], "unread": []}
        out[gpu] = answer
        if not blocked:
            continue  # every piece of code of its major runs: nothing of that major is out of reach
        universe: set[str] = set()
        unread = set()
        for i in mine:
            found = names_of(i)
            if found is None:
                unread.add(entries[i].target.name)
            else:
                universe |= found
        covered: set[str] = set()
        runnable_unread = False
        for i in sorted(runnable, key=lambda i: bool(entries[i].flags & FLAG_COMPRESSED)):
            if not universe - covered:
                break
            found = names_of(i)
            if found is None:
                unread.add(entries[i].target.name)
                runnable_unread = True
            else:
                covered |= found
        answer["unread"] = sorted(unread)
        answer["kernels"] = None if unread else len(universe)
        lacking = set() if runnable_unread else universe - covered
        answer["missing"] = len(lacking)
        answer["examples"] = sorted(lacking, key=lambda n: (len(n), n))[:2]
        answer["only_in"] = sorted({entries[i].target.name for i in blocked
                                    if (names_of(i) or frozenset()) & lacking})
    return out


def read_extension(path: Path, gpus: list[str]) -> tuple[list[Target], dict[str, dict]] | None:
    """The targets of an ELF file and their per-kernel coverage of each GPU, or None without device
    code. Raises FatbinError for an ELF file that cannot be read."""
    opened = _open_fatbins(path)
    if opened is None:
        return None
    fh, data, entries = opened
    with fh, data:
        targets = sorted({e.target for e in entries}, key=lambda t: (t.kind, t.arch, t.variant))
        return targets, coverage(data, entries, gpus)


# ------------------------------------------------------------------ the rule


def parse_gpu(gpu: str) -> tuple[int, int]:
    m = GPU_RE.match(gpu)
    if not m:
        raise ValueError(f"not a compute capability: {gpu!r} (write it as 12.1)")
    return int(m.group(1)), int(m.group(2))


def runs_on(target: Target, gpu: str) -> bool:
    """Whether a GPU of compute capability `gpu` ("12.1") can run this piece of device code.

    CUDA's compatibility rules (CUDA C++ Programming Guide, "Binary Compatibility" and "Feature
    Set Compiler Targets"): a cubin runs on its own arch; a plain cubin also on later minors of the
    same major; a family cubin (sm_120f) on later minors of its major too; an arch-specific one
    (sm_120a) only on its own arch. PTX is JIT-compiled for its own and every later arch, except
    arch-specific PTX (own arch only) and family PTX (its family only). A target whose kind could
    not be read counts only for its own arch."""
    major, minor = parse_gpu(gpu)
    cc = major * 10 + minor
    t_major, t_minor = divmod(target.arch, 10)
    if target.arch == cc:
        return True
    if target.variant in (ARCH_SPECIFIC, UNKNOWN):
        return False
    if target.kind == "cubin" or target.variant == FAMILY:
        return t_major == major and t_minor <= minor
    return target.arch <= cc  # plain PTX


def usable(targets: list[Target], gpu: str) -> list[Target]:
    """The targets a GPU of this capability can run: cubins first, then PTX it must JIT."""
    ok = [t for t in targets if runs_on(t, gpu)]
    return sorted(ok, key=lambda t: (t.kind != "cubin", -t.arch))


# ------------------------------------------------------------------ scan and record


def _is_library(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def library_files(root: Path) -> list[Path]:
    """Regular files named *.so or *.so.N under root, links not followed (no file twice)."""
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            if _is_library(name) and stat.S_ISREG(path.lstat().st_mode):
                found.append(path)
    return found


def distribution_files(name: str) -> list[Path] | None:
    """The shared libraries an installed Python distribution put on disk (None when not installed)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = []
    for item in dist.files or ():
        if _is_library(item.name):
            path = Path(dist.locate_file(item))
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return sorted(found)


def exempt(path: str, not_needed: list[str]) -> bool:
    """Whether an extension is one the recipe says no listed GPU needs: `_vllm_fa3_C` names every
    `_vllm_fa3_C.abi3.so` the scan finds, in whichever package (its file name up to the first dot)."""
    return Path(path).name.split(".", 1)[0] in not_needed


def scan(paths: list[Path], gpus: list[str], not_needed: list[str] = (),
         dists: dict[str, list[Path]] | None = None) -> dict:
    """The kernel record of these files, for these GPUs: per extension its cubins and PTX and, per
    GPU, its per-kernel coverage (see coverage()); files without device code are only counted; a
    file that cannot be read is listed with the reason. `not_needed` names extensions that vLLM
    loads only on other GPUs (the recipe's kernels_not_needed); `dists` the files of each scanned
    distribution, whose extensions with device code are counted per distribution."""
    extensions, without = [], 0
    for path in dict.fromkeys(paths):
        try:
            read = read_extension(path, gpus)
        except (FatbinError, OSError, ValueError) as exc:
            extensions.append({"path": str(path), "cubins": [], "ptx": [], "coverage": {}, "error": str(exc)})
            continue
        if read is None or not read[0]:
            without += 1
            continue
        targets, per_gpu = read
        extensions.append({"path": str(path),
                           "cubins": [t.name for t in targets if t.kind == "cubin"],
                           "ptx": [t.name for t in targets if t.kind == "ptx"],
                           "coverage": per_gpu,
                           "error": None})
    with_code = {e["path"] for e in extensions}
    counts = {name: sum(str(p) in with_code for p in dict.fromkeys(files)) for name, files in (dists or {}).items()}
    return {"format": FORMAT, "gpus": list(gpus), "not_needed": sorted(not_needed), "extensions": extensions,
            "without_device_code": without, "dists": counts}


def verdict(ext: dict, gpu: str) -> tuple[str, str]:
    """(state, what the table shows) of one extension on one GPU. States: `ok` (the label is the
    best code it runs), `none` (nothing it runs), `missing` (kernels that exist only in code it
    cannot run), `partial` (it cannot run some code of its major, and the kernel names that would
    tell are unreadable), `unreadable` (the file)."""
    if ext.get("error"):
        return "unreadable", "unreadable"
    targets = [Target.parse(n) for n in ext["cubins"] + ext["ptx"]]
    ok = usable(targets, gpu)
    if not ok:
        return "none", "NONE"
    major = parse_gpu(gpu)[0]
    blocked = [t for t in targets if t.arch // 10 == major and not runs_on(t, gpu)]
    cov = (ext.get("coverage") or {}).get(gpu)
    if cov is not None and cov.get("missing"):
        return "missing", f"{cov['missing']} missing"
    if blocked and (cov is None or cov.get("unread")):
        return "partial", "partial?"
    return "ok", ok[0].name


def verdicts(ext: dict, gpus: list[str]) -> dict[str, tuple[str, str]]:
    """Per GPU, verdict(ext, gpu)."""
    return {gpu: verdict(ext, gpu) for gpu in gpus}


def _problem(ext: dict, gpu: str, state: str) -> str:
    """The one-line reason an extension fails a GPU."""
    have = ", ".join(ext["cubins"] + ext["ptx"])
    cov = (ext.get("coverage") or {}).get(gpu) or {}
    if state == "none":
        return f"no kernel for GPU {gpu} (it holds {have})"
    if state == "missing":
        examples = ", ".join(n if len(n) <= 100 else n[:97] + "..." for n in cov.get("examples", []))
        of = f" of its {cov['kernels']}" if cov.get("kernels") is not None else ""
        return (f"GPU {gpu} cannot run {cov['missing']}{of} kernels, which exist only in "
                f"{', '.join(cov.get('only_in', []))} (e.g. {examples})")
    blocked = [t.name for t in map(Target.parse, ext["cubins"] + ext["ptx"])
               if t.arch // 10 == parse_gpu(gpu)[0] and not runs_on(t, gpu)]
    why = (f"the kernel names of {', '.join(cov['unread'])} cannot be read (zstd-compressed)" if cov.get("unread")
           else "its kernels were not read for this GPU")
    return (f"GPU {gpu} may lack kernels: it cannot run {', '.join(blocked)}, and {why}")


def check(record: dict, gpus: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(check, ok|failed|skipped, detail) per extension: the GPUs it lacks kernels for, or what each
    runs. The GPUs are the record's own unless given."""
    checks = []
    gpus = list(record.get("gpus") or []) if gpus is None else gpus
    if not gpus:
        return [("kernels: GPUs to check", "skipped", "the plan lists no GPUs")]
    counts = record.get("dists") or {}
    if "vllm" in counts and not counts["vllm"]:
        checks.append(("kernels: vllm's extensions", "failed",
                       "vllm installed no extension with device code, yet the plan lists GPU "
                       f"{', '.join(gpus)} (a CPU-only vLLM; a recipe says `gpus: []` for that)"))
    for ext in record["extensions"]:
        path = ext["path"]
        if ext.get("error"):
            checks.append((f"kernels {path}", "failed", f"cannot read its device code: {ext['error']}"))
            continue
        runs = verdicts(ext, gpus)
        problems = [_problem(ext, g, state) for g, (state, _) in runs.items() if state != "ok"]
        if problems and exempt(path, record.get("not_needed") or []):
            checks.append((f"kernels {path}", "skipped",
                           "; ".join(problems) + "; not needed: listed in the recipe's kernels_not_needed"))
        elif problems:
            checks.append((f"kernels {path}", "failed", "; ".join(problems)))
        else:
            checks.append((f"kernels {path}", "ok", "; ".join(f"{g}: {label}" for g, (_, label) in runs.items())))
    per_dist = "".join(f"; {name}: {n}" for name, n in sorted(counts.items()))
    checks.append(("kernels: extensions checked", "ok",
                   f"{len(record['extensions'])} with device code, {record['without_device_code']} without, "
                   f"for GPU {', '.join(gpus)}{per_dist}"))
    return checks


def write_json(path: Path, data: dict) -> None:
    """Write data whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cmd_scan(args: argparse.Namespace) -> int:
    paths: list[Path] = []
    for root in args.roots:
        if not Path(root).exists():
            print(f"kernels scan: {root} does not exist", file=sys.stderr)
            return 2
        paths += library_files(Path(root))
    dists: dict[str, list[Path]] = {}
    for name in args.dist:
        files = distribution_files(name)
        if files is None:
            print(f"kernels scan: --dist {name}: no such distribution is installed", file=sys.stderr)
            return 2
        dists[name] = files
        paths += files
    try:
        for gpu in args.gpu:
            parse_gpu(gpu)
    except ValueError as exc:
        print(f"kernels scan: --gpu: {exc}", file=sys.stderr)
        return 2
    record = scan(paths, args.gpu, args.not_needed, dists)
    try:
        write_json(Path(args.out), record)
    except OSError as exc:
        print(f"kernels scan: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    bad = [e for e in record["extensions"] if e["error"]]
    print(f"kernels: {len(record['extensions']) - len(bad)} extensions with device code, "
          f"{record['without_device_code']} libraries without, {len(bad)} unreadable -> {args.out}")
    return 0


def check_home(home: Path, gpus: list[str] | None = None) -> list[tuple[str, str, str]]:
    """The checks of the kernels record under home against gpus (default: the record's own)."""
    try:
        record = json.loads((home / "record" / "kernels.json").read_text())
        gpus = list(gpus or []) or list(record.get("gpus") or [])
        for gpu in gpus:
            parse_gpu(gpu)
    except FileNotFoundError as exc:
        return [("kernels record present", "failed", str(exc))]
    except (OSError, ValueError) as exc:
        return [("kernels record readable", "failed", str(exc))]
    return check(record, gpus)


def _cmd_check(args: argparse.Namespace) -> int:
    checks = check_home(Path(args.home), args.gpu)
    for name, state, detail in checks:
        print(json.dumps({"check": name, "state": state, "detail": detail}))
    return 1 if any(state == "failed" for _, state, _ in checks) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernels", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("scan", help="record the device code of every shared library under ROOTs and of --dist")
    p.add_argument("roots", nargs="*", metavar="ROOT")
    p.add_argument("--dist", action="append", default=[], help="an installed Python distribution's libraries")
    p.add_argument("--gpu", action="append", default=[], help="a compute capability the image is for (12.1)")
    p.add_argument("--not-needed", action="append", default=[], metavar="NAME",
                   help="an extension no listed GPU needs (its file name up to the first dot)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_scan)
    p = sub.add_parser("check", help="check every recorded extension against the GPUs; one JSON line per check")
    p.add_argument("--home", default="/opt/sparkforge")
    p.add_argument("--gpu", action="append", default=[], help="a compute capability (default: the record's)")
    p.set_defaults(func=_cmd_check)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
