"""Every command resolves a variant to the same plan: recipe, --base, then the lock beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparkforge.errors import ConfigError
from sparkforge.build.pipeline import LockPolicy, load_plan
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from tests.support.paths import IMAGES, ROOT

LOCKED = sorted(p.name.removesuffix(".lock.json") for p in IMAGES.glob("*.lock.json"))
LAYOUT = Layout.default()


def _dry_run_tag(cli, *args: str) -> str:
    proc = cli(*args, "--dry-run", check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("tag "))
    return line.split()[1]


def test_shipped_locks_exist() -> None:
    assert {"ng16", "ng17", "ng17e"} <= set(LOCKED)


@pytest.mark.parametrize("variant", LOCKED)
def test_show_and_build_name_the_locked_tag(cli, variant: str) -> None:
    loaded = load_plan(LAYOUT, variant)
    assert loaded.lock == IMAGES / f"{variant}.lock.json"
    shown = json.loads(cli("show", variant, "--json", check=True).stdout)["tag"]
    assert shown == loaded.plan.tag
    assert _dry_run_tag(cli, "build", variant) == shown
    # The lock really changes the plan (its epoch at least), so agreeing means applying it everywhere.
    assert plan_variant(LAYOUT, variant).tag != shown


def _of_ng17e() -> list[Path]:
    """What build/ holds of ng17e (its contexts, logs, wheels): other tests write into build/ at the same time."""
    return sorted(p for p in (ROOT / "build").rglob("*") if "ng17e" in str(p.relative_to(ROOT))) \
        if (ROOT / "build").exists() else []


def test_dry_run_prints_the_command_and_writes_nothing(cli, tmp_path: Path) -> None:
    before = _of_ng17e()
    proc = cli("build", "ng17e", "--dry-run", "--base", "example.org/base:1", "--max-jobs", "3", check=True)
    assert _of_ng17e() == before
    command = proc.stdout.splitlines()[-1]
    assert command.startswith("docker buildx build ")
    assert "--build-arg MAX_JOBS=3" in command
    # A git source: the command is the compile-inside one, and the output says the build looks in the wheel cache.
    assert "note        a build first looks in the wheel cache" in proc.stdout and "--target" not in command
    without = cli("build", "ng17e", "--dry-run", "--base", "example.org/base:1", "--no-wheel-cache", check=True)
    assert "wheel cache" not in without.stdout and without.stdout.splitlines()[-1].startswith("docker buildx build ")
    tag = proc.stdout.splitlines()[0].split()[1]
    assert tag == json.loads(cli("show", "ng17e", "--json", "--base", "example.org/base:1", check=True).stdout)["tag"]


def test_stale_lock_is_ignored_with_a_warning_and_refused_when_locked(cli, tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    recipe = images / "ng17.yaml"
    recipe.write_text(recipe.read_text().replace("os_packages: [ccache]", "os_packages: [ccache, curl]"))
    layout = Layout.default(images_dir=images)
    loaded = load_plan(layout, "ng17")
    assert loaded.lock is None and "ng17.lock.json not used" in loaded.warnings[0]
    assert loaded.plan.tag == plan_variant(layout, "ng17").tag
    with pytest.raises(ConfigError, match="recipe changed after it was locked"):
        load_plan(layout, "ng17", lock_policy=LockPolicy.LOCKED)
    proc = cli("--images", str(images), "build", "ng17", "--locked", "--dry-run")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "ng17.lock.json" in proc.stderr and "Traceback" not in proc.stderr


def test_ignore_policy_is_the_recipe_alone() -> None:
    assert load_plan(LAYOUT, "ng17e", lock_policy=LockPolicy.IGNORE).plan.tag == plan_variant(LAYOUT, "ng17e").tag
