"""Pure tests of `source: wheel` recipes and of the wheel cache's keys, entries and pruning (real files, no Docker)."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from sparkforge.recipe import download
from sparkforge.build import prebuilt, wheelkey, wheels
from sparkforge.errors import ConfigError
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.plan import Pin
from sparkforge.recipe.planner import plan_variant
from tests.support.cli import run_cli
from tests.support.paths import IMAGES, ROOT, TEST_MODS
from tests.support.recipes import layout

SHA = "ab" * 32
NAME = "vllm-0.17.0-cp38-abi3-linux_x86_64.whl"

BASE = """image: sparkforge-test/vllm
base:
  repository: sparkforge/base-local
  tag: bookworm
  digest:
    unknown: local
build:
  torch_cuda_arch_list: 12.1a
"""


def fake_wheel(path: Path, version: str = "0.17.0") -> Path:
    """A wheel file with the METADATA a real one has (the fields the checks read)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        zf.writestr("vllm/__init__.py", "")
    return path


def run(images: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, images=images, timeout=120)


@pytest.mark.parametrize("vllm, field, message", [
    (f"source: wheel\n  url: https://h.example/{NAME}\n  path: {NAME}\n  sha256: {SHA}", "vllm.url", "one of them"),
    (f"source: wheel\n  sha256: {SHA}", "vllm.url", "give the wheel as url"),
    (f"source: wheel\n  url: https://h.example/{NAME}", "vllm.sha256", "sha256sum FILE"),
    (f"source: wheel\n  url: http://h.example/{NAME}\n  sha256: {SHA}", "vllm.url", "is not a valid https URL"),
    (f"source: wheel\n  path: ../{NAME}\n  sha256: {SHA}", "vllm.path", "is not a valid relative path"),
    (f"source: wheel\n  url: https://h.example/vllm.tar.gz\n  sha256: {SHA}", "vllm.url", "is not a wheel file name"),
    # Decoded, these would leave the download cache, or end a Dockerfile line.
    (f"source: wheel\n  url: https://h.example/vllm-0.17.0-1..%2F..%2F..%2Fout-cp38-abi3-linux_x86_64.whl\n"
     f"  sha256: {SHA}", "vllm.url", "is not a wheel file name"),
    (f"source: wheel\n  url: https://h.example/vllm-0.17.0-cp38-abi3-linux%0ARUN%20x%20%23.whl\n  sha256: {SHA}",
     "vllm.url", "is not a wheel file name"),
    (f"source: wheel\n  path: wheels/../{NAME}\n  sha256: {SHA}", "vllm.path", "is not a valid relative path"),
    (f"source: wheel\n  url: https://h.example/torch-2.13.0-cp311-cp311-linux_x86_64.whl\n  sha256: {SHA}",
     "vllm.url", "a wheel of torch, not of vllm"),
    (f"source: wheel\n  url: https://h.example/vllm-0.18.0-cp38-abi3-linux_x86_64.whl\n  sha256: {SHA}",
     "vllm.version", "is vllm 0.18.0, but the recipe says version 0.17.0"),
    (f"source: wheel\n  url: https://h.example/{NAME}\n  sha256: {SHA.upper()}", "vllm.sha256", "64 lowercase hex"),
    (f"source: wheel\n  url: https://h.example/{NAME}\n  sha256: {SHA}\n  ref: v0.17.0", "vllm.ref",
     "set ref to null"),
    (f"source: pypi\n  sha256: {SHA}", "vllm.sha256", "that is for source: wheel"),
])
def test_bad_wheel_recipes_are_one_line(tmp_path: Path, vllm: str, field: str, message: str) -> None:
    (tmp_path / "w.yaml").write_text(BASE + f"vllm:\n  {vllm}\n  version: \"0.17.0\"\n")
    proc = run(tmp_path, "show", "w")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"w.yaml: {field}: " in lines[0] and message in lines[0], lines[0]


def test_mod_new_finds_no_check_in_a_patch_of_blank_lines() -> None:
    from sparkforge.recipe.remote import verify_check

    blank = b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,1 +1,2 @@\n a = 1\n+\n"
    assert verify_check(blank, "vllm") is None
    moved = b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n-a = 1\n b = 2\n+a = 1\n"
    assert verify_check(moved, "vllm") is None
    added = b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,1 +1,2 @@\n a = 1\n+b = 2\n"
    assert verify_check(added, "vllm") == {"file": "vllm/x.py", "contains": "b = 2"}


