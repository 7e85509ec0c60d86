"""Fixtures for tests with a real Docker engine: the engine, the local base, the built test image."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ROOT / "tests" / "variants"
BASE = "sparkforge/base-local:bookworm"
CA = "/etc/ssl/certs/ca-certificates.crt"


def _docker_ok() -> str | None:
    try:
        proc = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no docker CLI or engine: {exc}"
    if proc.returncode != 0:
        return "the Docker engine does not answer (start it with scripts/docker-up.sh)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _docker_ok()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "tests/docker/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def base_image() -> str:
    """The local Debian base; `make base-local` makes it (CI does before the tests)."""
    proc = subprocess.run(["docker", "image", "inspect", BASE], capture_output=True)
    if proc.returncode != 0:
        subprocess.run(["bash", str(ROOT / "scripts" / "base-local.sh"), BASE], check=True)
    return BASE


def sparkforge(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run the real command line."""
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def build_args(variant: str, *extra: str, images: Path = VARIANTS, mods: Path | None = None) -> list[str]:
    args = ["--images", str(images)]
    if mods is not None:
        args += ["--mods", str(mods)]
    return args + ["build", variant, "--base", BASE, "--ca-cert", CA, *extra]


@dataclass(frozen=True)
class BuiltImage:
    variant: str
    tag: str
    moving_tag: str
    image_id: str


def image_id(ref: str) -> str | None:
    proc = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


@pytest.fixture(scope="session")
def test_image(base_image: str) -> BuiltImage:
    """The test variant (real vLLM 0.17.0 wheel, real install-phase mods), built once per session."""
    proc = sparkforge(*build_args("testvllm"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    show = sparkforge("--images", str(VARIANTS), "show", "testvllm", "--base", base_image, "--json")
    import json

    plan = json.loads(show.stdout)
    ident = image_id(plan["tag"])
    assert ident, f"{plan['tag']} missing after build"
    return BuiltImage("testvllm", plan["tag"], plan["moving_tag"], ident)
