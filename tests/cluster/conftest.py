"""Fixtures of the namespace cluster: hosts with their own engine and sshd, a TLS registry on the head's
address, a test CA, and the cluster file that names them all.

Everything starts once per module and is stopped and removed at its end, also after a failure.
Skipped, with the reason, where there is no root, `ip netns`, sshd, dockerd or Docker engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.clusterkit import REGISTRY_PORT, VARIANT, make_ca
from tests.infra.netns import NetnsCluster, free_subnet
from tests.support.docker import built
from tests.support.paths import ROOT, TEST_MODS


@pytest.fixture(scope="module")
def cluster():
    """Head and three nodes in namespaces; node3 on the containerd image store."""
    k = free_subnet()
    c = NetnsCluster(Path(f"/run/sfc-{k}"), k).start()  # under /run: sshd refuses keys below sticky /tmp
    yield c
    c.close()
    assert c.leftovers() == [], c.leftovers()


@pytest.fixture(scope="module")
def cluster_file(cluster, tmp_path_factory) -> Path:
    """cluster.yaml: the TLS registry on the head's address, ssh options, the three nodes."""
    assert cluster.head is not None
    address = f"{cluster.head.address}:{REGISTRY_PORT}"
    d = tmp_path_factory.mktemp("clusterfile")
    tls = make_ca(d / "tls", cluster.head.address)
    path = d / "cluster.yaml"
    lines = ["registry:", f"  address: {address}", f"  listen: {address}", "  tls:",
             f"    cert: {tls['cert']}", f"    key: {tls['key']}", f"    ca: {tls['ca']}",
             "ssh:", f"  known_hosts: {cluster.known_hosts}", f"  identity_file: {cluster.client_key}",
             "  connect_timeout: 5", "nodes:"]
    for host in cluster.nodes:
        lines += [f"  {host.name}:", f"    endpoint: {host.endpoint}"]
    path.write_text("\n".join(lines) + "\n")
    cluster.trust(address, tls["ca"])
    return path


@pytest.fixture(scope="module")
def registry(cluster, cluster_file, tmp_path_factory):
    """The registry, started by `build.py registry start` inside the head's namespace."""
    assert cluster.head is not None
    env = dict(os.environ, SPARKFORGE_STATE=str(tmp_path_factory.mktemp("registry-state")))

    def cli(action: str) -> subprocess.CompletedProcess:
        return cluster.head.exec(sys.executable, str(ROOT / "build.py"), "registry", action, "--cluster",
                                 str(cluster_file), env=env, cwd=ROOT, timeout=120, check=False)

    started = cli("start")
    assert started.returncode == 0, started.stdout + started.stderr
    yield cli
    stopped = cli("stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr


@pytest.fixture(scope="module")
def frozen(base_image, tmp_path_factory):
    """The small test variant built from a copy of its mods taken now: a test that edits its own copy of
    them (the rollback test) makes another image, never this one."""
    mods = tmp_path_factory.mktemp("frozen") / "mods"
    shutil.copytree(TEST_MODS, mods)
    return mods, built(VARIANT, base_image, mods, "--no-smoke")  # 0.2.7 has no `vllm` command
