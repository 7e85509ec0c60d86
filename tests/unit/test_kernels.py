"""The fat-binary reader and the GPU rule (sparkforge/inimage/fatbin.py, kernels.py), on real nvcc output
(tests/fixtures/kernels, remade by its make.sh) compared with what cuobjdump says of the same files."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sparkforge.inimage import decompress, fatbin, kernels
from sparkforge.inimage.fatbin import FatbinError, Target, read_targets
from sparkforge.inimage.kernels import runs_on
from tests.support.fatbins import without_libraries
from tests.support.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "kernels"
TOOL = Path(kernels.__file__).parent  # the in-image package, run as a folder

# What `cuobjdump --list-elf` and `--list-ptx` (nvidia-cuda-cuobjdump 13.5, V13.5.37) print for each
# fixture, as (kind, name) with repeats removed. cuobjdump names a family cubin plain (sm_120),
# a family PTX compute_120f as sm_120f, and PTX as sm_NN.
CUOBJDUMP = {
    "host_only.so": set(),
    "mixed.so": {("cubin", "sm_120"), ("cubin", "sm_120a"), ("cubin", "sm_121a"), ("cubin", "sm_90"),
                 ("ptx", "sm_80")},
    "mixed_compressed.so": {("cubin", "sm_120"), ("cubin", "sm_120a"), ("cubin", "sm_121a"), ("cubin", "sm_90"),
                            ("ptx", "sm_80")},
    "ptx120.so": {("ptx", "sm_120")},
    "ptx120a.so": {("ptx", "sm_120a")},
    "ptx120f.so": {("ptx", "sm_120f")},
    "sm120.so": {("cubin", "sm_120")},
    "sm120_ptx_compressed.so": {("cubin", "sm_120"), ("ptx", "sm_120")},
    "sm120a.so": {("cubin", "sm_120a")},
    "sm120f.so": {("cubin", "sm_120")},
    "sm90.so": {("cubin", "sm_90")},
    "two.so": {("cubin", "sm_120"), ("cubin", "sm_120a")},
    "two_lz4.so": {("cubin", "sm_120"), ("cubin", "sm_120a")},
    "two_zstd.so": {("cubin", "sm_120"), ("cubin", "sm_120a")},
    "rdc.so": {("cubin", "sm_120"), ("cubin", "sm_90")},
}
# What `cuobjdump --all-fatbin --list-elf` adds for the relocatable fat binary (its help: "by default
# will only dump contents of executable fatbin (if exists), else relocatable fatbin").
CUOBJDUMP_RELOCATABLE = {"rdc.so": {("cubin", "sm_120"), ("cubin", "sm_90")}}

# What each fixture was compiled for (make.sh's -gencode options).
COMPILED = {
    "mixed.so": ["sm_90", "sm_120a", "sm_120f", "sm_121a", "compute_80"],
    "mixed_compressed.so": ["sm_90", "sm_120a", "sm_120f", "sm_121a", "compute_80"],
    "ptx120.so": ["compute_120"],
    "ptx120a.so": ["compute_120a"],
    "ptx120f.so": ["compute_120f"],
    "sm120.so": ["sm_120"],
    "sm120_ptx_compressed.so": ["sm_120", "compute_120"],
    "sm120a.so": ["sm_120a"],
    "sm120f.so": ["sm_120f"],
    "sm90.so": ["sm_90"],
    "two.so": ["sm_120", "sm_120a"],
    "two_lz4.so": ["sm_120", "sm_120a"],
    "two_zstd.so": ["sm_120", "sm_120a"],
    "rdc.so": ["sm_90", "sm_120"],
}

# What `cuobjdump -elf` shows of two.cu's cubins (each .so holds them twice: cudart adds a second
# container): add_one everywhere, scale_fp4 only in sm_120a.
TWO_KERNELS = {"sm_120": {"_Z7add_onePfi"}, "sm_120a": {"_Z7add_onePfi", "_Z9scale_fp4Pfi"}}


def _as_cuobjdump(target: Target) -> tuple[str, str]:
    if target.kind == "cubin":
        return "cubin", f"sm_{target.arch}{'a' if target.variant == 'a' else ''}"
    return "ptx", f"sm_{target.arch}{target.variant}"


@pytest.mark.parametrize("name", sorted(CUOBJDUMP))
def test_reader_agrees_with_cuobjdump(name):
    targets = read_targets(FIXTURES / name) or []
    assert {_as_cuobjdump(t) for t in targets} == CUOBJDUMP[name]


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_reader_names_what_nvcc_was_asked_for(name):
    assert [t.name for t in read_targets(FIXTURES / name)] == COMPILED[name]


@pytest.mark.parametrize("name", sorted(CUOBJDUMP))
def test_relocatable_code_is_read_apart(name):
    targets = read_targets(FIXTURES / name, relocatable=True) or []
    assert {_as_cuobjdump(t) for t in targets} == CUOBJDUMP_RELOCATABLE.get(name, set())


def test_every_fixture_is_listed():
    assert {p.name for p in FIXTURES.glob("*.so")} == set(CUOBJDUMP)


def test_a_library_without_device_code_is_not_an_extension():
    assert read_targets(FIXTURES / "host_only.so") is None
    record = kernels.scan([FIXTURES / "host_only.so", FIXTURES / "sm90.so"], ["9.0"])
    assert [e.path for e in record.extensions] == [str(FIXTURES / "sm90.so")]
    assert record.without_device_code == 1


def test_a_file_that_is_not_elf_is_skipped(tmp_path):
    (tmp_path / "libc.so").write_text("/* GNU ld script */\nGROUP ( /lib/libc.so.6 )\n")
    (tmp_path / "empty.so").write_bytes(b"")
    assert read_targets(tmp_path / "libc.so") is None
    assert read_targets(tmp_path / "empty.so") is None


def _cuda_elf_offsets(data: bytes) -> list[int]:
    """Where the cubins (ELF, machine EM_CUDA) start inside a host library."""
    found, pos = [], 0
    while (pos := data.find(b"\x7fELF", pos + 1)) > 0:
        if struct.unpack_from("<H", data, pos + 0x12)[0] == 190:
            found.append(pos)
    return found


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:40], "cut short|outside"),                                       # truncated file
    (lambda d: d[:4] + b"\x01" + d[5:], "64-bit little-endian"),                   # ELFCLASS32
    (lambda d: d[:0x28] + struct.pack("<Q", len(d)) + d[0x30:], "section headers"),  # headers past the end
])
def test_a_broken_elf_is_an_error(tmp_path, damage, message):
    path = tmp_path / "broken.so"
    path.write_bytes(damage((FIXTURES / "sm120.so").read_bytes()))
    with pytest.raises(FatbinError, match=message):
        read_targets(path)
    record = kernels.scan([path], ["12.1"])
    assert record.extensions[0].error
    assert kernels.check(record)[0][1] == "failed"


def test_a_damaged_fat_binary_is_an_error_not_a_guess(tmp_path):
    data = bytearray((FIXTURES / "sm120.so").read_bytes())
    magic = struct.pack("<I", fatbin.FATBIN_MAGIC)
    at = data.find(magic)
    data[at:at + 4] = b"\x01\x02\x03\x04"
    path = tmp_path / "damaged.so"
    path.write_bytes(bytes(data))
    with pytest.raises(FatbinError, match="no fat-binary header"):
        read_targets(path)


def test_an_entry_running_past_its_container_is_an_error(tmp_path):
    data = bytearray((FIXTURES / "sm90.so").read_bytes())
    at = data.find(struct.pack("<I", fatbin.FATBIN_MAGIC))
    struct.pack_into("<Q", data, at + 16 + 8, 1 << 40)  # the first entry's payload size
    path = tmp_path / "long.so"
    path.write_bytes(bytes(data))
    with pytest.raises(FatbinError, match="runs past"):
        read_targets(path)


def test_a_cubin_whose_own_elf_disagrees_counts_only_for_its_arch(tmp_path):
    """sm120f.so's cubins are stored uncompressed; one whose e_flags names another SM loses its kind."""
    data = bytearray((FIXTURES / "sm120f.so").read_bytes())
    for pos in _cuda_elf_offsets(bytes(data)):
        e_flags = struct.unpack_from("<I", data, pos + 0x30)[0]
        struct.pack_into("<I", data, pos + 0x30, (e_flags & ~0xFF00) | (90 << 8))
    path = tmp_path / "odd.so"
    path.write_bytes(bytes(data))
    (target,) = read_targets(path)
    assert target.name == "sm_120?"
    assert runs_on(target, "12.0") and not runs_on(target, "12.1")
    assert [t.name for t in read_targets(FIXTURES / "sm120f.so")] == ["sm_120f"]


