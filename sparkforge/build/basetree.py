"""The vLLM a base image carries (`vllm.source: base`), which check-mods patches: its regular files (no links, no
shared libraries: 1 GB of a CUDA build that no mod edits), written out of a container and cached by image ID."""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..recipe import sources
from . import dockercli

READ_TIMEOUT = 600.0  # seconds to write the package out of a container (a few thousand files)

# Runs in the image's own Python (3.8 and later): finds the installed package without importing it.
_WRITE_TREE = """
import importlib.util, os, sys, tarfile
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    sys.exit("the image has no vllm package installed")
root = list(spec.submodule_search_locations)[0]
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tf:
    for parent, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not os.path.islink(os.path.join(parent, d)))
        for name in sorted(names):
            path = os.path.join(parent, name)
            if os.path.islink(path) or not os.path.isfile(path) or name.endswith(".so") or ".so." in name:
                continue
            tf.add(path, arcname="base/vllm/" + os.path.relpath(path, root), recursive=False)
print(root, file=sys.stderr)
"""


@dataclass(frozen=True)
class BaseTree:
    """The base's vLLM as a cached tree (holding vllm/), the image it came from and where it is installed there."""

    root: Path
    image_id: str
    installed_at: str


class NotOnEngine(Exception):
    """The engine cannot give the base's tree (no such image, no engine); the message says why."""


def base_tree(ref: str, host: str | None = None) -> BaseTree:
    """The installed vLLM of image `ref` as the engine has it, extracted once per image ID."""
    try:
        info = dockercli.inspect_images(ref, host=host)[ref]
    except dockercli.EngineError as exc:
        raise NotOnEngine(f"the engine cannot be asked ({exc.detail})") from None
    if info is None:
        raise NotOnEngine(f"the engine has no image {ref}")
    image_id = str(info.get("Id", ""))
    name = f"base-{image_id.removeprefix('sha256:')[:32]}-vllm"
    folder = sources.cache_dir() / "trees"
    cached = folder / f"{sources.TREE_FORMAT}-{name}"
    where = cached / ".installed-at"
    if (cached / ".complete").exists() and where.exists():
        return BaseTree(cached, image_id, where.read_text().strip())
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".base-tree.", suffix=".tar", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            proc = dockercli.run(["run", "--rm", "--network", "none", "--entrypoint", "python3", image_id, "-I", "-c",
                                  _WRITE_TREE], what=f"reading vllm from {ref}", timeout=READ_TIMEOUT, check=False,
                                 text=False, stdout=out, stderr=subprocess.PIPE)
        if proc.returncode != 0:
            raise NotOnEngine(f"{ref}: {dockercli.last_line(proc.stderr, f'exit code {proc.returncode}')}")
        installed_at = dockercli.last_line(proc.stderr, "")
        try:
            tree = sources.extract_tree(Path(tmp), "vllm", name)
        except sources.SourceUnavailable as exc:
            raise NotOnEngine(f"{ref}: {exc}") from None
        (tree / ".installed-at").write_text(installed_at + "\n")
        return BaseTree(tree, image_id, installed_at)
    except dockercli.EngineError as exc:
        raise NotOnEngine(f"{ref}: {exc.detail}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
