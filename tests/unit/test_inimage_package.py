"""The image-side package as render ships it: the whole folder, no bytecode, every file in the tooling digest."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from sparkforge.recipe.layout import Layout, digest_tooling
from sparkforge.recipe.planner import plan_variant
from sparkforge.build.render import context_files
from tests.support.paths import ROOT


def copied_layout(tmp: Path) -> Layout:
    folder = tmp / "inimage"
    shutil.copytree(ROOT / "sparkforge" / "inimage", folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dataclasses.replace(Layout.default(ROOT), inimage=folder)


def test_the_context_carries_every_file_of_the_folder_and_no_bytecode(tmp_path: Path) -> None:
    layout = copied_layout(tmp_path)
    (layout.inimage / "__pycache__").mkdir()
    (layout.inimage / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"bytecode")
    files = context_files(plan_variant(layout, "ng17"), layout)
    shipped = sorted(rel.removeprefix("sparkforge/inimage/") for rel in files if rel.startswith("sparkforge/inimage/"))
    on_disk = sorted(p.relative_to(layout.inimage).as_posix() for p in layout.inimage.rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert shipped == on_disk and {"__main__.py", "cli.py", "contract.py", "patch.py"} <= set(shipped)
    assert files["sparkforge/inimage/patch.py"] == (layout.inimage / "patch.py").read_bytes()


def test_the_tooling_digest_covers_every_file_in_a_stable_order(tmp_path: Path) -> None:
    layout = copied_layout(tmp_path)
    first = digest_tooling(layout)
    assert digest_tooling(layout) == first
    (layout.inimage / "__pycache__").mkdir()
    (layout.inimage / "__pycache__" / "x.pyc").write_bytes(b"bytecode")
    assert digest_tooling(layout) == first  # bytecode is not source
    (layout.inimage / "extra.py").write_text("")
    with_extra = digest_tooling(layout)
    assert with_extra != first
    (layout.inimage / "extra.py").rename(layout.inimage / "other.py")  # same bytes, another name
    assert digest_tooling(layout) not in (first, with_extra)
    (layout.inimage / "other.py").unlink()
    (layout.inimage / "files.py").write_bytes((layout.inimage / "files.py").read_bytes() + b"\n")
    assert digest_tooling(layout) != first
    assert plan_variant(layout, "ng17").tag != plan_variant(Layout.default(ROOT), "ng17").tag
