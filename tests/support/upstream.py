"""A real upstream change as a patch: the diff of one vLLM file from the 0.17.0 to the 0.18.1 release.

vLLM 0.18 registered the basic chat template for ColPali in
vllm/transformers_utils/chat_templates/registry.py (one added line). Against the 0.17.0 tree the
diff applies; against 0.18.1, which holds the change, it is already applied: the case of an
upstream pull request that a newer release has merged.
"""

from __future__ import annotations

import difflib
import hashlib

from sparkforge.recipe import sources

FILE = "vllm/transformers_utils/chat_templates/registry.py"
ADDED = '"colpali": CHAT_TEMPLATES_DIR / "template_basic.jinja",'
OLD, NEW = "0.17.0", "0.18.1"


def release_diff(path: str = FILE, old: str = OLD, new: str = NEW) -> bytes:
    """The unified diff (git style, a/ and b/) of one file between two vLLM release sdists."""
    before = (sources.release_tree("vllm", old) / path).read_text().splitlines(keepends=True)
    after = (sources.release_tree("vllm", new) / path).read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(before, after, f"a/{path}", f"b/{path}"))
    assert diff, f"{path} is the same in vllm {old} and {new}"
    return diff.encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mod_yaml(name: str, *, url: str | None = None, pr: str | None = None, digest: str,
             versions: str = ">=0.17.0") -> str:
    """mod.yaml of an install-phase mod whose patch is the release diff, named by URL or pull request."""
    source = f"url: {url}" if url else f"pr: {pr!r}"
    return f"""\
name: {name}
summary: Register the basic chat template for ColPali (upstream, vLLM 0.18)
description: The registry.py change of vLLM 0.18.1, fetched as a patch by URL.
component: vllm
targets: {{versions: "{versions}"}}
phase: install
kind: patch
patch:
  {source}
  sha256: {digest}
verify:
  - file: {FILE}
    contains: '{ADDED}'
"""