def test_library_files_skip_links_and_other_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.so").write_bytes((FIXTURES / "sm90.so").read_bytes())
    (tmp_path / "libb.so.12").write_bytes(b"x")
    (tmp_path / "link.so").symlink_to(tmp_path / "sub" / "a.so")
    (tmp_path / "dir.so").mkdir()
    (tmp_path / "notes.txt").write_text("so")
    os.mkfifo(tmp_path / "fifo.so")
    assert kernels.library_files(tmp_path) == [tmp_path / "libb.so.12", tmp_path / "sub" / "a.so"]


# ------------------------------------------------------------------ the rule

T = Target.parse


@pytest.mark.parametrize("target, gpu, runs", [
    # a cubin for exactly the GPU's arch: plain, arch-specific and family alike
    ("sm_121", "12.1", True), ("sm_121a", "12.1", True), ("sm_121f", "12.1", True),
    # a plain cubin runs on later minors of its major, never on an earlier minor or another major
    ("sm_120", "12.1", True), ("sm_120", "12.0", True), ("sm_121", "12.0", False),
    ("sm_90", "12.1", False), ("sm_100", "10.3", True), ("sm_100", "12.0", False), ("sm_80", "8.9", True),
    # an arch-specific cubin runs only on its own arch
    ("sm_120a", "12.1", False), ("sm_90a", "9.0", True), ("sm_100a", "10.3", False),
    # a family cubin runs on its family: same major, minor at least its own
    ("sm_120f", "12.1", True), ("sm_100f", "10.3", True), ("sm_100f", "12.0", False), ("sm_121f", "12.0", False),
    # PTX is JIT-compiled for its own and every later arch, of any major
    ("compute_80", "12.1", True), ("compute_120", "12.1", True), ("compute_121", "12.0", False),
    ("compute_90", "8.9", False),
    # arch-specific PTX only on its own arch; family PTX only in its family
    ("compute_120a", "12.1", False), ("compute_120a", "12.0", True),
    ("compute_120f", "12.1", True), ("compute_100f", "12.0", False),
    # a target whose kind could not be read counts only for its own arch
    ("sm_120?", "12.0", True), ("sm_120?", "12.1", False), ("compute_80?", "9.0", False),
])
def test_rule(target, gpu, runs):
    assert runs_on(T(target), gpu) is runs


