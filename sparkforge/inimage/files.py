"""Drop-in file mods: `files: [{src, dest, mode}]`; an existing file with other content is a failure."""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from pathlib import Path

from .contract import ModState
from .paths import ModFailure, asset, inside, read_file
from .seam import ModDoc


def one_entry_each(spec: ModDoc, dests: Sequence[Hashable]) -> None:
    """Refuse two entries of `files` whose dests (each entry's, as the caller compares them) name one file."""
    seen: dict[Hashable, int] = {}
    for i, dest in enumerate(dests):
        first = seen.setdefault(dest, i)
        if first != i:
            raise ModFailure(f"files[{first}].dest ({spec.files[first].dest}) and files[{i}].dest "
                             f"({spec.files[i].dest}) name one file; each file of a mod has one entry")


def plan_files(spec: ModDoc, folder: Path, root: Path) -> tuple[ModState, dict[Path, bytes], dict[Path, int]]:
    """The state of a files mod against root, and what to write with which modes (nothing written)."""
    writes: dict[Path, bytes] = {}
    modes: dict[Path, int] = {}
    targets = [inside(root, item.dest, f"files[{i}].dest", absolute_ok=True) for i, item in enumerate(spec.files)]
    one_entry_each(spec, targets)  # two names of one file too (a merged /usr has /bin -> usr/bin)
    for i, (item, target) in enumerate(zip(spec.files, targets)):
        body = read_file(asset(folder, item.src, f"files[{i}].src"), f"files[{i}].src {item.src}")
        mode = int(item.mode, 8)
        if not os.path.lexists(target):
            writes[target] = body
            modes[target] = mode
        elif read_file(target, item.dest) != body:
            raise ModFailure(f"{item.dest}: exists with other content; refusing to overwrite")
    return ModState.APPLIED if writes else ModState.ALREADY, writes, modes
