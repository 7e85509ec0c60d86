"""Smoke stage: run checks inside a built image before any moving tag points at it.

Tiers: `static` needs no GPU (versions, mods, protected packages, build record, entry points);
`gpu` checks CUDA and the device's arch; `serve` starts vLLM with a small model and asks for
one completion. Tiers that need a GPU are skipped, with the reason, where there is none.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass

from .errors import BuildError

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
    """Why GPU tiers cannot run here, or None when an NVIDIA GPU and runtime are present."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this host (nvidia-smi not found)"
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    if proc.returncode != 0 or "GPU" not in proc.stdout:
        return "no NVIDIA GPU on this host (nvidia-smi lists none)"
    info = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True)
    if "nvidia" not in info.stdout and not shutil.which("nvidia-container-cli"):
        return "the NVIDIA container toolkit is not installed, so containers cannot see the GPU"
    return None


def _run_in_image(image: str, args: list[str], *, gpu: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3"]
    if gpu:
        cmd += ["--gpus", "all"]
    cmd += [image, "/opt/sparkforge/imagetool.py", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _parse(proc: subprocess.CompletedProcess) -> tuple[Check, ...]:
    checks = []
    for line in proc.stdout.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        checks.append(Check(item["check"], item["state"], item.get("detail", "")))
    if not checks:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        checks.append(Check("run the checks in the image", "failed", tail))
    return tuple(checks)


def run_static(image: str) -> TierResult:
    return TierResult("static", _parse(_run_in_image(image, ["smoke", "--tier", "static"])))


def run_gpu(image: str) -> TierResult:
    reason = gpu_missing_reason()
    if reason:
        return TierResult("gpu", (), skipped=reason)
    return TierResult("gpu", _parse(_run_in_image(image, ["smoke", "--tier", "gpu"], gpu=True)))


def run_serve(image: str, model: str = DEFAULT_SERVE_MODEL, port: int = 18011, timeout: float = 900) -> TierResult:
    """Start `vllm serve` with a small model, ask for one completion, then stop the server."""
    reason = gpu_missing_reason()
    if reason:
        return TierResult("serve", (), skipped=reason)
    name = f"sparkforge-serve-{int(time.time())}"
    start = subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--gpus", "all", "--network", "host",
                            "--ipc", "host", "--entrypoint", "vllm", image, "serve", model, "--port", str(port),
                            "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"],
                           capture_output=True, text=True)
    if start.returncode != 0:
        return TierResult("serve", (Check("start vllm serve", "failed", start.stderr.strip()),))
    checks = []
    try:
        deadline = time.monotonic() + timeout
        healthy = False
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    healthy = resp.status == 200
            except OSError:
                healthy = False
            if healthy:
                break
            time.sleep(5)
        checks.append(Check("server healthy", "ok" if healthy else "failed", f"{model} on :{port}"))
        if healthy:
            body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    text = json.loads(resp.read())["choices"][0]["text"]
                checks.append(Check("one completion", "ok" if text.strip() else "failed", repr(text)))
            except (OSError, ValueError, KeyError) as exc:
                checks.append(Check("one completion", "failed", str(exc)))
    finally:
        subprocess.run(["docker", "stop", "-t", "10", name], capture_output=True)
    return TierResult("serve", tuple(checks))


def run_tier(tier: str, image: str, model: str = DEFAULT_SERVE_MODEL) -> TierResult:
    if tier == "static":
        return run_static(image)
    if tier == "gpu":
        return run_gpu(image)
    if tier == "serve":
        return run_serve(image, model)
    raise BuildError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}", field="--tier")
