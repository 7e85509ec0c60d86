"""Smoke stage: run checks inside a built image before any moving tag points at it.

Tiers: `static` (no GPU), `gpu` (CUDA and the device's arch) and `serve` (the image's own `vllm serve` asked for
exact greedy tokens); a CUDA image's GPU tiers are skipped, with the reason, where host or torch lack CUDA.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError
from ..files import name_path
from ..inimage.contract import ContractError, SmokeCheck
from ..inimage.proc import CommandError, run
from ..serve import TOKENS, Model, ServeError, ask, cache_dir, log_summary, model_of, wait_ready
from . import dockercli

TIERS = ("static", "gpu", "serve")
SERVE_READY = 900.0  # seconds the serve tier's server may take to load the model and answer /health
SERVE_LOGS = Path("build/logs")  # where a failed serve tier keeps its server's log


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


def gpu_reason(image: str) -> str | None:
    """Why GPU tiers cannot run `image` here (no NVIDIA GPU or container toolkit, no CUDA torch), or None."""
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
    proc = dockercli.run(["run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
                          "import torch; print(torch.version.cuda or '')"],
                         what="docker run (torch.version.cuda)", timeout=120, check=False)
    if proc.returncode != 0:
        return f"{image} has no importable torch ({dockercli.last_line(proc.stderr, 'no output')})"
    if not proc.stdout.strip():
        return f"{image} holds a torch built without CUDA (torch.version.cuda is None)"
    return None


def _smoke_in_image(image: str, tier: str, *, gpu: bool = False) -> tuple[Check, ...]:
    """The checks the image's own `smoke --tier TIER` prints, one JSON line each."""
    cmd = ["run", "--rm", "--network", "none", "--entrypoint", "python3", *(["--gpus", "all"] if gpu else []),
           image, "-I", "-B", "/opt/sparkforge/inimage", "smoke", "--tier", tier]
    done = dockercli.run(cmd, what=f"docker run smoke --tier {tier}", timeout=600, check=False)
    checks = []
    for line in done.stdout.splitlines():
        try:
            item = SmokeCheck.from_json(line, "smoke check")
        except ContractError:
            continue  # not a check line (a warning the image's Python printed)
        checks.append(Check(item.check, item.state.value, item.detail))
    if not checks:
        checks.append(Check("run the checks in the image", "failed", dockercli.last_line(done.stderr, "no output")))
    return tuple(checks)


def run_static(image: str) -> TierResult:
    """The static tier: the image's own checks, every CUDA extension against the plan's GPUs among them."""
    return TierResult("static", _smoke_in_image(image, "static"))


def run_gpu(image: str, *, cpu: bool = False) -> TierResult:
    reason = "the image is built for the CPU (device: cpu)" if cpu else gpu_reason(image)
    if reason:
        return TierResult("gpu", (), skipped=reason)
    return TierResult("gpu", _smoke_in_image(image, "gpu", gpu=True))


def _ended(name: str) -> str | None:
    """Why the server's container can no longer answer (it exited, with its code), or None while it runs."""
    proc = dockercli.run(["container", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name],
                         what="docker container inspect", check=False)
    status, _, code = proc.stdout.strip().partition(" ")
    if proc.returncode != 0:
        return "the server's container is gone"
    return None if status in ("created", "running") else f"the server exited (code {code or '?'})"


def serve_command(image: str, name: str, model: Model, port: int, *, cpu: bool) -> list[str]:
    """`docker run` of the image's own `vllm serve` on 127.0.0.1:port, host network, the model read-only."""
    cmd = ["run", "-d", "--name", name, "--network", "host", "--ipc", "host", *model.mount()]
    if cpu:  # a small KV cache: the CPU attention's default takes far more memory than a check needs
        cmd += ["-e", "VLLM_CPU_KVCACHE_SPACE=1"]
    else:
        cmd += ["--gpus", "all"]
    cmd += ["--entrypoint", "vllm", image, "serve", model.arg, "--served-model-name", model.served,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256"]
    return cmd + (["--enforce-eager"] if cpu else ["--gpu-memory-utilization", "0.3"])


def run_serve(image: str, model: Model, *, cpu: bool = False) -> TierResult:
    """Start the image's own `vllm serve`, ask it for exactly TOKENS greedy tokens (completion and chat), remove
    it; on a failure its log is kept in SERVE_LOGS."""
    if not cpu and (reason := gpu_reason(image)):
        return TierResult("serve", (), skipped=reason)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a port nothing listens on right now
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])  # (host, port) for AF_INET
    name = f"sparkforge-serve-{os.getpid()}-{port}"
    try:
        checks = _serve_checks(image, name, model, port, cpu=cpu)
    finally:
        left = dockercli.remove_container(name)
    if left:
        checks.append(Check("server removed", "failed", f"{name} is left on the engine: {left} (docker rm -f {name})"))
    return TierResult("serve", tuple(checks))


def _serve_checks(image: str, name: str, model: Model, port: int, *, cpu: bool) -> list[Check]:
    """Start the server as container `name`, ask it, and say what happened (its log kept on a failure)."""
    base = f"http://127.0.0.1:{port}"
    start = dockercli.run(serve_command(image, name, model, port, cpu=cpu), what="docker run vllm serve",
                          timeout=120, check=False)
    if start.returncode != 0:
        return [Check("start vllm serve", "failed", dockercli.last_line(start.stderr, ""))]
    checks: list[Check] = []
    try:
        loaded = wait_ready(base, lambda: _ended(name), SERVE_READY)
        checks.append(Check("server ready", "ok", f"{model.served} on {base}, /health after {loaded:.1f} s"))
        first = ask(base, model.served, "completion", tokens=1)
        checks.append(Check("time to first token", "ok", f"{first.seconds:.2f} s"))
        for kind in ("completion", "chat"):
            answer = ask(base, model.served, kind)
            problem = answer.problem(TOKENS)
            checks.append(Check(f"{kind}: {TOKENS} greedy tokens", "failed" if problem else "ok",
                                problem or f"{answer.text!r} in {answer.seconds:.2f} s"))
    except ServeError as exc:
        checks.append(Check("server answers", "failed", str(exc)))
    if any(c.state == "failed" for c in checks):  # the server's log is kept, and its last lines said
        logs = dockercli.run(["logs", name], what="docker logs", timeout=60, check=False)
        text = logs.stdout + logs.stderr
        log = SERVE_LOGS / f"{name}.log"
        try:
            SERVE_LOGS.mkdir(parents=True, exist_ok=True)
            log.write_text(text, encoding="utf-8")
        except OSError as exc:  # a full disk names no file of its own
            name_path(exc, log)
            raise
        checks.append(Check("server log", "failed", f"{log}: {log_summary(text)}"))
    return checks


def run_tier(tier: str, image: str, model: Model | None = None, *, cpu: bool = False) -> TierResult:
    if tier == "static":
        return run_static(image)
    if tier == "gpu":
        return run_gpu(image, cpu=cpu)
    if tier == "serve":
        return run_serve(image, model or model_of(None, cache_dir()), cpu=cpu)
    raise BuildError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}", field="--tier")
