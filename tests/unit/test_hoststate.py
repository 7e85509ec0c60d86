"""The machine fingerprint that every test run is checked against notices what it must notice."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support import hoststate


def test_tree_digest_sees_content_names_and_links(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text("Suites: bookworm\n")
    first = hoststate.tree_digest(tmp_path)
    assert hoststate.tree_digest(tmp_path) == first
    (tmp_path / "sources.list.d" / "debian.sources").write_text("Suites: trixie\n")
    second = hoststate.tree_digest(tmp_path)
    assert second != first
    (tmp_path / "preferences.d").mkdir()
    (tmp_path / "preferences.d" / "pin").symlink_to("/nonexistent")
    assert hoststate.tree_digest(tmp_path) != second


def test_python_packages_lists_this_interpreter() -> None:
    listed = hoststate.python_packages(Path(sys.executable)).splitlines()
    assert any(line.startswith("pytest==") for line in listed)


def test_changed_names_what_differs_and_ignores_an_absent_engine() -> None:
    before = {"/etc/apt": "a", "packages of /usr/bin/python3": "x==1", "Docker engine settings": "overlay2"}
    assert hoststate.changed(before, dict(before)) == []
    assert hoststate.changed(before, {**before, "/etc/apt": "b"}) == ["/etc/apt"]
    assert hoststate.changed(before, {**before, "Docker engine settings": "absent"}) == []
    assert hoststate.changed(before, {**before, "Docker engine settings": "overlayfs"}) == ["Docker engine settings"]
