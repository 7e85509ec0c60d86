"""Drop-in file mods: `files: [{src, dest, mode}]`; an existing file with other content is a failure."""

from __future__ import annotations

import os
from pathlib import Path

from .contract import ModState
from .paths import ModFailure, asset, inside, read_file
from .seam import ModDoc


def plan_files(spec: ModDoc, folder: Path, root: Path) -> tuple[ModState, dict[Path, bytes], dict[Path, int]]:
    """The state of a files mod against root, and what to write with which modes (nothing written)."""
    writes: dict[Path, bytes] = {}
    modes: dict[Path, int] = {}
    states: list[ModState] = []
    named: dict[Path, int] = {}
    for i, item in enumerate(spec.files):
        body = read_file(asset(folder, item.src, f"files[{i}].src"), f"files[{i}].src {item.src}")
        target = inside(root, item.dest, f"files[{i}].dest", absolute_ok=True)
        if target in named:
            first = named[target]
            raise ModFailure(f"files[{first}].dest ({spec.files[first].dest}) and files[{i}].dest "
                             f"({item.dest}) name one file; each file of a mod has one entry")
        named[target] = i
        mode = int(item.mode, 8)
        if os.path.lexists(target):
            if read_file(target, item.dest) != body:
                raise ModFailure(f"{item.dest}: exists with other content; refusing to overwrite")
            states.append(ModState.ALREADY)
        else:
            writes[target] = body
            modes[target] = mode
            states.append(ModState.APPLIED)
    if all(s == ModState.ALREADY for s in states):
        return ModState.ALREADY, {}, {}
    return ModState.APPLIED, writes, modes