def test_rule_refuses_a_gpu_that_is_not_a_capability():
    with pytest.raises(ValueError, match="compute capability"):
        runs_on(T("sm_120"), "sm_121")


def test_usable_prefers_a_cubin_to_jit():
    targets = [T("compute_80"), T("sm_120"), T("sm_120f"), T("sm_121a")]
    assert [t.name for t in kernels.usable(targets, "12.1")] == ["sm_121a", "sm_120", "sm_120f", "compute_80"]


def test_check_names_the_extension_and_the_gpu():
    record = kernels.scan([FIXTURES / "sm120a.so", FIXTURES / "sm120f.so", FIXTURES / "ptx120.so"], ["12.1"])
    results = {name.split("/")[-1]: (state, detail) for name, state, detail in kernels.check(record)}
    assert results["sm120a.so"] == ("failed", "no kernel for GPU 12.1 (it holds sm_120a)")
    assert results["sm120f.so"] == ("ok", "12.1: sm_120f")
    assert results["ptx120.so"] == ("ok", "12.1: compute_120 PTX only, compiled by the driver at first start")
    assert kernels.verdict(record.extensions[2], "12.1") == ("jit", "JIT compute_120")
    assert results["kernels: extensions checked"][0] == "ok"
    assert kernels.check(record, [])[0][1] == "skipped"


