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
        """Every file of the image-side package, by its path relative to the folder, in sorted order
        (compiled bytecode left out: it is not source, and the image makes its own)."""
        found = []
        for parent, dirs, names in os.walk(self.inimage):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if not name.endswith((".pyc", ".pyo")):
                    path = Path(parent) / name
                    found.append((path.relative_to(self.inimage).as_posix(), path))
        return sorted(found)

    @classmethod
    def default(cls, root: Path = PROJECT_ROOT, images_dir: Path | None = None,
                mods_dir: Path | None = None) -> Layout:
        return cls(
            images_dir=images_dir or root / "images",
            mods_dir=mods_dir or root / "mods",
            template=root / "Dockerfile.j2",
            inimage=PACKAGE_DIR / "inimage",
            gitfetch=PACKAGE_DIR / "gitfetch.py",
        )



def digest_tree(folder: Path) -> str:
    """sha256 over the relative paths and bytes of every file below folder, in sorted order.

    The folder holds no links: config.load_mod refused any before the plan reads it.
    """
    h = hashlib.sha256()
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files += [Path(dirpath) / name for name in filenames]
    for path in sorted(files, key=lambda p: p.relative_to(folder).as_posix()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def digest_tooling(layout: Layout) -> str:
    """sha256 over the template, gitfetch and every file of the image-side package (its names too)."""
    h = hashlib.sha256()
    for name, path in [("Dockerfile.j2", layout.template), ("gitfetch.py", layout.gitfetch)] + [
            (f"inimage/{rel}", path) for rel, path in layout.inimage_files()]:
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return "sha256:" + h.hexdigest()
