"""Every shipped mod against the real vLLM source it targets (release sdists from PyPI, cached).

These are the checks behind `check-mods`: a mod applies, a second application is detected as
already applied, and an edited target makes the mod fail with its name and the reason while
the file stays untouched.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sparkforge import inimage
from sparkforge.recipe import sources
from sparkforge.repro.checkmods import apply_in_scratch, applies_ranges, matrix
from sparkforge.recipe.config import load_mod
from sparkforge.recipe.layout import Layout, digest_tree
from sparkforge.recipe.plan import Mod
from sparkforge.recipe.planner import plan_variant
from tests.support.cli import run_cli
from tests.support.paths import MODS
from sparkforge.recipe.remote import materialize

# Real vLLM sources: release sdists from the package index (cached after the first run).
pytestmark = pytest.mark.network

LAYOUT = Layout.default()
VLLM_MODS = ["uf17-eager-allreduce", "fix-qwen35-tp4-marlin"]


def mod(name: str) -> Mod:
    spec, folder = load_mod(LAYOUT.mods_dir, name)
    return Mod(name, digest_tree(folder), str(folder), spec)


@pytest.fixture(scope="module")
def vllm_0170() -> Path:
    tree = sources.release_tree("vllm", "0.17.0")
    assert sources.recorded_commit(tree) == "b31e9326a"
    return tree


@pytest.fixture
def scratch(vllm_0170: Path, fast_tmp: Path) -> Path:
    return sources.scratch_copy(vllm_0170, fast_tmp / "root")


@pytest.mark.parametrize("name", VLLM_MODS)
def test_mod_applies_then_is_already_applied(name: str, scratch: Path) -> None:
    m = mod(name)
    spec = materialize(m)[0]
    first = inimage.apply_mod(spec, Path(m.folder), scratch)
    assert first.state == inimage.ModState.APPLIED, first.detail
    checks = inimage.verify_mod(spec, scratch, in_image=False)
    assert [c for c in checks if c[1] == "failed"] == []
    assert any(c[1] == "ok" for c in checks)
    second = inimage.apply_mod(spec, Path(m.folder), scratch)
    assert second.state == inimage.ModState.ALREADY
    assert second.line() == f"mod {name}: already applied, skipped"


@pytest.mark.parametrize("name", VLLM_MODS)
def test_edited_target_fails_with_name_and_reason_and_stays_untouched(name: str, scratch: Path) -> None:
    m = mod(name)
    spec = materialize(m)[0]
    target_rel = spec.verify[0].file
    assert target_rel is not None
    target = scratch / target_rel
    text = target.read_text()
    anchor = {"uf17-eager-allreduce": "def set_splitting_ops_for_attn_fusion(self):",
              "fix-qwen35-tp4-marlin": "in_proj_ba"}[name]
    assert anchor in text
    edited = text.replace(anchor, anchor.upper())
    target.write_text(edited)
    others = {p: p.read_bytes() for p in (scratch / "vllm").rglob("*.py")}
    result = inimage.apply_mod(spec, Path(m.folder), scratch)
    assert result.state == inimage.ModState.FAILED
    assert result.line().startswith(f"mod {name}: FAILED: ")
    assert "vllm/" in result.detail  # names the file
    assert {p: p.read_bytes() for p in (scratch / "vllm").rglob("*.py")} == others
    assert target.read_text() == edited


def test_the_cached_tree_is_never_changed_by_scratch_edits(vllm_0170: Path, fast_tmp: Path) -> None:
    target = vllm_0170 / "vllm" / "config" / "compilation.py"
    before = target.read_bytes()
    results = apply_in_scratch([mod("uf17-eager-allreduce")], vllm_0170, fast_tmp / "root")
    assert results[0][1] == "applied"
    assert target.read_bytes() == before
    assert (fast_tmp / "root" / "vllm" / "config" / "compilation.py").read_bytes() != before


def test_the_in_image_applier_is_the_same_code(vllm_0170: Path, fast_tmp: Path) -> None:
    """Run the image-side package as the image build does, on a rendered context, against the real source."""
    ctx = fast_tmp / "ctx"
    proc = run_cli("render", "ng17", "-o", str(ctx))
    assert proc.returncode == 0, proc.stderr
    root = sources.scratch_copy(vllm_0170, fast_tmp / "site-packages")
    tool = ctx / "sparkforge" / "inimage"
    for name in VLLM_MODS:
        assert json.loads((ctx / "mods" / name / "mod.json").read_text())["name"] == name
        cmd = [sys.executable, "-I", str(tool), "apply", str(ctx / "mods" / name), "--root", str(root),
               "--record", str(fast_tmp / f"{name}.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"mod {name}: applied"
        assert json.loads((fast_tmp / f"{name}.json").read_text())["result"] == "applied"
        again = subprocess.run(cmd, capture_output=True, text=True)
        assert again.stdout.strip() == f"mod {name}: already applied, skipped"
    # Break the first mod's target: the build step must fail, naming the mod and the hunk.
    compilation = root / "vllm" / "config" / "compilation.py"
    pristine = (vllm_0170 / "vllm" / "config" / "compilation.py").read_text()
    compilation.write_text(pristine.replace("def set_splitting_ops_for_attn_fusion(self):", "def renamed(self):"))
    broken = compilation.read_bytes()
    proc = subprocess.run([sys.executable, "-I", str(tool), "apply", str(ctx / "mods" / "uf17-eager-allreduce"),
                           "--root", str(root)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "mod uf17-eager-allreduce: FAILED: vllm/config/compilation.py: hunk @@" in proc.stderr
    assert compilation.read_bytes() == broken


def test_check_mods_command_passes_for_ng17(cli) -> None:
    proc = cli("check-mods", "ng17", check=True)
    assert "uf17-eager-allreduce" in proc.stdout and "fix-qwen35-tp4-marlin" in proc.stdout
    assert "0 failed" in proc.stdout


def test_check_mods_fails_on_a_broken_mod(fast_tmp: Path, cli) -> None:
    mods = fast_tmp / "mods"
    shutil.copytree(MODS, mods)
    patch = mods / "uf17-eager-allreduce" / "uf17.patch"
    patch.write_text(patch.read_text().replace("             self.cudagraph_mode = CUDAGraphMode.NONE",
                                               "             self.cudagraph_mode = CUDAGraphMode.FULL"))
    proc = cli("--mods", str(mods), "check-mods", "ng17")
    assert proc.returncode == 1
    assert "failed" in proc.stdout and "hunk @@" in proc.stdout


def test_matrix_finds_where_each_mod_starts_and_stops(fast_tmp: Path) -> None:
    versions = ["0.16.0", "0.17.0", "0.18.1", "0.19.0"]
    cells = matrix([mod(n) for n in VLLM_MODS], versions, fast_tmp)
    assert applies_ranges(cells, "uf17-eager-allreduce") == [("0.16.0", "0.19.0")]
    assert applies_ranges(cells, "fix-qwen35-tp4-marlin") == [("0.17.0", "0.18.1")]
    for cell in cells:
        assert (cell.state in ("applied", "already")) == cell.declared, cell


def test_shipped_variants_only_list_mods_that_fit_their_pin() -> None:
    for variant in sorted(p.stem for p in LAYOUT.images_dir.glob("*.yaml")):
        plan = plan_variant(LAYOUT, variant)
        assert plan.mods, f"{variant} lists no mods"
        for m in plan.mods:
            if m.spec.component != "vllm":
                continue
            declared = SpecifierSet(m.spec.targets.versions)
            assert declared.contains(Version(plan.vllm.version), prereleases=True), (
                f"{variant} (vLLM {plan.vllm.version}) lists {m.name}, which targets {declared}")


# ------------------------------------------------------------------ the ranges read in the newer releases

UF17_NEWEST = ["0.29.0", "0.30.0", "0.33.0"]


def test_uf17_applies_up_to_the_newest_release_it_declares(fast_tmp: Path) -> None:
    cells = matrix([mod("uf17-eager-allreduce")], UF17_NEWEST, fast_tmp)
    assert [(c.version, c.state, c.declared) for c in cells] == [(v, "applied", True) for v in UF17_NEWEST], \
        [c.detail for c in cells]


def test_the_marlin_tp4_fix_stops_where_its_code_moved(fast_tmp: Path) -> None:
    """0.19.0 moved the GDN layer out of models/; 0.22.0 has upstream's own replication."""
    cells = matrix([mod("fix-qwen35-tp4-marlin")], ["0.19.0", "0.22.0"], fast_tmp)
    assert [(c.state, c.declared) for c in cells] == [("failed", False)] * 2
    assert all("no in_proj_ba construction found" in c.detail for c in cells)


