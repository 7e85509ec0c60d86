"""The seed's images as shipped: each of ng16, ng17 and ng17e lists every seed feature whose mod fits its
pin, in the order of seed 001's feature list (pure: recipes and mod.yaml only)."""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sparkforge.recipe.config import load_mod
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from tests.support.paths import ROOT

# Seed 001's features that have a mod, in its order (1 Marlin SM12x, 5 streaming fix, 6 MTP + NVFP4,
# 7 UF17, 10 serve_torchrun), with seed 000's Marlin TP=4 fix before the torchrun server.
SEED_ORDER = ["marlin-sm12x-fp8", "streaming-tool-calls", "mtp-nvfp4-exclusion", "uf17-eager-allreduce",
              "fix-qwen35-tp4-marlin", "serve-torchrun"]


@pytest.mark.parametrize("variant", ["ng16", "ng17", "ng17e"])
def test_every_seed_mod_that_fits_the_pin_is_listed_in_seed_order(variant: str) -> None:
    layout = Layout.default(ROOT)
    plan = plan_variant(layout, variant)
    listed = [m.name for m in plan.mods]
    assert listed == [n for n in SEED_ORDER if n in listed]
    for name in SEED_ORDER:
        spec, _ = load_mod(layout.mods_dir, name)
        fits = SpecifierSet(spec.targets.versions).contains(Version(plan.vllm.version), prereleases=True)
        if spec.phase == "source":
            fits = fits and plan.vllm.source == "git"
        assert (name in listed) == fits, (variant, name, spec.targets.versions, plan.vllm.version)
