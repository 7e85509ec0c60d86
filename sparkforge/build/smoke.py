"""Smoke stage: run checks inside a built image before any moving tag points at it.

Tiers: `static` needs no GPU (versions, mods, protected packages, build record, entry points);
`gpu` checks CUDA and the device's arch; `serve` starts vLLM with a small model and asks for
one completion. Tiers that need a GPU run only where the host has one and the image holds a CUDA
build of torch; elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError
from ..files import name_path
from ..inimage.contract import ContractError, SmokeCheck
from ..proc import CommandError, run
from . import dockercli

TIERS = ("static", "gpu", "serve")
DEFAULT_SERVE_MODEL = "Qwen/Qwen3-0.6B"


@dataclass(frozen=True)
class Check:
    name: str
    state: str  # ok | failed | skipped
    detail: str = ""


@dataclass(frozen=True)
class TierResult:
    tier: str
    checks: tuple[Check, ...]
    skipped: str | None = None  # why the whole tier was skipped

    @property
    def ok(self) -> bool:
        return all(c.state != "failed" for c in self.checks)


def gpu_missing_reason() -> str | None:
    """Why GPU tiers cannot run on this host, or None when an NVIDIA GPU and runtime are present."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this host (nvidia-smi not found)"
    try:
        proc = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=dockercli.QUICK)
    except CommandError as exc:
        return str(exc)
    if proc.returncode != 0 or "GPU" not in proc.stdout:
        return "no NVIDIA GPU on this host (nvidia-smi lists none)"
    info = dockercli.run(["info", "--format", "{{json .Runtimes}}"], what="docker info")
    if "nvidia" not in info.stdout and not shutil.which("nvidia-container-cli"):
        return "the NVIDIA container toolkit is not installed, so containers cannot see the GPU"
    return None


def image_cuda_reason(image: str) -> str | None:
    """Why an image cannot use a GPU (no torch, or a torch built without CUDA), or None when it can."""
    proc = dockercli.run(["run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
                          "import torch; print(torch.version.cuda or '')"],
                         what="docker run (torch.version.cuda)", timeout=120, check=False)
    if proc.returncode != 0:
        return f"{image} has no importable torch ({dockercli.last_line(proc.stderr, 'no output')})"
    if not proc.stdout.strip():
        return f"{image} holds a torch built without CUDA (torch.version.cuda is None)"
    return None


def _gpu_tier_reason(image: str) -> str | None:
    return gpu_missing_reason() or image_cuda_reason(image)


def _run_in_image(image: str, args: list[str], *, gpu: bool = False,
                  timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cmd = ["run", "--rm", "--network", "none", "--entrypoint", "python3"]
    if gpu:
        cmd += ["--gpus", "all"]
    cmd += [image, "-I", "-B", "/opt/sparkforge/inimage", *args]
    return dockercli.run(cmd, what=f"docker run {' '.join(args[:3])}", timeout=timeout, check=False)


def _parse(proc: subprocess.CompletedProcess[str]) -> tuple[Check, ...]:
    checks = []
    for line in proc.stdout.splitlines():
        try:
            item = SmokeCheck.from_json(line, "smoke check")
        except ContractError:
            continue  # not a check line (a warning the image's Python printed)
        checks.append(Check(item.check, item.state.value, item.detail))
    if not checks:
        checks.append(Check("run the checks in the image", "failed", dockercli.last_line(proc.stderr, "no output")))
    return tuple(checks)


def run_static(image: str) -> TierResult:
    """The static tier: the image's own checks, every CUDA extension against the plan's GPUs among them."""
    return TierResult("static", _parse(_run_in_image(image, ["smoke", "--tier", "static"])))


def run_gpu(image: str) -> TierResult:
    reason = _gpu_tier_reason(image)
    if reason:
        return TierResult("gpu", (), skipped=reason)
    return TierResult("gpu", _parse(_run_in_image(image, ["smoke", "--tier", "gpu"], gpu=True)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # (host, port) for AF_INET


def _running(name: str) -> bool:
    proc = dockercli.run(["container", "inspect", "--format", "{{.State.Running}}", name], check=False)
    return proc.stdout.strip() == "true"


def _wait_healthy(name: str, port: int, timeout: float) -> str | None:
    """None once /health answers 200; else why not (the container died, or the time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return None
        except OSError:
            pass
        if not _running(name):
            return "the server's container exited"
        time.sleep(3)
    return f"no answer on /health within {timeout:.0f} s"


def _complete(model: str, port: int) -> Check:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
    except (OSError, ValueError, KeyError) as exc:
        return Check("one completion", "failed", str(exc))
    return Check("one completion", "ok" if text.strip() else "failed", repr(text))


def run_serve(image: str, model: str = DEFAULT_SERVE_MODEL, timeout: float = 900,
              log_dir: Path = Path("build/logs")) -> TierResult:
    """Start `vllm serve` with a small model on a free port, ask for one completion, then stop it.

    The container is not started with --rm: when the tier fails, its log is kept in log_dir.
    """
    reason = _gpu_tier_reason(image)
    if reason:
        return TierResult("serve", (), skipped=reason)
    port = free_port()
    name = f"sparkforge-serve-{os.getpid()}-{port}"
    start = dockercli.run(["run", "-d", "--name", name, "--gpus", "all", "--network", "host", "--ipc", "host",
                           "--entrypoint", "vllm", image, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                           "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"],
                          what="docker run vllm serve", timeout=120, check=False)
    if start.returncode != 0:
        return TierResult("serve", (Check("start vllm serve", "failed", dockercli.last_line(start.stderr, "")),))
    try:
        problem = _wait_healthy(name, port, timeout)
        checks = [Check("server healthy", "failed" if problem else "ok", problem or f"{model} on 127.0.0.1:{port}")]
        if not problem:
            checks.append(_complete(model, port))
        if any(c.state == "failed" for c in checks):
            log_dir.mkdir(parents=True, exist_ok=True)
            log = log_dir / f"{name}.log"
            logs = dockercli.run(["logs", name], what="docker logs", timeout=60, check=False)
            try:
                log.write_text(logs.stdout + logs.stderr, encoding="utf-8")
            except OSError as exc:  # a full disk names no file of its own
                name_path(exc, log)
                raise
            checks.append(Check("server log kept", "failed", str(log)))
    finally:
        dockercli.run(["stop", "-t", "10", name], what="docker stop", timeout=60, check=False)
        dockercli.run(["rm", "-f", name], what="docker rm", timeout=60, check=False)
    return TierResult("serve", tuple(checks))


def run_tier(tier: str, image: str, model: str = DEFAULT_SERVE_MODEL) -> TierResult:
    if tier == "static":
        return run_static(image)
    if tier == "gpu":
        return run_gpu(image)
    if tier == "serve":
        return run_serve(image, model)
    raise BuildError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}", field="--tier")
