"""The workflow users run in their own repository (.github/workflows/sparkforge.yml): its shape (every action
pinned by commit, least privilege), and its check-mods job run as written on a push to a clone."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.paths import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "sparkforge.yml"


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_every_action_is_pinned_by_commit_and_every_job_names_its_permissions() -> None:
    doc = workflow()
    assert doc["permissions"] == {}
    assert set(doc["jobs"]) == {"check-mods", "outdated", "build"}
    for name, job in doc["jobs"].items():
        assert job["permissions"] and job["timeout-minutes"], name
        assert "write" not in job["permissions"].get("contents", ""), name
        for step in job["steps"]:
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), step["uses"]
                assert step["with"]["persist-credentials"] is False, name
            else:
                assert "${{" not in step["run"], f"{name}: an expression in a script; pass it through env"
    for line in WORKFLOW.read_text().splitlines():
        if "uses:" in line:
            assert re.search(r"@[0-9a-f]{40} # v\d+\.\d+\.\d+$", line), line


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True, env=env,
                          timeout=120).stdout.strip()


@pytest.mark.network  # check-mods reads vLLM's release source from PyPI (cached)
def test_the_check_mods_job_runs_as_written_on_a_push_and_checks_only_the_variant_it_touches(tmp_path: Path) -> None:
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    # The project environment is this checkout's, already made: `make venv` finds it up to date.
    (clone / ".venv").symlink_to(ROOT / ".venv")
    stamp = (ROOT / ".venv" / ".requirements.lock").stat().st_mtime
    os.utime(clone / "requirements.lock", (stamp - 1, stamp - 1))
    recipe = clone / "images" / "pypi033.yaml"
    recipe.write_text(recipe.read_text().replace("\ndescription: ", "\ndescription: (edited) ", 1))
    before = git(clone, "rev-parse", "HEAD")
    git(clone, "commit", "--quiet", "-am", "edit pypi033's description")
    steps = workflow()["jobs"]["check-mods"]["steps"]
    assert "actions/checkout@" in steps[0]["uses"] and steps[0]["with"]["fetch-depth"] == 0
    # What the runner gives each step's env for a push: github.event.before is the commit the push started from.
    given = {"SINCE": before}
    outputs = []
    for step in steps[1:]:
        assert set(step.get("env", {})) <= set(given), step
        env = {**os.environ, **{k: given[k] for k in step.get("env", {})}}
        proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=1800)
        assert proc.returncode == 0, (step["name"], proc.stdout + proc.stderr)
        outputs.append(proc)
    last = outputs[-1]
    assert f"pypi033: touched by {recipe.resolve()}" in last.stderr, last.stderr
    assert "checking pypi033" in last.stderr and "checking ng17" not in last.stderr, last.stderr
    assert re.search(r"\d+ results: \d+ ok, 0 failed", last.stdout), last.stdout


def test_a_change_touches_the_variants_of_its_recipe_lock_or_mods_and_a_change_of_sparkforge_touches_all() -> None:
    from sparkforge.recipe.config import list_variants
    from sparkforge.recipe.layout import Layout
    from sparkforge.recipe.planner import plan_variant
    from sparkforge.repro.verbs import touched_variants

    layout = Layout.default()
    plans = [plan_variant(layout, name) for name in list_variants(layout.images_dir)]
    users = {p.variant for p in plans if "mtp-nvfp4-exclusion" in [m.name for m in p.mods]}
    assert users and users != {p.variant for p in plans}

    def touched(*paths: str) -> set[str]:
        return {name for name, _ in touched_variants(layout, plans, [(ROOT / p).resolve() for p in paths])}

    assert touched("mods/mtp-nvfp4-exclusion/mod.yaml") == users
    assert touched("README.md", "tests/variants/testvllm.yaml") == set()
    assert touched("images/ng17.lock.json") == {"ng17"}
    # ng17e extends ng17: a change of ng17's recipe touches both.
    assert touched("images/ng17.yaml") == {p.variant for p in plans if "ng17" in p.chain}
    assert touched("sparkforge/inimage/patch.py") == {p.variant for p in plans}


def test_changed_since_is_read_as_a_commit_never_as_an_option_of_git(tmp_path: Path) -> None:
    from tests.support.cli import assert_one_line, run_cli

    target = tmp_path / "written"
    for since in (f"--output={target}", "no-such-commit"):
        assert_one_line(run_cli("check-mods", f"--changed-since={since}"), "--changed-since: git cannot compare with",
                        "fetch-depth: 0")
    assert not target.exists()
