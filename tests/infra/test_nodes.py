"""Smoke test of tests/infra/nodes.py: two extra dockerd nodes start, answer, and stop clean.

Skipped where extra daemons cannot run (not root, or no dockerd on PATH).
"""

import shutil
import tempfile

import pytest
from tests.infra.nodes import CLASSIC, CONTAINERD, start_nodes, stop_nodes

pytestmark = [pytest.mark.docker, pytest.mark.root]



def test_two_nodes_start_answer_and_stop_clean():
    # Short base dir: unix socket paths are limited to 107 bytes.
    base = tempfile.mkdtemp(prefix="sfn-", dir="/tmp")
    nodes = start_nodes(1, f"{base}/k", CLASSIC, prefix="k") + start_nodes(1, f"{base}/c", CONTAINERD, prefix="c")
    try:
        roots = set()
        for node in nodes:
            assert node.is_up()
            out = node.docker("info", "--format", "{{.DockerRootDir}}").stdout.decode().strip()
            roots.add(out)
            assert out == str(node.data_root)
        assert len(roots) == 2
        # Each keeps its images in the store its config says (Docker 29 would pick containerd by itself).
        stores = [node.docker("info", "--format", "{{json .DriverStatus}}").stdout.decode() for node in nodes]
        assert "io.containerd.snapshotter.v1" not in stores[0] and "io.containerd.snapshotter.v1" in stores[1], stores
    finally:
        stop_nodes(nodes)
    for node in nodes:
        assert not node.is_up()
        assert node.processes() == []
    for node in nodes:
        node.destroy()
    shutil.rmtree(base, ignore_errors=True)