def test_a_source_phase_mod_is_refused_for_a_wheel(tmp_path: Path) -> None:
    (tmp_path / "w.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  url: https://h.example/{NAME}\n"
                                     f"  sha256: {SHA}\n  version: \"0.17.0\"\nmods: [probe-source-mark]\n")
    proc = run(tmp_path, "--mods", str(TEST_MODS), "show", "w")
    assert proc.returncode == 2, proc.stderr
    assert "mods: probe-source-mark: is a source-phase mod, but this variant installs a prebuilt wheel" in proc.stderr


def test_a_wheel_recipe_shows_its_wheel_and_the_hash_makes_the_tag(tmp_path: Path) -> None:
    (tmp_path / "w.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  url: https://h.example/{NAME}\n"
                                     f"  sha256: {SHA}\n  version: \"0.17.0\"\n")
    (tmp_path / "v.yaml").write_text(f"extends: w\nvllm:\n  sha256: {'cd' * 32}\n")
    shown = json.loads(run(tmp_path, "show", "w", "--json").stdout)
    assert shown["vllm"]["wheel"] == {"filename": NAME, "sha256": SHA, "url": f"https://h.example/{NAME}",
                                      "path": None}
    assert json.loads(run(tmp_path, "show", "v", "--json").stdout)["tag"] != shown["tag"]
    dry = run(tmp_path, "build", "w", "--dry-run")
    assert f"--build-context vllm-wheel={download.cached(SHA, NAME).parent}" in dry.stdout, dry.stdout


def test_a_local_wheel_is_taken_by_hash_and_its_metadata_checked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "cache"))
    images = tmp_path / "images"
    (images / "wheels").mkdir(parents=True)
    good = fake_wheel(images / "wheels" / NAME)
    sha = download.sha256_of(good)
    (images / "w.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  path: wheels/{NAME}\n  sha256: {sha}\n"
                                   "  version: \"0.17.0\"\n")
    plan = plan_variant(layout(images), "w")
    got = prebuilt.recipe_wheel(plan, layout(images))
    assert (got.origin, got.sha256) == ("recipe", sha) and (got.folder / got.wheel).read_bytes() == good.read_bytes()
    assert got.folder == download.cached(sha, NAME).parent
    # METADATA that says another version than the file name and the recipe
    other = fake_wheel(images / "wheels" / "vllm-0.17.1-cp38-abi3-linux_x86_64.whl", version="0.17.0")
    (images / "x.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  path: wheels/{other.name}\n"
                                   f"  sha256: {download.sha256_of(other)}\n  version: \"0.17.1\"\n")
    with pytest.raises(ConfigError, match=r"holds vllm 0\.17\.0 \(its METADATA\), but the recipe says version 0\.17\.1"):
        prebuilt.recipe_wheel(plan_variant(layout(images), "x"), layout(images))
    # a wrong hash: refused, and nothing is left in the cache under it
    (images / "y.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  path: wheels/{NAME}\n  sha256: \"{'0' * 64}\"\n"
                                   "  version: \"0.17.0\"\n")
    with pytest.raises(ConfigError, match=f"the wheel has sha256 {sha}, not {'0' * 64}"):
        prebuilt.recipe_wheel(plan_variant(layout(images), "y"), layout(images))
    assert not download.cached("0" * 64, NAME).parent.exists()


def test_a_local_wheel_behind_a_link_out_of_the_recipe_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "cache"))
    images = tmp_path / "images"
    images.mkdir()
    outside = fake_wheel(tmp_path / NAME)
    (images / "wheels").symlink_to(tmp_path)
    (images / "w.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  path: wheels/{NAME}\n"
                                   f"  sha256: {download.sha256_of(outside)}\n  version: \"0.17.0\"\n")
    with pytest.raises(ConfigError, match="vllm.path: wheels/.* leads outside"):
        plan_variant(layout(images), "w")


# ------------------------------------------------------------------ the wheel cache


def _git_plan():
    plan = plan_variant(Layout.default(ROOT), "ng17")
    pinned = tuple(replace(c, commit=Pin("c" * 40)) if c.kind == "git" else c for c in plan.components)
    return replace(plan, components=pinned)