# ------------------------------------------------------------------ run as in the image


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    # -I: no site-packages and no project on the path, as the stdlib-only folder copied into an image.
    return subprocess.run([sys.executable, "-I", "-B", str(TOOL), "kernels", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


def test_scan_and_check_as_the_image_runs_them(tmp_path):
    home = tmp_path / "home"
    out = home / "record" / "kernels.json"
    scan = _run("scan", "--gpu", "12.1", str(FIXTURES), "--out", str(out))
    assert scan.returncode == 0, scan.stderr
    record = json.loads(out.read_text())
    assert record["gpus"] == ["12.1"] and record["without_device_code"] == 1
    assert {Path(e["path"]).name for e in record["extensions"]} == set(COMPILED)
    check = _run("check", "--home", str(home))
    lines = [json.loads(line) for line in check.stdout.splitlines()]
    failed = {Path(x["check"].split()[-1]).name for x in lines if x["state"] == "failed"}
    # 12.1 runs sm_120 (plain), sm_120f, sm_121a and PTX 80/120/120f; nothing in sm90, sm120a, ptx120a;
    # two*.so hold a kernel only in sm_120a; mixed*.so hold in sm_120f and sm_121a the one kernel
    # of their sm_120a (read from the zstd entries of mixed_compressed.so too).
    assert failed == {"sm90.so", "sm120a.so", "ptx120a.so", "two.so", "two_lz4.so", "two_zstd.so"}
    jit = {Path(x["check"].split()[-1]).name for x in lines if "PTX only" in x["detail"]}
    assert jit == {"ptx120.so", "ptx120f.so"}
    assert check.returncode == 1
    assert _run("check", "--home", str(home), "--gpu", "12.0").returncode == 1  # sm_121a alone... and sm90
    ok = _run("scan", "--gpu", "12.1", str(FIXTURES / "sm120f.so"), "--out", str(out))
    assert ok.returncode == 0 and _run("check", "--home", str(home)).returncode == 0


def test_scan_refuses_bad_input_in_one_line(tmp_path):
    out = tmp_path / "k.json"
    missing = _run("scan", str(tmp_path / "nowhere"), "--out", str(out))
    bad_gpu = _run("scan", "--gpu", "sm_121", str(FIXTURES), "--out", str(out))
    for proc in (missing, bad_gpu):
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
    (tmp_path / "file").write_text("")
    unwritable = _run("scan", str(FIXTURES / "sm90.so"), "--out", str(tmp_path / "file" / "k.json"))
    assert unwritable.returncode == 1 and unwritable.stderr.count("\n") == 1 and "cannot write" in unwritable.stderr
    no_record = _run("check", "--home", str(tmp_path))
    assert no_record.returncode == 1 and json.loads(no_record.stdout)["state"] == "failed"


def test_the_table_shows_archs_and_a_verdict_per_gpu():
    from rich.console import Console

    from sparkforge.cli.views import kernels_table

    paths = [FIXTURES / "sm120a.so", FIXTURES / "mixed_compressed.so", FIXTURES / "sm90.so"]
    record = kernels.scan(paths, ["12.1", "9.0"], ["sm90"])
    console = Console(width=200, record=True)
    console.print(kernels_table(record))
    rows = {line.split()[0].rsplit("/", 1)[-1]: line.split() for line in console.export_text().splitlines()
            if ".so" in line}
    assert rows["sm120a.so"][1:] == ["120a", "-", "NONE", "NONE"]
    assert rows["mixed_compressed.so"][1:] == ["90", "120a", "120f", "121a", "80", "sm_121a", "sm_90"]
    assert rows["sm90.so"][1:] == ["90", "-", "not", "needed", "sm_90"]


# ------------------------------------------------------------------ per kernel


def _names_by_target(path: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    with fatbin.open_device_code(path) as code:
        for entry in code.entries:
            found.setdefault(entry.target.name, set()).update(code.kernel_names(entry))
    return found


@pytest.mark.parametrize("name", ["two.so", "two_lz4.so", "two_zstd.so"])
def test_kernel_names_are_read_from_each_cubin(name):
    """Uncompressed, LZ4 and zstd alike, through the system's liblz4 and libzstd."""
    assert _names_by_target(FIXTURES / name) == TWO_KERNELS


@pytest.mark.parametrize("name", ["two.so", "two_lz4.so", "two_zstd.so"])
def test_a_kernel_only_in_arch_specific_code_fails_the_gpu_that_cannot_run_it(name):
    record = kernels.scan([FIXTURES / name], ["12.0", "12.1"])
    (ext,) = record.extensions
    assert kernels.verdicts(ext, ["12.0", "12.1"]) == {"12.0": ("ok", "sm_120"), "12.1": ("missing", "1 missing")}
    assert ext.coverage["12.1"].examples == ("_Z9scale_fp4Pfi",)
    assert ext.coverage["12.1"].kernels == 2  # what sm_120a, which 12.1 cannot run, holds
    (result, total) = kernels.check(record)
    assert result[1] == "failed"
    assert result[2] == "GPU 12.1 cannot run 1 kernels, which exist only in sm_120a (e.g. _Z9scale_fp4Pfi)"
    assert kernels.check(record, ["12.0"])[0][1] == "ok"
    listed = kernels.scan([FIXTURES / name], ["12.1"], [name.removesuffix(".so")])
    assert kernels.check(listed)[0][1] == "skipped"


def test_unreadable_kernel_names_do_not_claim_coverage(tmp_path):
    """two.so's sm_120a cubin made no ELF file: it keeps its arch but not its kind (sm_120?), and
    its kernel names cannot be read, so a 12.1 beside it is `partial?`, never ok."""
    data = bytearray((FIXTURES / "two.so").read_bytes())
    with fatbin.open_device_code(FIXTURES / "two.so") as code:
        for e in code.entries:
            if e.target.name == "sm_120a":
                data[e.offset:e.offset + 4] = b"\0ELF"
    path = tmp_path / "two_odd.so"
    path.write_bytes(bytes(data))
    record = kernels.scan([path], ["12.0", "12.1"])
    (ext,) = record.extensions
    assert ext.cubins == ("sm_120", "sm_120?")
    assert kernels.verdicts(ext, ["12.0", "12.1"]) == {"12.0": ("ok", "sm_120"), "12.1": ("partial", "partial?")}
    (result, _) = kernels.check(record)
    assert result[1] == "failed" and "cannot run sm_120?" in result[2] and "cannot be read" in result[2]
    # A GPU the scan did not read names for: per file only, and not claimed either.
    plain = kernels.scan([FIXTURES / "two.so"], [])
    assert kernels.verdict(plain.extensions[0], "12.1") == ("partial", "partial?")


def test_lz4_entries_decode_to_their_size_and_nothing_else():
    with fatbin.open_device_code(FIXTURES / "two_lz4.so") as code:
        for e in code.entries:
            raw = bytes(code.data[e.offset:e.offset + e.size])
            plain = decompress.lz4_decode(raw, e.plain_size)
            assert plain[:4] == b"\x7fELF" and len(plain) == e.plain_size
            for bad in ((raw[:len(raw) // 2], e.plain_size), (raw, e.plain_size + 1), (raw, e.plain_size - 1)):
                with pytest.raises(decompress.DecodeError, match="size its header says"):
                    decompress.lz4_decode(*bad)


def test_every_zstd_entry_of_the_fixtures_decodes_to_its_size():
    """Every zstd entry nvcc 13.0 wrote into the fixtures, cubins and PTX, executable and relocatable."""
    seen = 0
    for path in sorted(FIXTURES.glob("*.so")):
        with fatbin.open_device_code(path) or contextlib.nullcontext() as code:
            for e in code.entries if code else ():
                if e.flags & fatbin.FLAG_ZSTD:
                    plain = decompress.zstd_decode(bytes(code.data[e.offset:e.offset + e.size]), e.plain_size)
                    assert len(plain) == e.plain_size
                    assert plain[:4] == b"\x7fELF" if e.target.kind == "cubin" else b".entry" in plain
                    seen += 1
    assert seen >= 10


@pytest.mark.parametrize("name, library", [("two_lz4.so", "liblz4.so.1 is not in the image; add liblz4-1"),
                                           ("two_zstd.so", "libzstd.so.1 is not in the image; add libzstd1")])
def test_an_image_without_the_library_fails_its_scan_in_one_line_naming_the_package(name, library):
    with without_libraries():
        record = kernels.scan([FIXTURES / name], ["12.1"])
    (ext,) = record.extensions
    assert ext.error and library in ext.error and "os_packages" in ext.error and "\n" not in ext.error
    (result, _) = kernels.check(record)
    assert result[1] == "failed" and library in result[2]


@pytest.mark.parametrize("pad", [8, 16, 24])
def test_padding_between_containers_is_skipped(tmp_path, pad):
    """sm90.so has two containers back to back in one section; zero bytes spliced between them
    (the section grown to match) read as padding."""
    data = (FIXTURES / "sm90.so").read_bytes()
    magic = struct.pack("<I", fatbin.FATBIN_MAGIC)
    first = data.find(magic)
    header_size, fat_size = struct.unpack_from("<HQ", data, first + 6)
    second = first + header_size + fat_size
    assert data[second:second + 4] == magic
    sections = {name: (i, off, size) for i, (name, _, off, size) in enumerate(fatbin.sections(data))}
    index, off, size = sections[".nv_fatbin"]
    assert off <= first and second + 16 <= off + size
    shoff, = struct.unpack_from("<Q", data, 0x28)
    assert shoff > second  # the section headers move with the splice
    out = bytearray(data[:second] + bytes(pad) + data[second:])
    struct.pack_into("<Q", out, 0x28, shoff + pad)
    shentsize = struct.unpack_from("<H", out, 0x3A)[0]
    struct.pack_into("<Q", out, shoff + pad + index * shentsize + 0x20, size + pad)
    for i, (_, _, o, _) in enumerate(fatbin.sections(data)):
        if o > second:
            struct.pack_into("<Q", out, shoff + pad + i * shentsize + 0x18, o + pad)
    path = tmp_path / "padded.so"
    path.write_bytes(bytes(out))
    assert [t.name for t in read_targets(path)] == ["sm_90"]
    with fatbin.open_device_code(path) as padded, fatbin.open_device_code(FIXTURES / "sm90.so") as plain:
        assert len(padded.entries) == len(plain.entries)


def test_an_arch_specific_mark_in_e_flags_counts(tmp_path):
    """CUDA 12.x writes sm_120a in the cubin's e_flags too (ABI 8: 0xa in the low nibble where a
    plain sm_120 has 0x2, as in vLLM 0.17.0's _C); nvcc 13.0 writes 0x2 for every kind."""
    data = bytearray((FIXTURES / "sm120.so").read_bytes())
    for pos in _cuda_elf_offsets(bytes(data)):
        assert data[pos + 8] >= 8
        e_flags = struct.unpack_from("<I", data, pos + 0x30)[0]
        assert e_flags & 0xF == 0x2
        struct.pack_into("<I", data, pos + 0x30, e_flags | 0x8)
    path = tmp_path / "marked.so"
    path.write_bytes(bytes(data))
    assert [t.name for t in read_targets(path)] == ["sm_120a"]


def test_a_gpu_has_a_one_digit_minor():
    with pytest.raises(ValueError, match="compute capability"):
        kernels.parse_gpu("12.10")


def test_a_named_distribution_must_be_installed(tmp_path):
    out = tmp_path / "k.json"
    proc = _run("scan", "--dist", "no-such-dist-sparkforge", "--out", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no-such-dist-sparkforge" in proc.stderr
    assert not out.exists()


def test_a_vllm_without_device_code_fails_when_gpus_are_listed():
    record = kernels.scan([FIXTURES / "host_only.so"], ["12.1"], dists={"vllm": [FIXTURES / "host_only.so"]})
    assert record.dists == {"vllm": 0}
    results = kernels.check(record)
    assert results[0][:2] == ("kernels: vllm's extensions", "failed") and "gpus: []" in results[0][2]
    assert kernels.check(record, [])[0][1] == "skipped"  # a recipe with `gpus: []`
    good = kernels.scan([FIXTURES / "sm120.so"], ["12.1"], dists={"vllm": [FIXTURES / "sm120.so"]})
    assert good.dists == {"vllm": 1} and all(state == "ok" for _, state, _ in kernels.check(good))


def test_the_table_shows_missing_partial_and_unreadable(tmp_path):
    from rich.console import Console

    from sparkforge.cli.views import kernels_table

    broken = tmp_path / "broken.so"
    broken.write_bytes((FIXTURES / "sm120.so").read_bytes()[:40])
    record = kernels.scan([FIXTURES / "two_lz4.so", FIXTURES / "two_zstd.so", broken, FIXTURES / "ptx120.so"],
                          ["12.0", "12.1"], ["broken"])
    console = Console(width=200, record=True)
    console.print(kernels_table(record))
    rows = {line.split()[0].rsplit("/", 1)[-1]: line.split() for line in console.export_text().splitlines()
            if ".so" in line}
    assert rows["two_lz4.so"][-3:] == ["sm_120", "1", "missing"]
    assert rows["two_zstd.so"][-3:] == ["sm_120", "1", "missing"]
    assert rows["ptx120.so"][-4:] == ["JIT", "compute_120", "JIT", "compute_120"]
    assert rows["broken.so"][-2:] == ["unreadable", "unreadable"]
    assert [state for name, state, _ in kernels.check(record) if name.endswith("broken.so")] == ["failed"]


def test_a_library_with_only_relocatable_code_needs_nothing_of_a_gpu(tmp_path):
    """rdc.so with its .nv_fatbin section renamed: what is left is nvlink's input, which no GPU loads
    from this file; it is recorded, shown, and passes."""
    data = (FIXTURES / "rdc.so").read_bytes()
    assert data.count(b".nv_fatbin\0") == 1
    path = tmp_path / "relonly.so"
    path.write_bytes(data.replace(b".nv_fatbin\0", b".nv_fatbiX\0"))
    assert read_targets(path) == []
    record = kernels.scan([path], ["12.1"])
    (ext,) = record.extensions
    assert ext.cubins == ext.ptx == () and ext.relocatable == ("sm_90", "sm_120")
    assert kernels.verdict(ext, "12.1") == ("relocatable", "relocatable only")
    (result, _) = kernels.check(record)
    assert result[1:] == ("ok", "12.1: nothing to load (only relocatable code: sm_90, sm_120)")
