"""The platform of a plan: a Spark's linux/arm64 unless the recipe, its wheel set or --platform says otherwise;
part of the tag; refused in one line where the wheel set cannot run; on the buildx line of a dry run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkforge.errors import ConfigError
from sparkforge.recipe.config import load_variant
from sparkforge.recipe.planner import plan_variant, resolve
from tests.support.recipes import layout, unlocked_images

PYPI = """\
base:
  repository: example.org/base
  tag: "1.0"
  digest: {unknown: not resolved in this test}
vllm:
  source: pypi
  version: "0.33.0"
build:
  torch_cuda_arch_list: "12.1a"
"""


def images(tmp_path: Path, **recipes: str) -> Path:
    folder = unlocked_images(tmp_path / "images")
    for name, text in recipes.items():
        (folder / f"{name}.yaml").write_text(text)
    return folder


def test_a_spark_variant_is_built_for_arm64_and_a_test_variant_says_amd64(tmp_path: Path) -> None:
    folder = images(tmp_path, plain=PYPI, x86=PYPI + "platform: linux/amd64\n",
                    wheels=PYPI + "python: {version: '3.12', platform: x86_64-manylinux_2_36}\n")
    plans = {name: plan_variant(layout(folder), name) for name in ("plain", "x86", "wheels", "ng17", "pypi033")}
    assert {name: p.platform for name, p in plans.items()} == {
        "plain": "linux/arm64", "x86": "linux/amd64", "wheels": "linux/amd64", "ng17": "linux/arm64",
        "pypi033": "linux/arm64"}
    assert plans["plain"].arch == "arm64" and plans["x86"].arch == "amd64"


def test_two_plans_that_differ_only_in_platform_have_different_tags(tmp_path: Path) -> None:
    folder = images(tmp_path, plain=PYPI)
    arm = plan_variant(layout(folder), "plain")
    x86 = plan_variant(layout(folder), "plain", platform="linux/amd64")
    assert x86.platform == "linux/amd64" and arm.tag != x86.tag
    assert {k: v for k, v in arm.identity().items() if k != "platform"} == \
        {k: v for k, v in x86.identity().items() if k != "platform"}


def test_a_platform_the_wheel_set_cannot_run_is_refused_naming_the_field(tmp_path: Path) -> None:
    folder = images(tmp_path, both=PYPI + "platform: linux/arm64\npython: {version: '3.12', platform: "
                                          "x86_64-manylinux_2_36}\n")
    with pytest.raises(ConfigError) as caught:
        plan_variant(layout(folder), "both")
    assert caught.value.field == "platform" and str(caught.value.path).endswith("both.yaml")
    assert "linux/arm64 does not run the wheel set's x86_64 wheels" in str(caught.value)
    with pytest.raises(ConfigError) as given:
        plan_variant(layout(folder), "pypi033", platform="linux/amd64")  # aarch64 wheels
    assert given.value.field == "--platform"


@pytest.mark.parametrize("value", ["linux/riscv64", "arm64", "", "linux/arm64/v8"])
def test_a_platform_sparkforge_does_not_build_for_is_one_line(tmp_path: Path, value: str) -> None:
    folder = images(tmp_path, plain=PYPI)
    with pytest.raises(ConfigError) as caught:
        resolve(load_variant(folder, "plain"), layout(folder), platform=value)
    assert caught.value.field == "--platform" and "linux/arm64, linux/amd64" in str(caught.value)


def test_a_recipe_platform_outside_the_two_is_refused_by_the_schema(tmp_path: Path) -> None:
    folder = images(tmp_path, odd=PYPI + "platform: linux/s390x\n")
    with pytest.raises(ConfigError) as caught:
        plan_variant(layout(folder), "odd")
    assert caught.value.field == "platform"


def test_the_dry_run_builds_for_the_platform_and_show_says_it(cli) -> None:
    dry = cli("build", "ng17", "--dry-run", check=True).stdout
    line = next(x for x in dry.splitlines() if x.startswith("docker buildx build"))
    assert " --platform linux/arm64 " in line
    other = cli("--platform", "linux/amd64", "build", "ng17", "--dry-run", check=True).stdout
    assert " --platform linux/amd64 " in other
    tags = [next(x for x in out.splitlines() if "--tag" in x).split("--tag ")[1].split()[0] for out in (dry, other)]
    assert tags[0] != tags[1]
    assert "  platform    linux/arm64" in cli("show", "ng17", check=True).stdout
    bad = cli("--platform", "linux/mips", "show", "ng17")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --platform: 'linux/mips' is not a platform")


def test_a_platform_the_builder_cannot_run_stops_the_build_in_one_line(tmp_path: Path, monkeypatch) -> None:
    """The engine's answers stand in here (`docker version`, `docker buildx inspect`); tests/cluster/test_arm64.py
    builds for arm64 on the real engine, which emulates it."""
    from sparkforge.build import builder
    from sparkforge.errors import BuildError

    plan = plan_variant(layout(images(tmp_path, plain=PYPI)), "plain")
    monkeypatch.setattr(builder, "engine_arch", lambda host: "amd64")
    monkeypatch.setattr(builder, "builder_platforms", lambda opts: ("linux/amd64", "linux/386"))
    with pytest.raises(BuildError) as caught:
        builder.require_platform(plan, builder.BuildOptions())
    assert caught.value.field == "platform"
    assert str(caught.value).startswith("platform: the engine is amd64 and its builder runs no linux/arm64 steps (it "
                                        "runs linux/amd64, linux/386): register QEMU's binfmt handlers")
    monkeypatch.setattr(builder, "builder_platforms", lambda opts: ("linux/amd64", "linux/arm64"))
    builder.require_platform(plan, builder.BuildOptions())  # emulated: it builds
    monkeypatch.setattr(builder, "engine_arch", lambda host: "arm64")
    monkeypatch.setattr(builder, "builder_platforms", lambda opts: ())
    builder.require_platform(plan, builder.BuildOptions())  # its own platform needs nothing listed
