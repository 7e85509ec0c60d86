"""Recipes the unit tests start from: a copy of the shipped images without their locks, the layout that
reads such a copy, and the text of a small recipe on an example base."""

from __future__ import annotations

import shutil
from pathlib import Path

from sparkforge.recipe.layout import Layout
from tests.support.paths import IMAGES, ROOT

_PYPI = """\
platform: linux/amd64
base:
  repository: example.org/base
  tag: "1.0"
  digest: {{unknown: not resolved in this test}}
vllm:
  source: pypi
  version: "{version}"
build:
  torch_cuda_arch_list: "12.1a"
"""


def unlocked_images(dest: Path) -> Path:
    """The shipped images/ copied to dest without their locks (*.lock.json), so that a child recipe a test
    adds has no lock and its parent none either; dest."""
    shutil.copytree(IMAGES, dest, ignore=shutil.ignore_patterns("*.lock.json"))
    return dest


def layout(images: Path) -> Layout:
    """The project's layout, with its recipes read from images."""
    return Layout.default(ROOT, images_dir=images)


def pypi_recipe(version: str, mods: tuple[str, ...] = ()) -> str:
    """A recipe on example.org/base (its digest left unresolved) with vLLM `version` from PyPI, built for
    arch 12.1a, and `mods: [...]` when mods are given."""
    return _PYPI.format(version=version) + (f"mods: [{', '.join(mods)}]\n" if mods else "")
