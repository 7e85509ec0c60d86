"""The kernel reader on real CUDA 13 libraries from PyPI: zstd entries of vLLM 0.33.0's aarch64 wheel,
torch 2.14.0's libtorch_cuda.so (the cu130 build PyPI serves for aarch64) checked as covering a GB10
(12.1), relocatable code in its libtorch_nvshmem.so, and those libraries fuzzed. Each library is
fetched once into ~/.cache/sparkforge/wheel-members (tests/support/wheelmember.py); cuobjdump
(NVIDIA's nvidia-cuda-cuobjdump wheel, x86-64) is the reference where this machine can run it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sparkforge.inimage import fatbin, kernels
from sparkforge.inimage.contract import GpuCoverage
from tests.support.fatbins import fuzz
from tests.support.needs import require
from tests.support.wheelmember import wheel_member

pytestmark = pytest.mark.network

VLLM = "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl"
TORCH = "torch-2.14.0-cp312-cp312-manylinux_2_28_aarch64.whl"
CUOBJDUMP = "nvidia_cuda_cuobjdump-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"


def flashkda() -> Path:
    return wheel_member("vllm", VLLM, "vllm/_flashkda_C.abi3.so")


def cuobjdump() -> Path:
    require("x86-64")
    tool = wheel_member("nvidia-cuda-cuobjdump", CUOBJDUMP, "nvidia/cu13/bin/cuobjdump")
    tool.chmod(0o755)
    return tool


def cuobjdump_names(path: Path) -> dict[str, set[str]]:
    """Per arch, the `.text.<name>` sections `cuobjdump -elf` lists for the cubins of path."""
    out = subprocess.run([str(cuobjdump()), "-elf", str(path)], capture_output=True, text=True, timeout=600,
                         check=True).stdout
    found: dict[str, set[str]] = {}
    for block in out.split("Fatbin elf code:")[1:]:
        arch = re.search(r"^arch = (\S+)$", block, re.M)
        assert arch is not None
        names = found.setdefault(arch.group(1), set())
        names.update(re.findall(r"\sPROGBITS\s.*\s\.text\.(\S+)$", block, re.M))
    return found


def test_kernel_names_of_real_zstd_entries():
    """vLLM 0.33.0's _flashkda_C: three zstd-compressed cubins (sm_90a, sm_100f, sm_120f); the names
    of each, read through libzstd, are the ones cuobjdump lists."""
    path = flashkda()
    with fatbin.open_device_code(path) as code:
        assert [e.target.name for e in code.entries] == ["sm_90a", "sm_100f", "sm_120f"]
        assert all(e.flags & fatbin.FLAG_ZSTD for e in code.entries)
        mine = {e.target.name: code.kernel_names(e) for e in code.entries}
    assert all(len(names) > 10 for names in mine.values())
    reference = cuobjdump_names(path)
    # cuobjdump prints a family cubin's arch with its f (sm_100f) in -elf, as here.
    assert {arch: set(names) for arch, names in mine.items()} == reference


def test_torch_libtorch_cuda_covers_a_gb10():
    """torch 2.14.0's libtorch_cuda.so holds sm_120a and sm_121a cubins (360 kernels each) beside
    sm_120; a 12.1 runs sm_121a and sm_120, which hold all 360: the check passes, per kernel."""
    path = wheel_member("torch", TORCH, "torch/lib/libtorch_cuda.so")
    record = kernels.scan([path], ["12.0", "12.1"])
    (ext,) = record.extensions
    assert list(ext.cubins) == ["sm_80", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_103f", "sm_110", "sm_110a",
                             "sm_120", "sm_120a", "sm_121a"]
    assert ext.ptx == () and ext.relocatable == ()
    for gpu in ("12.0", "12.1"):
        assert ext.coverage[gpu] == GpuCoverage(kernels=360)
    assert kernels.verdicts(ext, ["12.0", "12.1"]) == {"12.0": ("ok", "sm_120"), "12.1": ("ok", "sm_121a")}
    assert [state for _, state, _ in kernels.check(record)] == ["ok", "ok"]


def test_torch_sm_120_holds_every_kernel_of_its_arch_specific_cubins():
    """The claim the GB10 check rests on, read whole: every kernel of sm_120a and sm_121a is in sm_120
    too (so a 12.1 without the sm_121a cubins would still run them)."""
    path = wheel_member("torch", TORCH, "torch/lib/libtorch_cuda.so")
    names: dict[str, set[str]] = {}
    with fatbin.open_device_code(path) as code:
        for e in code.entries:
            if e.target.name in ("sm_120", "sm_120a", "sm_121a"):
                names.setdefault(e.target.name, set()).update(code.kernel_names(e) or ())
    assert len(names["sm_120a"]) == len(names["sm_121a"]) == 360
    assert names["sm_120a"] <= names["sm_120"] and names["sm_121a"] <= names["sm_120"]


def test_torch_is_the_cuda_13_build():
    version = wheel_member("torch", TORCH, "torch/version.py").read_text()
    assert "__version__ = '2.14.0+cu130'" in version and "cuda: Optional[str] = '13.0'" in version, version


def test_relocatable_code_of_libtorch_nvshmem():
    """libtorch_nvshmem.so: device-linked cubins in .nv_fatbin, relocatable ones (and PTX) in
    __nv_relfatbin, as `cuobjdump --all-fatbin` lists them."""
    path = wheel_member("torch", TORCH, "torch/lib/libtorch_nvshmem.so")
    assert [t.name for t in fatbin.read_targets(path)] == ["sm_80", "sm_90", "sm_100", "sm_110", "sm_120"]
    relocatable = fatbin.read_targets(path, relocatable=True)
    assert [t.name for t in relocatable] == ["sm_75", "sm_80", "sm_89", "sm_90", "sm_100", "sm_110", "sm_120",
                                             "compute_120"]
    record = kernels.scan([path], ["12.1"])
    (ext,) = record.extensions
    assert list(ext.relocatable) == [t.name for t in relocatable]
    assert [state for _, state, _ in kernels.check(record)] == ["ok", "ok"]
    listed = subprocess.run([str(cuobjdump()), "--all-fatbin", "--list-elf", "--list-ptx", str(path)],
                            capture_output=True, text=True, timeout=600, check=True).stdout
    with fatbin.open_device_code(path) as code:
        assert len(listed.splitlines()) == len(code.entries) == 24


def test_fuzzed_real_cuda_13_libraries(tmp_path):
    sources = [flashkda(), wheel_member("torch", TORCH, "torch/lib/libtorch_nvshmem.so")]
    result = fuzz(sources, tmp_path, 32, seed=27, cpu=300)
    assert any(e["error"] for e in result["record"]["extensions"])


def test_extensions_with_nothing_a_gb10_runs_are_excused_by_name(tmp_path):
    """vLLM 0.33.0's _qutlass_C (sm_100f) and _deepselect_C hold nothing a 12.x runs: the check fails
    them for 12.1, and passes them as skipped once kernels_not_needed lists them, with the reason."""
    paths = [wheel_member("vllm", VLLM, f"vllm/{name}.abi3.so") for name in ("_qutlass_C", "_deepselect_C")]
    failed = kernels.check(kernels.scan(paths, ["12.1"]))
    assert [state for _, state, _ in failed[:2]] == ["failed", "failed"]
    assert all("no kernel for GPU 12.1" in detail for _, _, detail in failed[:2])
    excused = kernels.check(kernels.scan(paths, ["12.1"], ["_qutlass_C", "_deepselect_C"]))
    assert [state for _, state, _ in excused] == ["skipped", "skipped", "ok"]
