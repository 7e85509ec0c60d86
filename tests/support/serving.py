"""The CPU test variant, locked and built for the serving tests (tests/docker/test_serve.py, the launch tests):
vLLM's CPU build from PyPI with every dependency from its lock's wheel set, on the CPU torch base."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.support.cli import run_cli
from tests.support.paths import CA, MODS, TEST_MODS, VARIANTS

CPU = "testcpu"
BUILD_TIMEOUT = 3600  # about 3 GB to install, export and unpack on 2 busy cores


@dataclass(frozen=True)
class CpuImages:
    images: Path  # a copy of the test variants, testcpu locked there
    mods: Path  # mods/ and tests/mods in one folder
    base: str  # the CPU torch base
    tag: str  # the built image
    ca: str = CA


def merged_mods(dest: Path) -> Path:
    """The shipped mods and the test mods in one folder."""
    shutil.copytree(MODS, dest)
    for mod in TEST_MODS.iterdir():
        if mod.is_dir():
            shutil.copytree(mod, dest / mod.name)
    return dest


def _lock(images: Path, mods: Path, variant: str, base: str) -> None:
    """`lock --no-build`: the wheel set from the index through uv, no build."""
    proc = run_cli("--images", str(images), "--mods", str(mods), "lock", variant, "--base", base, "--no-build")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def build_cpu_images(work: Path, base: str) -> CpuImages:
    """Lock testcpu in a copy of the test variants, then `build --locked` it; what was made."""
    images, mods = work / "images", merged_mods(work / "mods")
    shutil.copytree(VARIANTS, images)
    _lock(images, mods, CPU, base)
    proc = run_cli("--images", str(images), "--mods", str(mods), "build", CPU, "--base", base, "--locked",
                   "--ca-cert", CA, timeout=BUILD_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    show = run_cli("--images", str(images), "--mods", str(mods), "show", CPU, "--base", base, "--json")
    assert show.returncode == 0, show.stderr
    return CpuImages(images, mods, base, json.loads(show.stdout)["tag"])


def broken_variant(cpu: CpuImages, work: Path) -> Path:
    """A copy of the variants with testcpu-broken (testcpu plus the test mod break-serve), locked; the folder."""
    images = work / "images"
    shutil.copytree(cpu.images, images)
    (images / f"{CPU}-broken.yaml").write_text(
        f"# testcpu with a mod that makes `vllm serve` raise as it starts (tests/mods/break-serve).\n"
        f"extends: {CPU}\ndescription: testcpu, broken on purpose\nmods:\n  add: [break-serve]\n")
    _lock(images, cpu.mods, f"{CPU}-broken", cpu.base)
    return images
