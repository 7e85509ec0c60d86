"""The smoke tiers that run inside a built image: static (no GPU) and gpu."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

from .apply import component_root, verify_mod
from .contract import BuildRecord, CheckState, ContractError, ModState, Phase, parse_json
from .kernels import check_home
from .paths import ModFailure
from .record import check_protected, installed, mod_results
from .run import CUDA_TIMEOUT, python
from .seam import ComponentKind, read_mod, read_plan

Checks = list[tuple[str, CheckState, str]]


def _public(version: str | None) -> str | None:
    return version.split("+")[0] if version else version


def smoke_static(home: Path) -> Checks:
    """The static smoke tier: (check, ok|failed|skipped, detail). Needs no GPU."""
    checks: Checks = []

    def add(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, CheckState.OK if ok else CheckState.FAILED, detail))

    try:
        record = BuildRecord.from_json((home / "build-record.json").read_bytes(), str(home / "build-record.json"))
        plan = read_plan(home / "plan.json")
    except (OSError, ContractError) as exc:
        return [("build record present", CheckState.FAILED, str(exc))]
    add("build record present", record.plan_hash == plan.plan_hash, str(home / "build-record.json"))
    want, have = plan.vllm.version, installed(plan.vllm.package)
    add(f"{plan.vllm.package} {want} installed", (have if "+" in want else _public(have)) == want, f"installed: {have}")
    for comp in plan.components:
        if comp.kind == ComponentKind.PIP:
            name = (comp.package or comp.name).split("[")[0]
            pinned, have = comp.version.value, installed(name)
            ok = have is not None and (pinned is None or _public(have) == pinned)
            add(f"{name} {pinned or '(unpinned)'} installed", ok, f"installed: {have}")
        else:
            marker = Path(comp.dest or "/") / ".sparkforge-commit"
            have = marker.read_text().strip() if comp.dest and marker.exists() else None
            pinned = comp.commit.value
            add(f"{comp.name} at {pinned or comp.ref}", have is not None and (pinned is None or have == pinned),
                f"{comp.dest}: {have}")
    changed = check_protected(home / "protect")
    protected = parse_json((home / "protect" / "protected.json").read_text())
    if protected:  # else none was recorded, so none was compared
        add("base packages not replaced by pip", not changed,
            "; ".join(changed) or ", ".join(f"{k} {v}" for k, v in sorted(protected.items())))
    else:
        checks.append(("base packages not replaced by pip", CheckState.SKIPPED,
                       f"the base has none of the protected packages ({', '.join(plan.protect) or 'none listed'})"))
    results = {entry.name: entry.result for entry in mod_results(home)}
    for mod in plan.mods:
        name = mod.name
        add(f"mod {name} recorded", results.get(name) in (ModState.APPLIED, ModState.ALREADY),
            getattr(results.get(name), "value", "not recorded"))
        try:
            spec = read_mod(home / "mods" / name / "mod.json")
            root = component_root(spec.component)
        except (ContractError, ModFailure) as exc:
            add(f"mod {name}: component root", False, str(exc))
            continue
        for label, state, detail in verify_mod(spec, root, in_image=True):
            if spec.phase == Phase.SOURCE and not label.startswith("python:"):
                # A source-phase mod edits the source tree before the compile; its file checks ran
                # there when it was applied (the record above), and the tree is not in the image.
                state, detail = CheckState.SKIPPED, "checked in the source tree at build time"
            missing = re.fullmatch(r"ModuleNotFoundError: No module named '([\w.]+)'", detail)
            if (state == CheckState.FAILED and missing and not plan.vllm.install_deps
                    and importlib.util.find_spec(missing.group(1).split(".")[0]) is None):
                # As `needs` does for declared modules: vLLM was installed --no-deps, so its own
                # dependencies are the base's to provide, and this base lacks one.
                state, detail = CheckState.SKIPPED, (f"needs {missing.group(1)}, not installed (vllm was installed "
                                                     "with --no-deps; the base provides its dependencies)")
            checks.append((f"mod {name}: {label}", state, detail))
    entry = shutil.which("vllm")
    add("vllm entry point on PATH", entry is not None, entry or "not found")
    if any(m.name == "serve-torchrun" for m in plan.mods):
        server = Path("/opt/sparkforge/serve_torchrun.py")
        add("torchrun server script", server.is_file() and os.access(server, os.X_OK), str(server))
    # Every CUDA extension against the plan's GPUs (the record the build's kernel scan wrote).
    checks += [(name, CheckState(state), detail) for name, state, detail in check_home(home)]
    return checks


# One of vLLM's own kernels on the device, against torch's own arithmetic: vllm._custom_ops.rms_norm (the same
# signature in every release sparkforge builds) loads vLLM's CUDA extension and runs its RMSNorm kernel.
RMS_NORM = """
import json, torch
from vllm import _custom_ops as ops
x = torch.randn(8, 256, device="cuda", dtype=torch.float16)
w = torch.rand(256, device="cuda", dtype=torch.float16) + 0.5
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
torch.cuda.synchronize()
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
print(json.dumps({"max_error": float((out.float() - ref).abs().max())}))
"""
RMS_NORM_TOLERANCE = 0.05  # float16 rounding of values near 1 to 4


def smoke_gpu(home: Path, limit: float = CUDA_TIMEOUT) -> Checks:
    """The gpu smoke tier: CUDA works, the arch list covers the device, and vLLM's rms_norm gives torch's result."""
    try:
        plan = read_plan(home / "plan.json")
    except ContractError as exc:
        return [("plan readable", CheckState.FAILED, str(exc))]
    code = ("import json, torch; ok = torch.cuda.is_available(); "
            "print(json.dumps({'ok': ok, 'cap': list(torch.cuda.get_device_capability(0)) if ok else None, "
            "'name': torch.cuda.get_device_name(0) if ok else None}))")
    ok, out, why = python(code, limit=limit, what="the CUDA check")
    if not ok:
        return [("torch.cuda.is_available()", CheckState.FAILED, why)]
    info = json.loads(out.strip().splitlines()[-1])
    checks: Checks = [("torch.cuda.is_available()", CheckState.OK if info["ok"] else CheckState.FAILED,
                        str(info["name"]))]
    if info["ok"]:
        major, minor = info["cap"]
        arches = plan.build.torch_cuda_arch_list.split(";")
        covered = any(a.rstrip("afPTX+").rstrip(".") == f"{major}.{minor}" for a in arches)
        checks.append((f"sm_{major}{minor} in TORCH_CUDA_ARCH_LIST", CheckState.OK if covered else CheckState.FAILED,
                       plan.build.torch_cuda_arch_list))
        checks.append(_rms_norm(limit))
    return checks


def _rms_norm(limit: float) -> tuple[str, CheckState, str]:
    name = "vLLM rms_norm on the device"
    ok, out, why = python(RMS_NORM, limit=limit, what="vLLM's rms_norm")
    if not ok:
        return name, CheckState.FAILED, why
    error = float(json.loads(out.strip().splitlines()[-1])["max_error"])
    ok = error <= RMS_NORM_TOLERANCE
    return name, CheckState.OK if ok else CheckState.FAILED, f"largest difference from torch's: {error:.4f}"
