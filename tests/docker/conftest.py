"""Fixtures for tests with a real Docker engine: the engine, the local base, the built test image,
and for distribution a real registry and three real dockerd nodes."""

from __future__ import annotations

import os
import shutil
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
        return "the Docker engine does not answer (start it, or point DOCKER_HOST at one)"
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
    """The local Debian base; made by scripts/base-local.sh (debootstrap, root) when it is missing."""
    if subprocess.run(["docker", "image", "inspect", BASE], capture_output=True).returncode == 0:
        return BASE
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip(f"{BASE} is missing, and making it needs root and debootstrap: run `sudo make base-local` once")
    subprocess.run(["bash", str(ROOT / "scripts" / "base-local.sh"), BASE], check=True)
    return BASE


@pytest.fixture(scope="session")
def torch_base(base_image: str, tmp_path_factory) -> str:
    """The local base with a real CPU torch and numpy (tests/gitsource.py), made once."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gitsource import Unavailable, ensure_torch_base

    try:
        return ensure_torch_base(base_image, tmp_path_factory.mktemp("torch-base"))
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def git_setup(torch_base: str, tmp_path_factory):
    """The git-source setup (tests/gitsource.py), shared by the git-source and wheel tests, so that
    the wheel tests find the compile of the same source in BuildKit's cache."""
    from gitsource import GitSource

    setup = GitSource(tmp_path_factory.mktemp("gitsrc"))
    yield setup
    setup.stop()


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


# ------------------------------------------------- distribution: a real registry and real nodes


@dataclass
class Registry:
    """Debian's docker-registry on 127.0.0.1:port, run by scripts/registry.sh (a real process)."""

    port: int
    state: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _script(self, action: str) -> subprocess.CompletedProcess:
        import os

        env = dict(os.environ, SPARKFORGE_STATE=str(self.state))
        return subprocess.run(["bash", str(ROOT / "scripts" / "registry.sh"), action, str(self.port)],
                              capture_output=True, text=True, env=env, timeout=60)

    def start(self) -> None:
        proc = self._script("start")
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def stop(self) -> None:
        proc = self._script("stop")
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def has_tag(self, repository: str, tag: str) -> bool:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/{repository}/tags/list", timeout=5) as resp:
                return tag in (json.load(resp).get("tags") or [])
        except OSError:
            return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    """A registry for one test module, stopped (data deleted with the tmp dir) at its end."""
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry is not installed (Debian package docker-registry)")
    reg = Registry(_free_port(), tmp_path_factory.mktemp("registry"))
    reg.start()
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def nodes():
    """Three extra real dockerd daemons (tests/infra/nodes.py), started once per module.

    max-download-attempts=1: a pull whose registry died fails at once instead of after the
    engine's default 5 attempts with a growing back-off (about 50 s), which is the same outcome.
    """
    import os
    import tempfile

    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        pytest.skip("extra dockerd nodes need root and dockerd on PATH")
    sys.path.insert(0, str(ROOT / "tests" / "infra"))
    from nodes import start_nodes, stop_nodes

    base = tempfile.mkdtemp(prefix="sfd-", dir="/tmp")  # short: unix socket paths max 107 bytes
    started = start_nodes(3, base, daemon_config={"max-download-attempts": 1})
    yield started
    try:
        stop_nodes(started, kill=True)  # throw-away nodes: no graceful shutdown to wait for
    finally:
        for node in started:
            node.destroy()
        shutil.rmtree(base, ignore_errors=True)