def test_the_key_covers_what_decides_the_wheel_and_says_why_it_cannot_be_made() -> None:
    layout = Layout.default(ROOT)
    plan = _git_plan()
    inputs, why = wheelkey.key_inputs(plan, "sha256:" + "1" * 64)
    assert why == "" and inputs is not None
    assert set(inputs) == {"format", "vllm", "source_mods", "build_env", "torch_cuda_arch_list", "base",
                           "os_packages", "protect", "git_components", "tooling", "platform", "source_date_epoch"}
    key = wheelkey.cache_key(inputs)
    for change in ({"torch_cuda_arch_list": "12.0a"}, {"base": "sha256:" + "2" * 64}, {"build_env": {"A": "1"}},
                   {"source_mods": [{"name": "m", "digest": "sha256:0"}]}, {"git_components": {"cutlass": "d" * 40}},
                   {"os_packages": ["zz-pkg"]}, {"protect": ["zz-pkg"]}, {"tooling": "sha256:1"},
                   {"platform": "linux/amd64"}, {"source_date_epoch": 1}):
        other = inputs | change
        assert wheelkey.cache_key(other) != key
        assert [d.split(" ")[0] for d in wheelkey.differences(other, inputs)] == list(change)
    # Each of them is read from the plan: a plan that differs in it gives another key.
    for field, value in (("os_packages", plan.os_packages + ("zz",)), ("protect", plan.protect + ("zz",)),
                         ("tooling_digest", "sha256:0"), ("platform", "linux/amd64"),
                         ("source_date_epoch", 1)):
        other_inputs, _ = wheelkey.key_inputs(replace(plan, **{field: value}), "sha256:" + "1" * 64)
        assert wheelkey.cache_key(other_inputs) != key, field
    assert wheelkey.key_inputs(plan, None)[1].endswith("has no digest and is not on this engine")
    loose = replace(plan, components=plan_variant(layout, "ng17").components)
    assert "commit is not pinned (lock the variant)" in wheelkey.key_inputs(loose, "x")[1]
    assert wheelkey.key_inputs(plan_variant(layout, "ng16"), "x")[1] == "vllm.commit is not pinned (lock the variant)"