# Every final release each new mod declares, and the first one after its range, where upstream has
# its own fix. Each declared release is checked against its real source, as check-mods does.
NEW_MODS = {
    "marlin-sm12x-fp8": (["0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0",
                          "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1"], "0.23.0"),
    "mtp-nvfp4-exclusion": (["0.15.0", "0.15.1", "0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0",
                             "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0",
                             "0.24.0"], "0.25.0"),
}


@pytest.mark.parametrize("name", sorted(NEW_MODS))
def test_new_mod_declares_exactly_the_releases_listed_here(name: str) -> None:
    declared, after = NEW_MODS[name]
    spec = SpecifierSet(mod(name).spec.targets.versions)
    releases = [v for v in sources.release_versions("vllm") if Version(v) >= Version("0.15.0")]
    assert [v for v in releases if spec.contains(v)] == declared
    assert not spec.contains(after)


@pytest.mark.parametrize("name", sorted(NEW_MODS))
def test_new_mod_applies_to_every_release_it_declares_and_not_after(name: str, fast_tmp: Path) -> None:
    declared, after = NEW_MODS[name]
    cells = matrix([mod(name)], declared + [after], fast_tmp)
    assert [(c.version, c.state) for c in cells[:-1]] == [(v, "applied") for v in declared], \
        [(c.version, c.detail) for c in cells if c.state != "applied"]
    assert all(c.declared for c in cells[:-1])
    last = cells[-1]
    assert (last.state, last.declared) == ("failed", False)
    assert last.detail.startswith("not needed: "), last.detail


