"""diff compares every field of the plan: two plans that differ anywhere are never "0 changes"."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from sparkforge.repro.diff import SECTIONS, diff, diff_snapshots, from_plan
from sparkforge.recipe.lock import make_lock
from sparkforge.recipe.lockfile import lock_path, write_lock
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.plan import Component, Plan, PythonTarget, Vllm, WheelFile, WheelPin, rehash
from sparkforge.recipe.planner import plan_variant
from tests.support.paths import ROOT, VARIANTS
from tests.support.recipes import layout, unlocked_images


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return unlocked_images(tmp_path / "images")


# Each case: a child of ng17 that changes one field, and the (section, change line) diff must show.
ONE_FIELD = {
    "os_packages added": ("os_packages: [ccache, git]", "os_packages", "+ git"),
    "os_packages version": ("os_packages: [ccache=4.8]", "os_packages", "~ ccache: (none) -> 4.8"),
    "protect": ("protect: [torch]", "protect", "- numpy"),
    "build arch list": ("build: {torch_cuda_arch_list: '12.1a'}", "build",
                        "~ TORCH_CUDA_ARCH_LIST: 12.0a;12.1a -> 12.1a"),
    "build max_jobs": ("build: {max_jobs: 2}", "build", "~ MAX_JOBS: 8 -> 2"),
    "build nvcc_threads": ("build: {nvcc_threads: 1}", "build", "~ NVCC_THREADS: 2 -> 1"),
    "build env": ("build: {env: {CMAKE_BUILD_TYPE: Release}}", "build", "+ env CMAKE_BUILD_TYPE Release"),
    "env value": ("env: {VLLM_UF_EAGER_ALLREDUCE: '1'}", "env", "~ VLLM_UF_EAGER_ALLREDUCE: 0 -> 1"),
    "env added": ("env: {NCCL_DEBUG: INFO}", "env", "+ NCCL_DEBUG INFO"),
    "image": ("image: example.org/team/vllm", "image", "~ image: sparkforge/vllm -> example.org/team/vllm"),
    "base tag": ("base: {tag: 26.03-py3}", "base",
                 "~ base: nvcr.io/nvidia/vllm:26.02-py3 (digest unknown) -> nvcr.io/nvidia/vllm:26.03-py3 "
                 "(digest unknown)"),
    "vllm repo": ("vllm: {repo: 'https://github.com/fork/vllm.git'}", "vllm",
                  "~ repo: https://github.com/vllm-project/vllm.git -> https://github.com/fork/vllm.git"),
    "vllm install_deps": ("vllm: {install_deps: true}", "vllm", "~ install_deps: no -> yes"),
    "component repo": ("components: {cutlass: {git: 'https://github.com/fork/cutlass.git'}}", "components",
                       "~ cutlass: git https://github.com/NVIDIA/cutlass.git v4.4.0 @ UNPINNED, dest /opt/cutlass -> "
                       "git https://github.com/fork/cutlass.git v4.4.0 @ UNPINNED, dest /opt/cutlass"),
    "component pip_install": ("components: {cutlass: {pip_install: true}}", "components",
                              "+ cutlass.pip_install yes"),
    "mod removed": ("mods: {remove: [serve-torchrun]}", "mods", "- serve-torchrun sha256:"),
    "gpus": ("gpus: ['12.1']", "build", "~ gpus: 12.0 12.1 -> 12.1"),
    "kernels not needed": ("kernels_not_needed: {_vllm_fa3_C: Hopper only}", "build",
                           "~ kernels_not_needed: none -> _vllm_fa3_C"),
}


@pytest.mark.parametrize("case", sorted(ONE_FIELD))
def test_a_child_that_changes_one_field_is_one_change(case: str, images: Path) -> None:
    body, section, line = ONE_FIELD[case]
    (images / "kid.yaml").write_text(f"extends: ng17\n{body}\n")
    d = diff("ng17", "kid", layout(images))
    assert {c.section for c in d.changes} == {section}, [c.line() for c in d.changes]
    assert any(c.line().startswith(line) for c in d.changes), [c.line() for c in d.changes]


def test_the_cli_names_each_section_that_differs(images: Path, cli) -> None:
    (images / "kid.yaml").write_text(textwrap.dedent("""\
        extends: ng17
        image: example.org/team/vllm
        os_packages: [ccache, git]
        protect: [torch, numpy]
        build: {max_jobs: 2}
        env: {VLLM_UF_EAGER_ALLREDUCE: '1'}
        """))
    proc = cli("--images", str(images), "diff", "ng17", "kid", check=True)
    out = proc.stdout
    assert "  image       ~ image: sparkforge/vllm -> example.org/team/vllm" in out
    assert "  os_packages + git" in out
    assert "  protect     - torchaudio" in out
    assert "  build       ~ MAX_JOBS: 8 -> 2" in out
    assert "  env         ~ VLLM_UF_EAGER_ALLREDUCE: 0 -> 1" in out
    assert "  vllm        same: 0.17.0 (git v0.17.0 @ b31e9326a7d9)" in out
    # protect loses torchaudio, torchvision and triton: three entries; one each elsewhere.
    assert out.rstrip().endswith("7 changes"), out


def test_a_variant_against_itself_is_0_changes(images: Path) -> None:
    d = diff("ng17e", "ng17e", layout(images))
    assert d.changes == ()


def test_a_lock_does_not_know_the_image_and_says_so(images: Path) -> None:
    plan = plan_variant(layout(images), "ng17")
    write_lock(lock_path(images, "ng17"), make_lock(plan, {}, 1767225600, packages={"numpy": "2.1.0"},
                                                    packages_unresolved=None))
    d = diff(str(lock_path(images, "ng17")), "ng17", layout(images))
    assert not d.in_section("image") and not d.in_section("env")
    assert any(n.startswith("image of lock ") and "a lock file does not record it" in n for n in d.notes)
    # What a lock holds is compared, so the variant with that lock applied reads as the same.
    assert [c.line() for c in d.changes] == []
    # And a lock of another variant differs where the variants do.
    d = diff(str(lock_path(images, "ng17")), "ng17e", layout(images))
    assert [c.name for c in d.changes] == ["vllm", "flashinfer", "ray", "SOURCE_DATE_EPOCH"], d.changes


# ------------------------------------------------------------------ every field of the plan


# Fields that name the variant, describe it (a description, why a distribution is left out), or are covered
# by another field: the mod's digest
# is a hash over its folder, mod.yaml included, so `spec` and `folder` never change alone; a wheel's
# `local` is where its `path` lies on this host, not part of the plan.
SKIP = {"variant", "chain", "recipe_files", "description", "plan_hash", "spec", "folder", "local", "unknown",
        "reasons"}
# What a component of the other kind does not have (resolve refuses a recipe that sets them).
NOT_OF_PYPI = {"repo", "ref", "commit"}
# Tuples of the plan, by what they hold.
ITEMS = {"components", "mods", "wheel_set"}
PAIRS = {"env", "pins", "kernels_not_needed"}
NAMES = {"os_packages", "protect", "gpus", "kernels_scan", "leave_out"}
NOT_OF_KIND = {"pip": {"repo", "ref", "commit", "dest", "pip_install"}, "git": {"package", "version"}}


def changed(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every way to change one leaf below value: (where, the changed value)."""
    if dataclasses.is_dataclass(value):
        skip = SKIP | (NOT_OF_KIND[value.kind] if isinstance(value, Component) else set())
        skip |= NOT_OF_PYPI if isinstance(value, Vllm) and value.source in ("pypi", "wheel") else set()
        skip |= {"wheel"} if isinstance(value, Vllm) and value.source != "wheel" else set()
        for f in dataclasses.fields(value):
            if f.name in skip:
                continue
            for where, new in changed(getattr(value, f.name), f"{path}.{f.name}"):
                yield where, dataclasses.replace(value, **{f.name: new})
    elif isinstance(value, bool):
        yield path, not value
    elif isinstance(value, int):
        yield path, value + 1
    elif isinstance(value, str):
        yield path, value + "x"
    elif value is None and path.endswith(".python"):
        yield path, PythonTarget("3.12", "aarch64-manylinux_2_34")
    elif value is None:
        yield path, "f" * 40
    elif isinstance(value, tuple) and path.endswith(".files"):  # a locked wheel's (file, sha256, size)
        for i, (name, _sha, size) in enumerate(value):
            yield f"{path}[{i}]", value[:i] + ((name, "0" * 64, size),) + value[i + 1:]
    elif isinstance(value, tuple) and path.rsplit(".", 1)[-1] in ITEMS:
        for i, item in enumerate(value):
            for where, new in changed(item, f"{path}[{i}]"):
                yield where, value[:i] + (new,) + value[i + 1:]
    elif isinstance(value, tuple) and path.rsplit(".", 1)[-1] in PAIRS:
        yield f"{path}+", value + (("zz-added", "1"),)
        for i, (k, v) in enumerate(value):
            yield f"{path}[{i}]", value[:i] + ((k, v + "1"),) + value[i + 1:]
    elif isinstance(value, tuple) and path.rsplit(".", 1)[-1] in NAMES:
        yield f"{path}+", value + ("zz-added",)
        for i, item in enumerate(value):
            yield f"{path}[{i}]", value[:i] + (item + "x",) + value[i + 1:]
    else:
        raise AssertionError(f"{path}: no way to change a {type(value).__name__}; teach this test")


