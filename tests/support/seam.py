"""The image side as the tests run it: an image's /opt/sparkforge as render leaves it, and mod.json for a
mod the tests write by hand (a spec of mod.yaml's fields, only some given), as the build context holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparkforge.build.pipeline import load_plan
from sparkforge.build.render import context_files
from sparkforge.inimage.seam import MOD_VERSION, ModDoc
from sparkforge.recipe.layout import Layout
from tests.support.paths import ROOT


def image_home(tmp: Path, variant: str = "ng17") -> Path:
    """An image's /opt/sparkforge as render and the build leave it for variant (plan.json, the mods, the
    image-side tool, run from its own copy), under tmp."""
    layout = Layout.default(ROOT)
    home = tmp / "opt-sparkforge"
    for rel, body in context_files(load_plan(layout, variant).plan, layout).items():
        if rel.startswith("sparkforge/inimage/") or rel == "plan.json" or rel.startswith("mods/"):
            target = home / rel.removeprefix("sparkforge/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
    return home


def mod_doc(spec: dict[str, Any]) -> ModDoc:
    """The ModDoc of a spec: what mod.yaml would say, with the applier's fields that are not given empty."""
    return ModDoc.from_dict({
        "name": spec["name"], "component": spec.get("component", "vllm"), "phase": spec.get("phase", "install"),
        "kind": spec["kind"], "patch": spec.get("patch"), "patcher": spec.get("patcher"),
        "files": [{"mode": "0644"} | f for f in spec.get("files", [])],
        "verify": [{"file": None, "contains": None, "python": None, "needs": []} | v for v in spec.get("verify", [])],
        "patch_source": None, "schema": MOD_VERSION}, "test mod")
