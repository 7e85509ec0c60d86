"""The gpu and serve smoke tiers on a host with an NVIDIA GPU and Docker's GPU runtime, run as a user runs them
(`build.py test VARIANT --tier gpu|serve`) on a small CUDA variant built for this host's GPUs
(tests/support/cuda.py): what each tier promises, and that each fails, saying why, where the image breaks it.

- gpu: torch sees the device (by the name nvidia-smi gives it), and the device's compute capability is in
  the image's TORCH_CUDA_ARCH_LIST;
- gpu: one of vLLM's own ops (rms_norm) runs on the device and matches torch's;
- serve: `vllm serve` of the tiny model made offline, on a free port of 127.0.0.1, answers /health and gives
  exactly the 8 greedy tokens asked on /v1/completions and /v1/chat/completions; the container is removed and
  the port free afterwards; when the server dies, its log is kept and named.

Elsewhere they skip, with the reason (tests/support/needs.py: gpu, gpu-runtime, cuda-driver).
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.cuda import VARIANT, devices, recipe, smoke_rows
from tests.support.docker import BASE, build_args, image_id

pytestmark = [pytest.mark.gpu, pytest.mark.docker, pytest.mark.network, pytest.mark.needs("gpu-runtime", "cuda-driver")]

# Replaces the image's `vllm` entry point: a server that dies at once, saying so on stderr.
DIES = "sparkforge-test: this server refuses to start"


class Cuda:
    """The CUDA variant built on this host: its recipe folder, tag, and the GPUs it is for."""

    def __init__(self, images: Path, gpus: list[tuple[str, str]]) -> None:
        self.images = images
        self.capabilities = sorted({capability for capability, _ in gpus})
        self.names = {name for _, name in gpus}
        self.arch_list = ";".join(self.capabilities)
        self.tag = json.loads(self.cli("show", VARIANT, "--base", BASE, "--json").stdout)["tag"]

    def cli(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return run_cli("--images", str(self.images), *args, **({"cwd": cwd} if cwd else {}), timeout=3600)

    def test(self, tier: str, cwd: Path, image: str | None = None) -> subprocess.CompletedProcess:
        return self.cli("test", VARIANT, "--base", BASE, "--tier", tier, *(["--image", image] if image else []),
                        cwd=cwd)

    def on_broken_image(self, tier: str, name: str, steps: str, cwd: Path,
                        files: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """The tier on an image made from the variant's by a few Dockerfile steps (and files in their context),
        tagged name and removed after."""
        ref, context = f"sparkforge-test/{name}:{self.tag.rsplit('-', 1)[1]}", cwd / "context"
        context.mkdir(parents=True, exist_ok=True)
        for file, text in (files or {}).items():
            (context / file).write_text(text)
        (context / "Dockerfile").write_text(f"FROM {self.tag}\n{steps}\n")
        made = subprocess.run(["docker", "buildx", "build", "--load", "--network", "none", "-t", ref, str(context)],
                              capture_output=True, text=True, timeout=600)
        assert made.returncode == 0, made.stderr[-3000:]
        try:
            return self.test(tier, cwd, image=ref)
        finally:
            subprocess.run(["docker", "image", "rm", "-f", ref], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def cuda(base_image: str, tmp_path_factory) -> Cuda:
    """The CUDA variant, built once for this host's GPUs (the static tier is the docker tier's to test:
    `--no-smoke`, so that what this wheel's kernels cover on this GPU does not decide these tests)."""
    gpus = devices()
    images = tmp_path_factory.mktemp("cuda-images")
    (images / f"{VARIANT}.yaml").write_text(recipe(sorted({capability for capability, _ in gpus})))
    proc = run_cli(*build_args(VARIANT, "--no-smoke", images=images), timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Cuda(images, gpus)


def arch_row(rows: dict[tuple[str, str], tuple[str, str]], capabilities: list[str]) -> tuple[str, str]:
    """The gpu tier's row for the arch list: the device torch calls 0 is one of this host's GPUs."""
    names = [("gpu", f"sm_{c.replace('.', '')} in TORCH_CUDA_ARCH_LIST") for c in capabilities]
    found = [rows[name] for name in names if name in rows]
    assert len(found) == 1, rows
    return found[0]


def test_the_gpu_tier_sees_the_device_and_finds_its_arch_in_the_list(cuda: Cuda, tmp_path: Path) -> None:
    proc = cuda.test("gpu", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = smoke_rows(proc.stdout)
    assert len(rows) == 3, rows
    state, name = rows["gpu", "torch.cuda.is_available()"]
    assert state == "ok" and name in cuda.names, (name, cuda.names)
    assert arch_row(rows, cuda.capabilities) == ("ok", cuda.arch_list)
    assert rows["gpu", "vLLM rms_norm on the device"][0] == "ok", rows


def test_the_gpu_tier_fails_on_an_arch_list_without_the_device(cuda: Cuda, tmp_path: Path) -> None:
    other = next(arch for arch in ("8.0", "9.0", "7.5") if arch not in cuda.capabilities)
    edit = ("import json; p = '/opt/sparkforge/plan.json'; d = json.load(open(p)); "
            f"d['build']['torch_cuda_arch_list'] = '{other}'; json.dump(d, open(p, 'w'))")
    proc = cuda.on_broken_image("gpu", "gpu-wrong-arch", f'RUN python3 -c "{edit}"', tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = smoke_rows(proc.stdout)
    assert rows["gpu", "torch.cuda.is_available()"][0] == "ok", rows
    assert arch_row(rows, cuda.capabilities) == ("failed", other)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _containers_on(port: int) -> list[str]:
    names = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                           timeout=60, check=True).stdout.split()
    return [n for n in names if n.startswith("sparkforge-serve-") and n.endswith(f"-{port}")]


def test_the_serve_tier_answers_one_completion_and_leaves_nothing_running(cuda: Cuda, tmp_path: Path) -> None:
    proc = cuda.test("serve", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = smoke_rows(proc.stdout)
    assert sorted(rows) == [("serve", "chat: 8 greedy tokens"), ("serve", "completion: 8 greedy tokens"),
                            ("serve", "server ready"), ("serve", "time to first token")], rows
    state, detail = rows["serve", "server ready"]
    assert state == "ok" and detail.startswith("sparkforge-tiny on http://127.0.0.1:"), detail
    port = int(detail.split("127.0.0.1:", 1)[1].split(",", 1)[0])
    assert all(state == "ok" for state, _ in rows.values()), rows
    assert _containers_on(port) == [] and not _listening(port)
    assert not (tmp_path / "build" / "logs").exists()  # a log is kept only when the tier fails


def test_the_serve_tier_keeps_the_log_of_a_server_that_dies(cuda: Cuda, tmp_path: Path) -> None:
    steps = 'COPY vllm /tmp/vllm-dies\nRUN install -m 755 /tmp/vllm-dies "$(command -v vllm)"'
    proc = cuda.on_broken_image("serve", "serve-dies", steps, tmp_path,
                                {"vllm": f"#!/bin/sh\necho '{DIES}' >&2\nexit 3\n"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = smoke_rows(proc.stdout)
    assert rows["serve", "server answers"] == ("failed", "the server exited (code 3)"), rows
    state, detail = rows["serve", "server log"]
    log = detail.split(": ", 1)[0]
    assert state == "failed" and log.startswith("build/logs/sparkforge-serve-") and log.endswith(".log"), log
    assert DIES in detail
    assert DIES in (tmp_path / log).read_text()
    assert _containers_on(int(log.removesuffix(".log").rsplit("-", 1)[1])) == []
    assert image_id(cuda.tag) is not None  # the variant's own image is untouched
