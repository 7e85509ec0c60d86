"""The wheel cache's key: what decides a compiled vLLM wheel's content (key_inputs), as canonical JSON, hashed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..recipe.plan import Plan
from . import dockercli

CACHE_FORMAT = 1


def base_identity(plan: Plan, host: str | None = None) -> str | None:
    """The base's digest, or (unpinned) the digest of its layers and settings on the engine; None when unknown.
    Not the image ID: the classic and the containerd store give one base different IDs, so two keys."""
    if plan.base.digest.value:
        return plan.base.digest.value
    data = dockercli.inspect_images(plan.base.ref, host=host)[plan.base.ref]
    if data is None:
        return None
    config = data.get("Config") or {}
    seen = {
        "layers": list((data.get("RootFS") or {}).get("Layers") or []),
        "platform": [data.get("Os") or "", data.get("Architecture") or "", data.get("Variant") or ""],
        **{key: config.get(key) or None for key in ("Env", "User", "WorkingDir", "Entrypoint", "Cmd", "Shell")},
    }
    return "content sha256:" + hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()


def key_inputs(plan: Plan, base: str | None) -> tuple[dict[str, Any] | None, str]:
    """Everything the compile stages read (the wheel's content), or None and why the cache cannot be used."""
    v = plan.vllm
    if v.source != "git":
        return None, "the variant compiles no vLLM"
    if v.commit.value is None:
        return None, "vllm.commit is not pinned (lock the variant)"
    gits = [c for c in plan.components if c.kind == "git"]
    if loose := next((c for c in gits if c.commit.value is None), None):
        return None, f"components.{loose.name}.commit is not pinned (lock the variant)"
    if base is None:
        return None, f"the base {plan.base.ref} has no digest and is not on this engine"
    return {
        "format": CACHE_FORMAT,
        "vllm": {"repo": v.repo, "commit": v.commit.value, "version": v.version},
        "source_mods": [{"name": m.name, "digest": m.digest} for m in plan.mods_in("source")],
        "build_env": dict(plan.build.env),
        "torch_cuda_arch_list": plan.build.torch_cuda_arch_list,
        "base": base,
        "os_packages": list(plan.os_packages),
        "protect": list(plan.protect),
        "git_components": {c.name: c.commit.value for c in gits},
        "tooling": plan.tooling_digest,
        "platform": plan.platform,
        "source_date_epoch": plan.source_date_epoch,
    }, ""


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The inputs in which another entry differs from this build, as `field (cached: X, this build: Y)`."""
    return [f"{name} (cached: {_short(theirs.get(name))}, this build: {_short(mine.get(name))})"
            for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."