def plans() -> list[Plan]:
    """The shipped variants and the test variant: pypi and git vLLM, pip and git components."""
    out = [plan_variant(Layout.default(ROOT), v) for v in ("ng16", "ng17e")]
    out.append(plan_variant(layout(VARIANTS), "testvllm"))
    wheel = WheelFile("vllm-0.17.0-py3-none-any.whl", "a" * 64, url="https://example.invalid/vllm-0.17.0-py3-none-any.whl")
    out.append(dataclasses.replace(out[-1], variant="testwheel",
                                   vllm=dataclasses.replace(out[-1].vllm, source="wheel", wheel=wheel)))
    # A pypi source with its lock's wheel set (testvllm033's, as `lock` resolved it).
    target = PythonTarget("3.11", "x86_64-manylinux_2_36")
    out.append(dataclasses.replace(plan_variant(layout(VARIANTS), "testvllm033"), python=target, wheel_set=(
        WheelPin("vllm", "0.33.0", (("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                                     "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa", 336361138),)),)))
    # Give each a lock's package pins and an epoch, so that changing them changes something known.
    return [rehash(dataclasses.replace(p, pins=(("numpy", "2.1.0"),), source_date_epoch=1704067200))
            for p in out]


def test_every_field_of_the_plan_is_compared() -> None:
    checked = set()
    for plan in plans():
        before = from_plan(plan)
        for where, other in changed(plan, "plan"):
            after = from_plan(rehash(other))
            d = diff_snapshots(before, after)
            assert d.changes, f"{plan.variant}: {where} differs, and diff says 0 changes"
            checked.add(where.split("[")[0].rstrip("+"))
    # The walk reached the fields the issue names, and the ones after them.
    for name in ("plan.os_packages", "plan.protect", "plan.build.env", "plan.build.max_jobs", "plan.env",
                 "plan.image", "plan.base.digest.value", "plan.vllm.install_deps", "plan.pins",
                 "plan.source_date_epoch", "plan.tooling_digest"):
        assert any(c.startswith(name) for c in checked), name


def test_a_new_plan_field_shows_up_as_other() -> None:
    plan = plans()[0]
    identity = plan.identity()

    class Wider(Plan):  # a field a later version may add to Plan
        def identity(self) -> dict[str, Any]:
            return identity | {"cpu_arch": self.variant}

    a = from_plan(Wider(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}))
    b = from_plan(Wider(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)} | {"variant": "x"}))
    d = diff_snapshots(a, b)
    assert [(c.section, c.name) for c in d.changes] == [("other", "cpu_arch")]
    assert "other" in d.sections and "other" not in SECTIONS


def test_two_builds_of_one_plan_whose_images_differ_name_both_ids_and_verify_repro(images: Path) -> None:
    plan = plan_variant(layout(images), "ng17")
    a = dataclasses.replace(from_plan(plan), built=(plan.plan_hash, "sha256:" + "a" * 64))
    b = dataclasses.replace(from_plan(plan), built=(plan.plan_hash, "sha256:" + "b" * 64))
    d = diff_snapshots(a, b)
    assert not d.changes
    assert d.notes[-1:] == (f"both are builds of plan {plan.plan_hash[:12]}, yet their images differ: sha256:aaaaaaaaaaaa "
                       "and sha256:bbbbbbbbbbbb; `verify-repro VARIANT` builds it twice and names the files that "
                       "differ",)
    assert diff_snapshots(a, a).notes[-1] == "both name one image, sha256:aaaaaaaaaaaa"
    other = dataclasses.replace(b, built=("0" * 64, "sha256:" + "b" * 64))
    assert not any("both" in note for note in diff_snapshots(a, other).notes)
