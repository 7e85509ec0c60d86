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
plain `sm_120`, and the cubin's own ELF e_flags are the same for all three kinds, so the entry
header is the one place the kind is written. A payload may be compressed (zstd from CUDA 13,
flag 0x8000; an older scheme, flag 0x2000); the header is not, so nothing needs decompressing.
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

FORMAT = 1
FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTION = ".nv_fatbin"
ELF_MAGIC = b"\x7fELF"
ELFCLASS64, ELFDATA2LSB, SHT_NOBITS = 2, 1, 8

KIND_PTX, KIND_CUBIN = 1, 2
# Entry flags: read from nvcc 13.0's own output (see the module docstring).
FLAG_ARCH_SPECIFIC = 0x100000   # sm_120a / compute_120a
FLAG_FAMILY = 0x200000          # sm_120f / compute_120f
FLAG_COMPRESSED = 0x2000 | 0x8000

PLAIN, ARCH_SPECIFIC, FAMILY, UNKNOWN = "", "a", "f", "?"
GPU_RE = re.compile(r"\A([0-9]+)\.([0-9]+)\Z")
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


def _entry(data, pos: int, end: int) -> tuple[Target | None, int]:
    """The target of the entry at pos (None for a kind that is neither PTX nor a cubin) and where
    the next entry starts."""
    if pos + 48 > end:
        raise FatbinError("a fat-binary entry header is cut short")
    kind, _version, header_size, size = struct.unpack_from("<HHIQ", data, pos)
    arch, = struct.unpack_from("<I", data, pos + 28)
    flags, = struct.unpack_from("<Q", data, pos + 40)
    if header_size < 48 or pos + header_size + size > end:
        raise FatbinError("a fat-binary entry runs past its container")
    nxt = pos + header_size + size
    if kind not in (KIND_PTX, KIND_CUBIN):
        return None, nxt
    a, f = bool(flags & FLAG_ARCH_SPECIFIC), bool(flags & FLAG_FAMILY)
    variant = UNKNOWN if a and f else ARCH_SPECIFIC if a else FAMILY if f else PLAIN
    if kind == KIND_CUBIN and not flags & FLAG_COMPRESSED:
        variant = _checked_cubin(data, pos + header_size, size, arch, variant)
    return Target("cubin" if kind == KIND_CUBIN else "ptx", arch, variant), nxt


def _checked_cubin(data, pos: int, size: int, arch: int, variant: str) -> str:
    """An uncompressed cubin must be a CUDA ELF (EM_CUDA) of the arch its header names; one that
    is not keeps its arch but loses its kind (UNKNOWN), so it only ever counts for its own arch."""
    if size < 64 or data[pos:pos + 4] != ELF_MAGIC:
        return UNKNOWN
    machine, = struct.unpack_from("<H", data, pos + 0x12)
    e_flags, = struct.unpack_from("<I", data, pos + 0x30)
    abi_version = data[pos + 8]
    # The SM number sits in e_flags' low byte up to ELF ABI version 7, in the second from version 8.
    sm = (e_flags >> 8) & 0xFF if abi_version >= 8 else e_flags & 0xFF
    return variant if machine == 190 and sm == arch % 256 else UNKNOWN


def _containers(data, start: int, end: int) -> list[Target]:
    """Every entry of the fat-binary containers laid end to end in data[start:end]."""
    found: list[Target] = []
    pos = start
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            if any(data[pos:min(pos + 16, end)]):
                raise FatbinError(f"no fat-binary header at offset {pos:#x}")
            pos += 8  # padding between containers
            continue
        body, stop = pos + header_size, pos + header_size + fat_size
        if header_size < 16 or stop > end:
            raise FatbinError(f"the fat binary at offset {pos:#x} runs past its section")
        while body < stop:
            target, body = _entry(data, body, stop)
            if target is not None:
                found.append(target)
        pos = stop
    return found


