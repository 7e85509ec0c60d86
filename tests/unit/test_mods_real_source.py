"""Every shipped mod against the real vLLM source it targets (release sdists from PyPI, cached).

These are the checks behind `check-mods`: a mod applies, a second application is detected as
already applied, and an edited target makes the mod fail with its name and the reason while
the file stays untouched.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkforge import imagetool, sources
from sparkforge.checkmods import apply_in_scratch, applies_ranges, matrix
from sparkforge.config import load_mod
from sparkforge.plan import Layout, Mod, digest_tree, plan_variant

ROOT = Path(__file__).resolve().parents[2]
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
def scratch(vllm_0170: Path, tmp_path: Path) -> Path:
    return sources.scratch_copy(vllm_0170, tmp_path / "root")


@pytest.mark.parametrize("name", VLLM_MODS)
def test_mod_applies_then_is_already_applied(name: str, scratch: Path) -> None:
    m = mod(name)
    spec = m.spec.model_dump(mode="json")
    first = imagetool.apply_mod(spec, Path(m.folder), scratch)
    assert first.state == imagetool.APPLIED, first.detail
    checks = imagetool.verify_mod(spec, scratch, in_image=False)
    assert [c for c in checks if c[1] == "failed"] == []
    assert any(c[1] == "ok" for c in checks)
    second = imagetool.apply_mod(spec, Path(m.folder), scratch)
    assert second.state == imagetool.ALREADY
    assert second.line() == f"mod {name}: already applied, skipped"


@pytest.mark.parametrize("name", VLLM_MODS)
def test_edited_target_fails_with_name_and_reason_and_stays_untouched(name: str, scratch: Path) -> None:
    m = mod(name)
    spec = m.spec.model_dump(mode="json")
    target_rel = spec["verify"][0]["file"]
    target = scratch / target_rel
    text = target.read_text()
    anchor = {"uf17-eager-allreduce": "def set_splitting_ops_for_attn_fusion(self):",
              "fix-qwen35-tp4-marlin": "in_proj_ba"}[name]
    assert anchor in text
    edited = text.replace(anchor, anchor.upper())
    target.write_text(edited)
    others = {p: p.read_bytes() for p in (scratch / "vllm").rglob("*.py")}
    result = imagetool.apply_mod(spec, Path(m.folder), scratch)
    assert result.state == imagetool.FAILED
    assert result.line().startswith(f"mod {name}: FAILED: ")
    assert "vllm/" in result.detail  # names the file
    assert {p: p.read_bytes() for p in (scratch / "vllm").rglob("*.py")} == others
    assert target.read_text() == edited


def test_the_cached_tree_is_never_changed_by_scratch_edits(vllm_0170: Path, tmp_path: Path) -> None:
    target = vllm_0170 / "vllm" / "config" / "compilation.py"
    before = target.read_bytes()
    results = apply_in_scratch([mod("uf17-eager-allreduce")], vllm_0170, tmp_path / "root")
    assert results[0][1] == "applied"
    assert target.read_bytes() == before
    assert (tmp_path / "root" / "vllm" / "config" / "compilation.py").read_bytes() != before


def test_the_in_image_applier_is_the_same_code(vllm_0170: Path, tmp_path: Path) -> None:
    """Run imagetool.py as the image build does, on a rendered context, against the real source."""
    ctx = tmp_path / "ctx"
    subprocess.run([sys.executable, str(ROOT / "build.py"), "render", "ng17", "-o", str(ctx)], check=True,
                   capture_output=True)
    root = sources.scratch_copy(vllm_0170, tmp_path / "site-packages")
    tool = ctx / "sparkforge" / "imagetool.py"
    for name in VLLM_MODS:
        assert json.loads((ctx / "mods" / name / "mod.json").read_text())["name"] == name
        cmd = [sys.executable, str(tool), "apply", str(ctx / "mods" / name), "--root", str(root),
               "--record", str(tmp_path / f"{name}.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"mod {name}: applied"
        assert json.loads((tmp_path / f"{name}.json").read_text())["result"] == "applied"
        again = subprocess.run(cmd, capture_output=True, text=True)
        assert again.stdout.strip() == f"mod {name}: already applied, skipped"
    # Break the first mod's target: the build step must fail, naming the mod and the hunk.
    compilation = root / "vllm" / "config" / "compilation.py"
    pristine = (vllm_0170 / "vllm" / "config" / "compilation.py").read_text()
    compilation.write_text(pristine.replace("def set_splitting_ops_for_attn_fusion(self):", "def renamed(self):"))
    broken = compilation.read_bytes()
    proc = subprocess.run([sys.executable, str(tool), "apply", str(ctx / "mods" / "uf17-eager-allreduce"),
                           "--root", str(root)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "mod uf17-eager-allreduce: FAILED: vllm/config/compilation.py: hunk @@" in proc.stderr
    assert compilation.read_bytes() == broken


def test_check_mods_command_passes_for_ng17(cli) -> None:
    proc = cli("check-mods", "ng17", check=True)
    assert "uf17-eager-allreduce" in proc.stdout and "fix-qwen35-tp4-marlin" in proc.stdout
    assert "0 failed" in proc.stdout


def test_check_mods_fails_on_a_broken_mod(tmp_path: Path, cli) -> None:
    mods = tmp_path / "mods"
    shutil.copytree(ROOT / "mods", mods)
    patch = mods / "uf17-eager-allreduce" / "uf17.patch"
    patch.write_text(patch.read_text().replace("             self.cudagraph_mode = CUDAGraphMode.NONE",
                                               "             self.cudagraph_mode = CUDAGraphMode.FULL"))
    proc = cli("--mods", str(mods), "check-mods", "ng17")
    assert proc.returncode == 1
    assert "failed" in proc.stdout and "hunk @@" in proc.stdout


def test_matrix_finds_where_each_mod_starts_and_stops(tmp_path: Path) -> None:
    versions = ["0.16.0", "0.17.0", "0.18.1", "0.19.0"]
    cells = matrix([mod(n) for n in VLLM_MODS], versions, tmp_path)
    assert applies_ranges(cells, "uf17-eager-allreduce") == [("0.16.0", "0.19.0")]
    assert applies_ranges(cells, "fix-qwen35-tp4-marlin") == [("0.17.0", "0.18.1")]
    for cell in cells:
        assert (cell.state in ("applied", "already")) == cell.declared, cell


def test_shipped_variants_only_list_mods_that_fit_their_pin() -> None:
    for variant in ("ng16", "ng17", "ng17e"):
        plan = plan_variant(LAYOUT, variant)
        assert plan.mods, f"{variant} lists no mods"