def test_lookup_offers_a_stored_wheel_only_while_its_hash_holds(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "cache"
    plan = _git_plan()
    plan = replace(plan, base=replace(plan.base, digest=Pin("sha256:" + "1" * 64)))
    miss = wheels.lookup(plan, root)
    assert miss.wheel is None and miss.why_not.startswith("the wheel cache holds no wheel of vllm b31e9326a7d9")
    entry = wheels.store(root, miss.inputs, _export(tmp_path), "ng17-x at t")
    hit = wheels.lookup(plan, root)
    assert hit.wheel is not None and (hit.wheel.origin, hit.wheel.key, hit.wheel.sha256) == ("cache", entry.key,
                                                                                           entry.sha256)
    entry.path.write_bytes(entry.path.read_bytes() + b"x")  # changed after it was stored
    changed = wheels.lookup(plan, root)
    assert changed.wheel is None and "no longer has its recorded sha256" in changed.why_not
    # The compile that follows replaces the changed entry instead of keeping it.
    fresh = wheels.store(root, miss.inputs, _export(tmp_path / "again"), "ng17-y at t2")
    assert fresh.compiled_for == "ng17-y at t2" and download.sha256_of(fresh.path) == fresh.sha256
    assert wheels.lookup(plan, root).wheel is not None
    # A half entry (entry.json without its wheel, as during a copy from another machine) is replaced too.
    fresh.path.unlink()
    assert wheels.store(root, miss.inputs, _export(tmp_path / "third"), "ng17-z at t3").compiled_for == "ng17-z at t3"


def test_an_entry_with_fields_that_could_reach_a_dockerfile_line_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    entry = wheels.store(root, {"format": 1, "vllm": {"commit": "c" * 40}}, _export(tmp_path), "x at t")
    data = json.loads((entry.folder / "entry.json").read_text())
    for field, bad in (("wheel", "wheels/../../etc/x.whl"), ("wheel", "wheels/vllm-1.whl\nRUN x"),
                       ("compiled_for", "x\nRUN echo"), ("sha256", "z" * 64), ("key", "0" * 64)):
        (entry.folder / "entry.json").write_text(json.dumps(data | {field: bad}))
        assert wheels.read_entry(entry.folder) is None, field
    (entry.folder / "entry.json").write_text(json.dumps(data))
    assert wheels.read_entry(entry.folder) is not None


def _export(tmp: Path, name: str = NAME) -> Path:
    exported = tmp / "exported"
    (exported / "wheels").mkdir(parents=True)
    (exported / "record" / "mods").mkdir(parents=True)
    fake_wheel(exported / "wheels" / name)
    (exported / "record" / "vllm-commit").write_text("c" * 40 + "\n")
    return exported


def test_store_lookup_and_prune(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    inputs = {"format": 1, "vllm": {"commit": "c" * 40}, "torch_cuda_arch_list": "12.1a"}
    entry = wheels.store(root, inputs, _export(tmp_path), "ng17-0123456789ab at 2026-11-23T00:00:00Z")
    assert entry.key == wheelkey.cache_key(inputs) and entry.sha256 == download.sha256_of(entry.path)
    assert [e.key for e in wheels.entries(root)] == [entry.key]
    assert (root / entry.key / "record" / "vllm-commit").is_file()
    # Storing the same key again keeps the first entry.
    again = wheels.store(root, inputs, _export(tmp_path / "2"), "other at later")
    assert again.compiled_for == entry.compiled_for
    # Folders that are not complete entries are skipped.
    (root / "half").mkdir()
    (root / "half" / "entry.json").write_text("{")
    assert [e.key for e in wheels.entries(root)] == [entry.key]
    # Prune by age of last use, by key, or all.
    assert wheels.prune(root, older_than_days=1) == []
    os.utime(root / wheels.USED / entry.key, (0, 0))
    assert [e.key for e in wheels.prune(root, older_than_days=1, dry_run=True)] == [entry.key]
    assert (root / entry.key).is_dir()
    with pytest.raises(ConfigError, match="0 wheels in .* have a key starting with 'ffff'"):
        wheels.prune(root, key="ffff")
    assert [e.key for e in wheels.prune(root, key=entry.key[:8])] == [entry.key]
    assert wheels.entries(root) == [] and not (root / wheels.USED / entry.key).exists()


def test_prune_removes_what_killed_builds_left_once_a_day_old(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    kept = wheels.store(root, {"format": 1, "vllm": {"commit": "c" * 40}}, _export(tmp_path), "x at t")
    old = [root / ".export.k1ll3d", root / f".{'ab' * 6}.s7ag3", root / ".trash-0123456789ab-42-7"]
    for folder in old:
        (folder / "wheels").mkdir(parents=True)
        (folder / "wheels" / "vllm-0.17.0-cp38-abi3-linux_aarch64.whl").write_bytes(b"x" * 1000)
        os.utime(folder, (0, 0))
    running = root / ".export.l1ve"  # a compile going on now, maybe on another machine sharing the cache
    running.mkdir()
    (root / ".notes").mkdir()  # not ours: never touched
    os.utime(root / ".notes", (0, 0))
    assert wheels.leftovers(root) == sorted(old)
    dry = run(IMAGES, "wheels", "prune", "--wheel-cache", str(root), "--key", kept.key[:8],
                  "--dry-run")
    assert dry.returncode == 0 and "would remove 3 folders that interrupted builds left, 0.0 MB" in dry.stdout, \
        dry.stdout + dry.stderr
    assert all(f.is_dir() for f in old)
    proc = run(IMAGES, "wheels", "prune", "--wheel-cache", str(root), "--older-than", "30")
    assert proc.returncode == 0 and "removed 0 wheels" in proc.stdout, proc.stdout + proc.stderr
    assert "removed 3 folders that interrupted builds left" in proc.stdout
    assert not any(f.exists() for f in old) and running.is_dir() and (root / ".notes").is_dir()
    assert [e.key for e in wheels.entries(root)] == [kept.key]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".trash-")) == []


def test_the_closest_entry_says_what_differs(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    inputs = {"format": 1, "vllm": {"commit": "c" * 40}, "torch_cuda_arch_list": "12.1a", "base": "b"}
    stored = wheels.store(root, inputs, _export(tmp_path), "x at t")
    why = wheels._closest(inputs | {"torch_cuda_arch_list": "12.0a;12.1a"}, root)
    assert why == (f"the cached wheel {stored.key[:12]} of this commit differs in torch_cuda_arch_list "
                   "(cached: 12.1a, this build: 12.0a;12.1a)")
    assert wheels._closest(inputs | {"vllm": {"commit": "e" * 40}}, root) == \
        f"the wheel cache holds no wheel of vllm {'e' * 12}"


@pytest.mark.parametrize("args, message", [
    ((), "say what to remove"),
    (("--all", "--key", "ab"), "--all removes every wheel"),
    (("--key", "ab"), "0 wheels in"),
])
def test_wheels_prune_bad_input_is_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = run(IMAGES, "wheels", "prune", "--wheel-cache", str(tmp_path), *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.network  # a real vLLM release from the package index
def test_check_mods_applies_install_mods_to_the_tree_of_a_wheel_source(tmp_path: Path, monkeypatch) -> None:
    """A wheel holding the real vLLM 0.17.0 package (from the release sdist): the ng17 install mods apply to it."""
    from sparkforge.recipe import sources
    from sparkforge.repro.checkmods import RowState, check_variant

    tree = sources.release_tree("vllm", "0.17.0")
    images = tmp_path / "images"
    (images / "wheels").mkdir(parents=True)
    wheel = images / "wheels" / NAME
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted((tree / "vllm").rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(tree).as_posix())
        zf.writestr("vllm-0.17.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.17.0\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF compiled")  # about 1 GB in a real CUDA wheel
        zf.writestr("vllm.libs/libcudart.so.12", b"\x7fELF compiled")
    (images / "w.yaml").write_text(BASE + f"vllm:\n  source: wheel\n  path: wheels/{NAME}\n"
                                   f"  sha256: {download.sha256_of(wheel)}\n  version: \"0.17.0\"\n"
                                   "mods: [uf17-eager-allreduce, fix-qwen35-tp4-marlin]\n")
    rows = check_variant(plan_variant(layout(images), "w"), tmp_path)
    assert [(r.mod, r.state) for r in rows] == [("uf17-eager-allreduce", RowState.APPLIED),
                                                ("fix-qwen35-tp4-marlin", RowState.APPLIED)]
    assert rows[0].source.startswith(f"vllm wheel {NAME}")
    # The tree the mods were checked on holds the wheel's sources, not its shared libraries.
    trees = list((sources.cache_dir() / "trees").glob(f"*-{download.sha256_of(wheel)[:16]}-{NAME}"))
    assert len(trees) == 1 and (trees[0] / "vllm" / "__init__.py").is_file()
    assert not list(trees[0].rglob("*.so")) and not list(trees[0].rglob("*.so.*"))


def test_prune_takes_the_wheels_no_variant_uses_and_none_while_a_key_is_unknown(tmp_path: Path) -> None:
    from sparkforge.distribute import prune

    root = tmp_path / "cache"
    plan = _git_plan()
    plan = replace(plan, base=replace(plan.base, digest=Pin("sha256:" + "1" * 64)))
    used = wheels.store(root, wheels.lookup(plan, root).inputs, _export(tmp_path / "a"), "ng17-x at t")
    other = replace(plan, build=replace(plan.build, torch_cuda_arch_list="9.0a"))
    unused = wheels.store(root, wheels.lookup(other, root).inputs, _export(tmp_path / "b"), "ng17-y at t")
    found, left = prune.wheel_leftovers([plan], root)
    assert [(x.kind, x.name, x.size) for x in found] == [("wheel", unused.key, unused.size)]
    assert left == [(f"wheel {used.key[:12]}", "a variant's build uses it")]
    unlocked = plan_variant(Layout.default(ROOT), "ng16")  # its commit is not pinned: its key is unknown
    found, left = prune.wheel_leftovers([plan, unlocked], root)
    assert found == [] and "variant ng16's wheel key is unknown (vllm.commit is not pinned" in left[0][1]
    prune.remove(prune.Prune(tuple(prune.wheel_leftovers([plan], root)[0]), ()), root, lambda item: None)
    assert [e.key for e in wheels.entries(root)] == [used.key]
