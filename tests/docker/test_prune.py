"""`prune` on the real head engine: candidates and kept builds nothing names go; whatever a moving tag, a current
tag, a deploy record or a running build names stays, under every tag of its image."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from sparkforge.build.pipeline import context_dir, load_plan, same_plan_lock
from sparkforge.files import locked
from sparkforge.distribute.images import STATE_DIR
from sparkforge.recipe.layout import Layout
from tests.support.recipes import pypi_recipe

pytestmark = pytest.mark.docker


def image(ref: str, content: str) -> str:
    """A tiny image of its own (docker import of one file), tagged ref; its ID."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("marker")
        info.size = len(content.encode())
        tar.addfile(info, io.BytesIO(content.encode()))
    done = subprocess.run(["docker", "import", "-", ref], input=data.getvalue(), capture_output=True, timeout=120,
                          check=True)
    return done.stdout.decode().strip()


def tags(repo: str) -> set[str]:
    done = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                          capture_output=True, text=True, timeout=120, check=True)
    return set(done.stdout.split())


def test_prune_removes_only_what_nothing_names(tmp_path: Path, cli) -> None:
    repo = f"sparkforge-test/prune-{os.getpid()}"  # a repository of this test's own
    images = tmp_path / "images"
    images.mkdir()
    (images / "pr.yaml").write_text(f"image: {repo}\n" + pypi_recipe("0.17.0"))
    layout = Layout.default(images_dir=images)
    plan = load_plan(layout, "pr").plan
    old = f"{repo}:pr-0123456789ab"  # an earlier plan's immutable tag
    made = {
        "moving": image(f"{repo}:pr", "current"),
        "candidate": image(f"{plan.tag}-candidate", "candidate"),
        "kept": image(f"{old}.aaaaaaaaaaaa", "kept, named by nothing"),
        "deployed": image(f"{old}.bbbbbbbbbbbb", "kept, deployed"),
        "old-candidate": image(f"{old}-candidate", "an earlier plan's candidate"),
        "other-running": image(f"{repo}:pr-fedcba987654-candidate", "another plan's (--base) build, running"),
        "moved": image(f"{repo}:pr-111111111111.dddddddddddd", "deployed as pr-111111111111, then --move-tag"),
    }
    subprocess.run(["docker", "tag", f"{repo}:pr", plan.tag], check=True, timeout=60)
    subprocess.run(["docker", "tag", f"{repo}:pr", f"{old}.cccccccccccc"], check=True, timeout=60)  # the current image
    state = STATE_DIR / (repo.replace("/", "_") + ".json")
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"deploys": {"spark2": [{"tag": f"{old}.bbbbbbbbbbbb", "at": "2026-11-01T00:00:00Z"},
                                                        {"tag": f"{repo}:pr-111111111111", "at": "2026-11-02T00:00:00Z"}]}}))
    other_lock = context_dir(plan).parent / "pr-fedcba987654.lock"
    before = tags(repo)
    try:
        with locked(other_lock, timeout=5, what="builds"):  # a build of another plan of the variant is running
            dry = cli("--images", str(images), "prune", "--dry-run", check=True)
        assert tags(repo) == before  # a dry run removes nothing
        assert not (context_dir(plan).parent / f"{context_dir(plan).name}.lock").exists()  # and makes no lock file
        assert f"kept {repo}:pr-fedcba987654-candidate: a build of it is running" in dry.stdout
        assert (f"kept {repo}:pr-111111111111.dddddddddddd: a deploy record names {repo}:pr-111111111111"
                in dry.stdout)
        assert f"would remove candidate {plan.tag}-candidate" in dry.stdout
        assert f"would remove kept build {old}.aaaaaaaaaaaa" in dry.stdout
        assert f"would remove candidate {old}-candidate" in dry.stdout
        assert f"kept {old}.bbbbbbbbbbbb: a deploy record names it" in dry.stdout
        assert f"kept {old}.cccccccccccc: its image is also a current or deployed build" in dry.stdout
        assert "would remove 3 items" in dry.stdout, dry.stdout

        with same_plan_lock(plan), locked(other_lock, timeout=5, what="builds"):  # both builds run: candidates stay
            busy = cli("--images", str(images), "prune", check=True)
        assert f"kept {plan.tag}-candidate: a build of it is running" in busy.stdout
        assert f"removed kept build {old}.aaaaaaaaaaaa" in busy.stdout and "removed 2 items" in busy.stdout
        assert tags(repo) == before - {f"{old}.aaaaaaaaaaaa", f"{old}-candidate"}

        done = cli("--images", str(images), "prune", check=True)
        assert f"removed candidate {plan.tag}-candidate" in done.stdout and "removed 2 items," in done.stdout
        assert tags(repo) == {f"{repo}:pr", plan.tag, f"{old}.cccccccccccc", f"{old}.bbbbbbbbbbbb",
                              f"{repo}:pr-111111111111.dddddddddddd"}
        ids = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", f"{repo}:pr",
                              f"{old}.bbbbbbbbbbbb"], capture_output=True, text=True, check=True, timeout=60).stdout
        assert ids.split() == [made["moving"], made["deployed"]]
        again = cli("--images", str(images), "prune", check=True)
        assert "nothing to remove" in again.stdout
    finally:
        state.unlink(missing_ok=True)
        other_lock.unlink(missing_ok=True)
        subprocess.run(["docker", "image", "rm", "--force", *tags(repo)], capture_output=True, timeout=120)


def test_prune_refuses_while_a_recipe_does_not_load(tmp_path: Path, cli) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "ok.yaml").write_text("image: sparkforge-test/prune-ok\n" + pypi_recipe("0.17.0"))
    (images / "broken.yaml").write_text("image: [\n")
    proc = cli("--images", str(images), "prune", "--dry-run")
    assert proc.returncode == 2 and "broken.yaml" in proc.stderr and "prune needs every recipe to load" in proc.stderr
    assert "Traceback" not in proc.stderr
