"""Drop-in file mods: `files: [{src, dest, mode}]`; an existing file with other content is a failure."""

from __future__ import annotations

import os
from pathlib import Path

from .contract import ModState
from .paths import ModFailure, asset, inside, read_file


def plan_files(spec: dict, folder: Path, root: Path) -> tuple[ModState, dict[Path, bytes], dict[Path, int]]:
    """The state of a files mod against root, and what to write with which modes (nothing written)."""
    writes: dict[Path, bytes] = {}
    modes: dict[Path, int] = {}
    states = []
    for i, item in enumerate(spec["files"]):
        body = read_file(asset(folder, item["src"], f"files[{i}].src"))
        target = inside(root, item["dest"], f"files[{i}].dest", absolute_ok=True)
        mode = int(item.get("mode", "0644"), 8)
        if os.path.lexists(target):
            if not target.is_file() or read_file(target) != body:
                raise ModFailure(f"{item['dest']}: exists with other content; refusing to overwrite")
            states.append(ModState.ALREADY)
        else:
            writes[target] = body
            modes[target] = mode
            states.append(ModState.APPLIED)
    if all(s == ModState.ALREADY for s in states):
        return ModState.ALREADY, {}, {}
    return ModState.APPLIED, writes, modes
