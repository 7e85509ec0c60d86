"""The current variant ng030 (vLLM 0.30.0) against the real 0.30.0 release: its pins are the ones that
release records and asks for, its mods apply there, the mods it leaves out are not needed there, and
`outdated` sets its mods against the newer releases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from sparkforge import inimage
from sparkforge.recipe import sources
from sparkforge.recipe.config import load_mod
from sparkforge.repro.outdated import outdated
from sparkforge.recipe.layout import Layout, digest_tree
from sparkforge.recipe.plan import Mod
from sparkforge.recipe.planner import plan_variant
from sparkforge.recipe.remote import materialize

# Real vLLM sources: release sdists from the package index (cached after the first run).
pytestmark = pytest.mark.network

LAYOUT = Layout.default()
VARIANT = "ng030"
# Left out of ng030 because vLLM 0.30.0 has upstream's own fix; each mod's description says where.
NOT_NEEDED = {
    "fix-qwen35-tp4-marlin": "no in_proj_ba construction found",
    "marlin-sm12x-fp8": "csrc/quantization/marlin/marlin.cu: file to patch not found",
    "mtp-nvfp4-exclusion": "not needed: ",
}


def mod(name: str) -> Mod:
    spec, folder = load_mod(LAYOUT.mods_dir, name)
    return Mod(name, digest_tree(folder), str(folder), spec)


@pytest.fixture(scope="module")
def vllm_0300() -> Path:
    return sources.release_tree("vllm", "0.30.0")


def test_the_plan_pins_what_the_records_give() -> None:
    plan = plan_variant(LAYOUT, VARIANT)
    assert plan.base.ref == ("nvcr.io/nvidia/pytorch:26.09-py3@sha256:"
                             "6e8ccc607fc2a51e3741667b86316a0889418ba8b78ed0ba96e8d282b648a7a6")
    assert (plan.vllm.source, plan.vllm.ref, plan.vllm.version) == ("git", "v0.30.0", "0.30.0")
    assert plan.vllm.commit.value == "ced6857afa0ea7b2e3f0846a62e1394e90f15607"
    assert plan.build.torch_cuda_arch_list == "12.1a"
    # The one open pin, with its reason; nothing else is left unpinned.
    unpinned = dict(plan.unpinned())
    assert set(unpinned) == {"components.cutlass.commit"}
    assert "v4.7.1" in unpinned["components.cutlass.commit"]


def test_the_commit_is_the_one_the_release_records(vllm_0300: Path) -> None:
    recorded = sources.recorded_commit(vllm_0300)
    assert recorded == "ced6857af"
    assert plan_variant(LAYOUT, VARIANT).vllm.commit.value.startswith(recorded)


def test_the_components_are_the_versions_the_release_asks_for(vllm_0300: Path) -> None:
    components = {c.name: c for c in plan_variant(LAYOUT, VARIANT).components}
    cmake = (vllm_0300 / "CMakeLists.txt").read_text()
    assert re.search(r'set\(CUTLASS_REVISION "([^"]+)"\)', cmake).group(1) == components["cutlass"].ref
    cuda = (vllm_0300 / "requirements" / "cuda.txt").read_text()
    pinned = re.search(r"^flashinfer-python==(\S+)", cuda, re.M).group(1)
    assert (components["flashinfer"].package, components["flashinfer"].version.value) == ("flashinfer-python", pinned)


def test_every_mod_declares_the_release() -> None:
    plan = plan_variant(LAYOUT, VARIANT)
    assert [m.name for m in plan.mods] == ["uf17-eager-allreduce", "serve-torchrun"]
    for m in plan.mods:
        assert SpecifierSet(m.spec.targets.versions).contains("0.30.0"), m.name


def test_check_mods_applies_every_mod_to_the_real_source(cli) -> None:
    proc = cli("check-mods", VARIANT, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(f"{VARIANT} ")]
    mods = [row for row in rows if " env " not in row]
    assert len(mods) == 2 and all(" applied " in row for row in mods), rows
    assert "vllm 0.30.0 (PyPI, commit ced6857af)" in mods[0]
    # the one env name ng030 sets at run time, the UF17 toggle, is read by the release with its mods
    assert [row.split()[3] for row in rows if " env " in row] == ["read"], rows


@pytest.mark.parametrize("name", sorted(NOT_NEEDED))
def test_the_mods_left_out_are_not_needed_in_the_release(name: str, vllm_0300: Path, fast_tmp: Path) -> None:
    m = mod(name)
    assert not SpecifierSet(m.spec.targets.versions).contains("0.30.0")
    root = sources.scratch_copy(vllm_0300, fast_tmp / "root")
    result = inimage.apply_mod(materialize(m)[0], Path(m.folder), root)
    assert result.state == inimage.ModState.FAILED
    assert NOT_NEEDED[name] in result.detail, result.detail


def test_outdated_sets_every_mod_against_the_newer_releases(fast_tmp: Path) -> None:
    releases = {"vllm": ["0.29.0", "0.30.0", "0.31.0"], "flashinfer-python": ["0.6.18.post1", "0.7.0"]}
    report = outdated(plan_variant(LAYOUT, VARIANT), fast_tmp, releases=releases.__getitem__)
    comps = {c.component: c for c in report.components}
    assert comps["vllm"].newer == ("0.31.0",) and comps["flashinfer"].newer == ("0.7.0",)
    assert report.mods == ("uf17-eager-allreduce", "serve-torchrun")
    cells = {(c.mod, c.version): c for c in report.cells}
    assert set(cells) == {("uf17-eager-allreduce", "0.31.0"), ("serve-torchrun", "0.31.0")}
    for cell in cells.values():
        assert (cell.state, cell.declared) == ("applied", True), cell
    assert report.applies_to("serve-torchrun") == [("0.31.0", "0.31.0")]
