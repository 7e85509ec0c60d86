"""prune --wheels and the downloaded wheel sets: a set no lock here names goes with the downloads only it uses;
a set a lock names, a download another set or a running fetch links to, a download of the same name that no set
links to, a set whose fetch is running and a fetch's staging folder stay. Real files and links in a cache of the
test's own; the lock is images/pypi033's."""

from __future__ import annotations

import fcntl
import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from sparkforge.build import wheelfetch
from sparkforge.build.pipeline import load_plan
from sparkforge.distribute import prune
from sparkforge.recipe.layout import Layout
from tests.support.paths import ROOT


def stored(cache: Path, set_folder: Path, name: str, body: bytes) -> Path:
    """A download kept by its hash, linked into a set's folder as wheelfetch keeps them."""
    sha = format(abs(hash((name, body))), "x").rjust(64, "0")[:64]
    keep = cache / "downloads" / sha / name
    keep.parent.mkdir(parents=True, exist_ok=True)
    if not keep.exists():
        keep.write_bytes(body)
    set_folder.mkdir(parents=True, exist_ok=True)
    os.link(keep, set_folder / name)
    return keep


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_set_no_lock_names_goes_with_the_downloads_only_it_uses(tmp_path: Path, monkeypatch, dry_run: bool) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPARKFORGE_CACHE", str(cache))
    layout = Layout.default(ROOT)
    loaded = load_plan(layout, "pypi033")
    assert len(loaded.plan.wheel_set) == 199  # from its lock
    names = prune.named_sets(layout, [loaded])
    named = wheelfetch.set_folder(loaded.plan)
    assert names == {named}
    sets = named.parent
    old, busy = sets / ("a" * 32), sets / ("b" * 32)
    shared = stored(cache, named, "shared-1.0-py3-none-any.whl", b"s" * 1000)
    stored(cache, named, "only-named-1.0-py3-none-any.whl", b"n" * 2000)
    stored(cache, old, "shared-1.0-py3-none-any.whl", b"s" * 1000)
    only_old = stored(cache, old, "only-old-2.0-py3-none-any.whl", b"o" * 3000)
    stored(cache, busy, "busy-1.0-py3-none-any.whl", b"b" * 4000)
    fetching = stored(cache, old, "fetching-1.0-py3-none-any.whl", b"f" * 500)
    (old.with_name(f"{old.name}.checked")).write_text("{}")
    staging = sets / ".fetch.x1y2"
    staging.mkdir()
    os.link(fetching, staging / fetching.name)  # a fetch that is running links it into its staging folder
    namesake = cache / "downloads" / ("c" * 64) / "only-old-2.0-py3-none-any.whl"  # another file of that name
    namesake.parent.mkdir(parents=True)
    namesake.write_bytes(b"another build")
    fd = os.open(busy.with_name(f"{busy.name}.lock"), os.O_RDWR | os.O_CREAT)
    before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fetch of that set is running
        with ExitStack() as held:
            found, left = prune.wheel_set_leftovers(names, held, dry_run=dry_run)
            assert [(x.kind, x.name, x.size) for x in found] == [("wheel set", str(old), 3000)]  # shared frees nothing
            assert set(left) == {(f"wheel set {'b' * 12}", "it is being downloaded"),
                                 (f"wheel set {named.name[:12]}", "a variant's lock names it")}
            if dry_run:
                assert not old.with_name(f"{old.name}.lock").exists()  # a dry run makes no lock file
            else:
                assert prune.remove(prune.Prune(tuple(found), ()), None, lambda item: None) == []
    finally:
        os.close(fd)

    after = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    if dry_run:
        assert after == before
        return
    assert not old.exists() and not old.with_name(f"{old.name}.checked").exists()
    assert not only_old.exists() and not only_old.parent.exists()
    assert shared.read_bytes() == b"s" * 1000 and (named / shared.name).is_file()
    assert fetching.is_file() and namesake.read_bytes() == b"another build"
    assert busy.is_dir() and staging.is_dir()
    assert old.with_name(f"{old.name}.lock").exists()  # a process waiting on it finds the one it waits on


def test_no_wheel_set_cache_is_nothing_to_prune(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "none"))
    with ExitStack() as held:
        layout = Layout.default(ROOT)
        names = prune.named_sets(layout, [load_plan(layout, "pypi033")])
        assert prune.wheel_set_leftovers(names, held, dry_run=False) == ([], [])
