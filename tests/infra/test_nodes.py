"""Smoke test of tests/infra/nodes.py: two extra dockerd nodes start, answer, and stop clean.

Skipped where extra daemons cannot run (not root, or no dockerd on PATH).
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nodes import start_nodes, stop_nodes  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("dockerd") is None or shutil.which("docker") is None,
    reason="needs root and dockerd on PATH",
)


def test_two_nodes_start_answer_and_stop_clean():
    # Short base dir: unix socket paths are limited to 107 bytes.
    base = tempfile.mkdtemp(prefix="sfn-", dir="/tmp")
    nodes = start_nodes(2, base)
    try:
        roots = set()
        for node in nodes:
            assert node.is_up()
            out = node.docker("info", "--format", "{{.DockerRootDir}}").stdout.decode().strip()
            roots.add(out)
            assert out == str(node.data_root)
        assert len(roots) == 2
    finally:
        stop_nodes(nodes)
    for node in nodes:
        assert not node.is_up()
        assert node.processes() == []
    for node in nodes:
        node.destroy()
    shutil.rmtree(base, ignore_errors=True)
