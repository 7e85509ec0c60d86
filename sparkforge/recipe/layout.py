"""Where the project's inputs live (recipes, mods, the template, the image-side package), and the
digests that stand for them in a plan: a mod folder's, and the tooling's every image is built with."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # sparkforge/
PROJECT_ROOT = PACKAGE_DIR.parent


@dataclass(frozen=True)
class Layout:
    """Where the project's inputs live."""

    images_dir: Path
    mods_dir: Path
    template: Path
    inimage: Path  # the image-side package folder, copied into every image
    gitfetch: Path

    def inimage_files(self) -> list[tuple[str, Path]]:
        """Every file of the image-side package by relative path, sorted; bytecode left out (the image makes it)."""
        return [(rel, path) for rel, path in _files(self.inimage) if not rel.endswith((".pyc", ".pyo"))]

    @classmethod
    def default(cls, root: Path = PROJECT_ROOT, images_dir: Path | None = None, mods_dir: Path | None = None) -> Layout:
        return cls(images_dir or root / "images", mods_dir or root / "mods", template=root / "Dockerfile.j2",
                   inimage=PACKAGE_DIR / "inimage", gitfetch=PACKAGE_DIR / "gitfetch.py")


def _files(folder: Path) -> list[tuple[str, Path]]:
    """Every file below folder by its relative path, sorted; __pycache__ folders left out."""
    found = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [((Path(parent) / name).relative_to(folder).as_posix(), Path(parent) / name) for name in names]
    return sorted(found)


def digest_tree(folder: Path) -> str:
    """sha256 over the relative paths and bytes of every file below folder (config.load_mod refused links)."""
    h = hashlib.sha256()
    for rel, path in _files(folder):
        h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def digest_tooling(layout: Layout) -> str:
    """sha256 over the template, gitfetch and every file of the image-side package (its names too)."""
    h = hashlib.sha256()
    for name, path in [("Dockerfile.j2", layout.template), ("gitfetch.py", layout.gitfetch)] + [
            (f"inimage/{rel}", path) for rel, path in layout.inimage_files()]:
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return "sha256:" + h.hexdigest()