def read_targets(path: Path) -> list[Target] | None:
    """The device code an ELF file carries (sorted, without repeats), or None when it has none
    (not ELF, or no fat binary). Raises FatbinError for an ELF file that cannot be read."""
    with open(path, "rb") as fh:
        if fh.read(4) != ELF_MAGIC:
            return None
        if os.fstat(fh.fileno()).st_size < 64:
            raise FatbinError("an ELF file cut short")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            sections = [s for s in _sections(data) if s[0] == FATBIN_SECTION and s[1] != SHT_NOBITS]
            if not sections:
                return None
            found: set[Target] = set()
            for _, _, off, size in sections:
                found.update(_containers(data, off, off + size))
    return sorted(found, key=lambda t: (t.kind, t.arch, t.variant))


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


def distribution_files(name: str) -> list[Path]:
    """The shared libraries an installed Python distribution put on disk (none when not installed)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for item in dist.files or ():
        if _is_library(item.name):
            path = Path(dist.locate_file(item))
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return sorted(found)


def exempt(path: str, not_needed: list[str]) -> bool:
    """Whether an extension is one the recipe says no listed GPU needs: `_vllm_fa3_C` names
    `.../_vllm_fa3_C.abi3.so` (its file name up to the first dot)."""
    return Path(path).name.split(".", 1)[0] in not_needed


def scan(paths: list[Path], gpus: list[str], not_needed: list[str] = ()) -> dict:
    """The kernel record of these files, for these GPUs: per extension its cubins and PTX; files
    without device code are only counted; a file that cannot be read is listed with the reason.
    `not_needed` names extensions that vLLM loads only on other GPUs (the recipe's kernels_not_needed)."""
    extensions, without = [], 0
    for path in dict.fromkeys(paths):
        try:
            targets = read_targets(path)
        except (FatbinError, OSError, ValueError) as exc:
            extensions.append({"path": str(path), "cubins": [], "ptx": [], "error": str(exc)})
            continue
        if targets is None or not targets:
            without += 1
            continue
        extensions.append({"path": str(path),
                           "cubins": [t.name for t in targets if t.kind == "cubin"],
                           "ptx": [t.name for t in targets if t.kind == "ptx"],
                           "error": None})
    return {"format": FORMAT, "gpus": list(gpus), "not_needed": sorted(not_needed), "extensions": extensions,
            "without_device_code": without}


def verdicts(ext: dict, gpus: list[str]) -> dict[str, str | None]:
    """Per GPU, the target it runs of this extension (None: nothing it can run)."""
    if ext.get("error"):
        return {g: None for g in gpus}
    targets = [Target.parse(n) for n in ext["cubins"] + ext["ptx"]]
    out: dict[str, str | None] = {}
    for gpu in gpus:
        ok = usable(targets, gpu)
        out[gpu] = ok[0].name if ok else None
    return out


def check(record: dict, gpus: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(check, ok|failed|skipped, detail) per extension: the GPUs it has no code for, or what each
    runs. The GPUs are the record's own unless given."""
    checks = []
    gpus = list(record.get("gpus") or []) if gpus is None else gpus
    if not gpus:
        return [("kernels: GPUs to check", "skipped", "the plan lists no GPUs")]
    for ext in record["extensions"]:
        path = ext["path"]
        if ext.get("error"):
            checks.append((f"kernels {path}", "failed", f"cannot read its device code: {ext['error']}"))
            continue
        runs = verdicts(ext, gpus)
        missing = [g for g, target in runs.items() if target is None]
        have = ", ".join(ext["cubins"] + ext["ptx"])
        if missing and exempt(path, record.get("not_needed") or []):
            checks.append((f"kernels {path}", "skipped",
                           f"no kernel for GPU {', '.join(missing)} (it holds {have}); not needed: "
                           "listed in the recipe's kernels_not_needed"))
        elif missing:
            checks.append((f"kernels {path}", "failed",
                           f"no kernel for GPU {', '.join(missing)} (it holds {have})"))
        else:
            checks.append((f"kernels {path}", "ok", "; ".join(f"{g}: {t}" for g, t in runs.items())))
    checks.append(("kernels: extensions checked", "ok",
                   f"{len(record['extensions'])} with device code, {record['without_device_code']} without, "
                   f"for GPU {', '.join(gpus)}"))
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
    for name in args.dist:
        paths += distribution_files(name)
    try:
        for gpu in args.gpu:
            parse_gpu(gpu)
    except ValueError as exc:
        print(f"kernels scan: --gpu: {exc}", file=sys.stderr)
        return 2
    record = scan(paths, args.gpu, args.not_needed)
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
