"""mod.json for a mod the tests write by hand: a spec of mod.yaml's fields (only some given), as the build
context holds it, so that the applier reads it as it reads a rendered one."""

from __future__ import annotations

from typing import Any

from sparkforge.inimage.seam import MOD_VERSION, ModDoc


def mod_doc(spec: dict[str, Any]) -> ModDoc:
    """The ModDoc of a spec: what mod.yaml would say, with the applier's fields that are not given empty."""
    return ModDoc.from_dict({
        "name": spec["name"], "component": spec.get("component", "vllm"), "phase": spec.get("phase", "install"),
        "kind": spec["kind"], "patch": spec.get("patch"), "patcher": spec.get("patcher"),
        "files": [{"mode": "0644"} | f for f in spec.get("files", [])],
        "verify": [{"file": None, "contains": None, "python": None, "needs": []} | v for v in spec.get("verify", [])],
        "patch_source": None, "schema": MOD_VERSION}, "test mod")