def test_marlin_sm12x_edits_the_kernels_and_the_selector(vllm_0170: Path, fast_tmp: Path) -> None:
    """A source-phase mod: the kernel host code outside vllm/ is edited in the whole source tree."""
    m = mod("marlin-sm12x-fp8")
    assert m.spec.phase == "source"
    root = sources.scratch_copy(vllm_0170, fast_tmp / "root")
    result = inimage.apply_mod(materialize(m)[0], Path(m.folder), root)
    assert result.state == inimage.ModState.APPLIED, result.detail
    for kernel in ("csrc/quantization/marlin/marlin.cu", "csrc/moe/marlin_moe_wna16/ops.cu"):
        text = (root / kernel).read_text()
        assert "major_capability * 10 + minor_capability == 120" not in text
        assert "major_capability == 12,  // sparkforge mod marlin-sm12x-fp8" in text
        assert "only support SM89 or SM12x device" in text
    selector = (root / "vllm/model_executor/layers/quantization/utils/marlin_utils.py").read_text()
    assert "is_device_capability(120)" not in selector
    assert "not current_platform.is_device_capability_family(120):  # sparkforge mod" in selector


def test_marlin_sm12x_edits_only_the_kernel_upstream_left_in_0221(fast_tmp: Path) -> None:
    tree = sources.release_tree("vllm", "0.22.1")
    root = sources.scratch_copy(tree, fast_tmp / "root")
    m = mod("marlin-sm12x-fp8")
    assert inimage.apply_mod(materialize(m)[0], Path(m.folder), root).state == inimage.ModState.APPLIED
    changed = [rel for rel in ("csrc/quantization/marlin/marlin.cu", "csrc/moe/marlin_moe_wna16/ops.cu",
                               "vllm/model_executor/layers/quantization/utils/marlin_utils.py")
               if (root / rel).read_bytes() != (tree / rel).read_bytes()]
    assert changed == ["csrc/quantization/marlin/marlin.cu"]


def test_mtp_exclusion_decides_as_the_seed_describes(vllm_0170: Path, fast_tmp: Path) -> None:
    """Run the patched is_layer_excluded itself (its module needs torch, so the method is lifted out)."""
    m = mod("mtp-nvfp4-exclusion")
    root = sources.scratch_copy(vllm_0170, fast_tmp / "root")
    assert inimage.apply_mod(materialize(m)[0], Path(m.folder), root).state == inimage.ModState.APPLIED
    text = (root / "vllm/model_executor/layers/quantization/modelopt.py").read_text()
    func = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "is_layer_excluded")
    namespace = {"fnmatch": fnmatch.fnmatch, "is_layer_skipped": lambda prefix, excluded, mapping: prefix in excluded}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "modelopt.py", "exec"), namespace)

    def excluded(patterns: list[str], prefix: str) -> bool:
        config = types.SimpleNamespace(exclude_modules=patterns, packed_modules_mapping={})
        return namespace["is_layer_excluded"](config, prefix)

    assert excluded(["mtp.layers.0*", "lm_head"], "mtp.fc")  # the case the mod is for
    assert not excluded(["lm_head"], "mtp.fc")  # no mtp. pattern: the checkpoint quantized its MTP head
    assert not excluded(["mtp.layers.0*"], "model.layers.0.mlp.gate_up_proj")
    assert excluded(["lm_head"], "lm_head")  # upstream's rules still decide first
