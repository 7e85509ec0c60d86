"""Fixtures of the docker tier's distribution tests: a real registry and three real dockerd nodes.
The built test image and the base are the whole run's (tests/conftest.py)."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.support.docker import Registry, free_port
from tests.support.needs import require


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    """A registry for one test module, stopped (data deleted with the tmp dir) at its end."""
    require("docker-registry")
    reg = Registry(free_port(), tmp_path_factory.mktemp("registry"))
    reg.start()
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def nodes():
    """Three extra real dockerd daemons on the classic image store (tests/infra/nodes.py), started once per module;
    the head that pushes to them is on the containerd store.

    max-download-attempts=1: a pull whose registry died fails at once instead of after the
    engine's default 5 attempts with a growing back-off (about 50 s), which is the same outcome.
    """
    require("dockerd")
    from tests.infra.nodes import start_nodes, stop_nodes, with_store

    base = tempfile.mkdtemp(prefix="sfd-", dir="/tmp")  # short: unix socket paths max 107 bytes
    started = start_nodes(3, base, daemon_config=with_store({"max-download-attempts": 1}, containerd=False))
    yield started
    try:
        stop_nodes(started, kill=True)  # throw-away nodes: no graceful shutdown to wait for
    finally:
        for node in started:
            node.destroy()
        shutil.rmtree(base, ignore_errors=True)
