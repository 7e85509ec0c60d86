"""Distribution with real parts: push to a real registry, deploy to three real dockerd nodes, status, faults.

Faults are made by stopping the real processes (the registry, a node's dockerd, a `docker load`,
the head's `docker save`); every case checks that a failed node keeps its moving tag on its old
image. The nodes and the registry start once for the module and the test image is built once
per session. The tests are ordered so that only three whole images move (one per node): each
test still makes its own preconditions, so it also passes alone, only slower.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tarfile
import threading
import urllib.request

import pytest

from tests.support.cli import run_cli as sparkforge
from tests.support.docker import BASE, VARIANTS, config_digest
from tests.support.paths import ROOT, TEST_MODS
from sparkforge.distribute import deploy, images, stream
from sparkforge.registry import MANIFEST_TYPES
from sparkforge.distribute.cluster import Node as ClusterNode
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from tests.infra.procs import processes, read_bytes

pytestmark = [pytest.mark.docker, pytest.mark.network, pytest.mark.root]

OLD = "sparkforge-test/old:1"
VARIANT = "testsmall"  # what moves between the engines; the path is the same for any image


@pytest.fixture(scope="module")
def test_image(small_image):
    return small_image


@pytest.fixture(scope="module")
def plan(test_image):
    p = plan_variant(Layout.default(ROOT, images_dir=VARIANTS, mods_dir=TEST_MODS), VARIANT, base=BASE)
    assert p.tag == test_image.tag
    return p


@pytest.fixture(scope="module")
def head(plan, test_image):
    image = images.head_image(plan)
    assert image.image_id == test_image.image_id
    return image


@pytest.fixture(scope="module")
def shown(head) -> str:
    """The ID the classic-store nodes show for the head's image: its config digest. The head, on the containerd
    store, shows a manifest digest (head.image_id) for the same image."""
    config = config_digest(head.tag)
    assert config != head.image_id
    return config


@pytest.fixture(scope="module")
def old_ids(nodes, test_image) -> dict[str, str]:
    """On every node, the moving tag starts on an older (tiny, imported) image."""
    ids = {}
    for node in nodes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            data = f"old image of {node.name}\n".encode()
            info = tarfile.TarInfo("old.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        node.docker("import", "-", OLD, input=buf.getvalue())
        node.docker("tag", OLD, test_image.moving_tag)
        ids[node.name] = tag_id(node, OLD)
    return ids


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory, nodes, registry):
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    lines = [f"registry: {registry.address}", "nodes:"]
    for node in nodes:
        lines += [f"  {node.name}:", f"    endpoint: {node.endpoint}"]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pushed(test_image, registry, old_ids):
    """The test image pushed with the real `push` command (both tags)."""
    proc = cli("push", VARIANT, "--registry", registry.address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield proc
    # The head keeps no tags naming this throw-away registry.
    for ref in (test_image.tag, test_image.moving_tag):
        subprocess.run(["docker", "rmi", f"{registry.address}/{ref}"], capture_output=True)


def tag_id(node, ref: str) -> str | None:
    proc = node.docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


def make_stale(node, test_image, old_ids) -> None:
    """Remove the test image from a node and put its moving tag back on the old image."""
    node.docker("rmi", "-f", test_image.tag, check=False)
    node.docker("tag", OLD, test_image.moving_tag)
    node.docker("image", "prune", "-f")  # the test image, now without a tag, goes too
    assert tag_id(node, test_image.moving_tag) == old_ids[node.name]
    assert tag_id(node, test_image.tag) is None
    assert not node.docker("images", "-q", "--filter", "dangling=true").stdout.strip()


def as_nodes(nodes) -> list[ClusterNode]:
    return [ClusterNode(n.name, n.endpoint) for n in nodes]


def cli(*args: str) -> subprocess.CompletedProcess:
    return sparkforge("--images", str(VARIANTS), "--mods", str(TEST_MODS), *args, "--base", BASE)


def by_name(deployment) -> dict:
    return {r.node.name: r for r in deployment.results}


def test_bad_input_is_one_line_exit_2_and_touches_no_node(nodes, cluster_file, tmp_path, test_image) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("nodes:\n  a: [unclosed\n")
    bad_field = tmp_path / "field.yaml"
    bad_field.write_text("nodes:\n  spark1:\n    endpoint: http://x\n")
    extra = tmp_path / "extra.yaml"
    extra.write_text("nodes:\n  spark1:\n    endpoint: unix:///x.sock\nregistries: []\n")
    cases = [
        (("deploy", VARIANT, "--cluster", str(cluster_file), "--nodes", "nosuchnode"), "unknown node 'nosuchnode'"),
        (("deploy", VARIANT, "--nodes", "http://host:1"), "is not a Docker endpoint"),
        (("deploy", VARIANT, "--cluster", str(bad_yaml)), "malformed YAML: line"),
        (("deploy", VARIANT, "--cluster", str(bad_field)), "nodes.spark1.endpoint"),
        (("deploy", VARIANT, "--cluster", str(extra)), "registries: unknown key"),
        (("deploy", "nosuchvariant", "--cluster", str(cluster_file)), "nosuchvariant"),
        (("deploy", VARIANT, "--nodes", nodes[0].endpoint), "registry mode needs a registry"),
        (("deploy", VARIANT, "--cluster", str(cluster_file), "--mode", "rsync"), "'rsync' is not one of"),
        (("status", VARIANT, "--cluster", str(tmp_path / "missing.yaml")), "file not found"),
        (("push", VARIANT, "--registry", "not a registry"), "not a registry address"),
    ]
    before = [n.docker("images", "-qa").stdout for n in nodes]
    for args, expected in cases:
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
        assert expected in lines[0], (args, lines[0])
        assert "Traceback" not in proc.stderr
    assert [n.docker("images", "-qa").stdout for n in nodes] == before


def test_push_puts_both_tags_in_the_registry(pushed, registry, head, test_image, shown) -> None:
    repo, _, tag = test_image.tag.rpartition(":")
    assert registry.has_tag(repo, tag)
    assert registry.has_tag(repo, test_image.moving_tag.rpartition(":")[2])
    assert f"pushed {registry.address}/{test_image.tag}" in pushed.stdout
    # The head is on the containerd store (`shown`), and its engine pushes to a loopback registry: push without
    # --compression takes the engine's own push, says so, and the image goes as the head keeps it, its layers as
    # the build exported them (no compressing again): the registry holds the head's own manifest, by digest (on
    # this store, the image's ID).
    assert "route: the engine's own push: this engine's containerd image store keeps the built layers" in pushed.stdout
    assert "engine's push failed" not in pushed.stdout and "note:" not in pushed.stdout
    request = urllib.request.Request(f"http://{registry.address}/v2/{repo}/manifests/{tag}",
                                     headers={"Accept": ", ".join(MANIFEST_TYPES)})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.headers["Docker-Content-Digest"] == head.image_id


def ensure_current(head, registry, *nodes) -> None:
    """Make nodes current (a no-op when they are, as in the module's order)."""
    assert deploy.deploy_registry(head, as_nodes(nodes), registry.address).ok


def failure_line(proc, node) -> str:
    return next(line for line in proc.stdout.splitlines() if line.startswith(f"{node.name}: failed: "))


def _loader_of(node) -> int | None:
    """The pid of a `docker -H <node> load` run by any process (the CLI under test runs it)."""
    found = processes("load", node.endpoint)
    return found[0] if found else None


def test_cli_stream_one_stream_cut_the_other_node_completes(nodes, head, cluster_file, old_ids,
                                                             test_image, shown) -> None:
    for node in nodes[:2]:
        make_stale(node, test_image, old_ids)
    done_node, victim = nodes[0], nodes[1]
    cut = threading.Event()
    stop = threading.Event()

    def cutter() -> None:
        # Kill the victim's `docker load` (the receiving end of its stream) once 50 MB went in.
        while not stop.is_set():
            pid = _loader_of(victim)
            if pid and read_bytes(pid) > 50_000_000:
                os.kill(pid, signal.SIGKILL)
                cut.set()
                return
            stop.wait(0.05)

    watcher = threading.Thread(target=cutter, daemon=True)
    watcher.start()
    try:
        proc = cli("deploy", VARIANT, "--cluster", str(cluster_file), "--mode", "stream",
                   "--nodes", f"{done_node.name},{victim.name}")
    finally:
        stop.set()
        watcher.join()
    assert cut.is_set(), proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("node")}
    assert rows[done_node.name][1] == "updated" and shown[:19] in rows[done_node.name][2], proc.stdout
    assert rows[victim.name][1] == "failed", proc.stdout
    assert "stream interrupted" in failure_line(proc, victim)
    assert "1 updated, 0 current, 1 failed" in proc.stdout
    assert f"{done_node.name} " in proc.stderr and " load " in proc.stderr  # per-node progress lines
    assert tag_id(done_node, test_image.moving_tag) == shown
    assert tag_id(done_node, test_image.tag) == shown
    assert tag_id(victim, test_image.moving_tag) == old_ids[victim.name]
    assert tag_id(victim, test_image.tag) is None


def test_node_dies_mid_pull_others_complete_and_it_keeps_its_old_image(
        nodes, head, registry, pushed, cluster_file, old_ids, test_image, shown) -> None:
    victim = nodes[1]
    make_stale(victim, test_image, old_ids)
    crashed = threading.Event()

    def hook(p: deploy.Progress) -> None:
        if p.node == victim.name and p.phase == "pull" and p.done > 0 and not crashed.is_set():
            crashed.set()
            victim.crash()  # SIGKILL its dockerd while the layers are downloading

    result = deploy.deploy_registry(head, as_nodes(nodes), registry.address, hook)
    assert crashed.is_set()
    rows = by_name(result)
    assert not result.ok
    assert rows[victim.name].outcome == "failed" and rows[victim.name].error
    assert rows[nodes[2].name].outcome == "updated" and rows[nodes[2].name].bytes_moved > 100_000_000
    assert rows[nodes[0].name].outcome in ("current", "updated")
    for node in (nodes[0], nodes[2]):
        assert rows[node.name].image_id == shown
        assert tag_id(node, test_image.moving_tag) == shown
        assert tag_id(node, test_image.tag) == shown
    victim.start()
    assert tag_id(victim, test_image.moving_tag) == old_ids[victim.name]
    assert tag_id(victim, test_image.tag) is None

    # status sees the difference and says so with its exit code
    proc = cli("status", VARIANT, "--cluster", str(cluster_file))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "nodes differ" in proc.stdout


def test_registry_down_at_start_fails_the_stale_node_only(nodes, head, registry, cluster_file, old_ids,
                                                          test_image, pushed, shown) -> None:
    ensure_current(head, registry, nodes[0], nodes[2])
    make_stale(nodes[1], test_image, old_ids)
    registry.stop()
    try:
        proc = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    finally:
        registry.start()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = failure_line(proc, nodes[1])
    assert "pull of" in line and registry.address in line and "connection refused" in line, line
    assert f"still on {old_ids[nodes[1].name][:19]}" in line
    assert "0 updated, 2 current, 1 failed" in proc.stdout
    assert tag_id(nodes[1], test_image.moving_tag) == old_ids[nodes[1].name]
    for node in (nodes[0], nodes[2]):
        assert tag_id(node, test_image.moving_tag) == shown


def test_registry_dies_mid_deploy(nodes, head, registry, old_ids, test_image, pushed) -> None:
    ensure_current(head, registry, nodes[0], nodes[2])
    victim = nodes[1]
    make_stale(victim, test_image, old_ids)
    stopped = threading.Event()

    def hook(p: deploy.Progress) -> None:
        # The manifest is fetched and the layer downloads are starting: now the registry dies.
        if p.node == victim.name and p.phase == "pull" and not stopped.is_set():
            stopped.set()
            registry.stop()

    try:
        result = deploy.deploy_registry(head, as_nodes(nodes), registry.address, hook)
    finally:
        registry.start()
    assert stopped.is_set()
    rows = by_name(result)
    assert rows[victim.name].outcome == "failed", rows[victim.name]
    assert "pull of" in rows[victim.name].error
    assert rows[nodes[0].name].outcome == rows[nodes[2].name].outcome == "current"
    assert tag_id(victim, test_image.moving_tag) == old_ids[victim.name]
    assert tag_id(victim, test_image.tag) is None


def test_unreachable_node_is_reported_and_the_others_finish(nodes, head, registry, cluster_file,
                                                            test_image, pushed, shown) -> None:
    ensure_current(head, registry, nodes[0], nodes[2])
    down = nodes[0]
    down.stop(kill=True)
    try:
        proc = cli("deploy", VARIANT, "--cluster", str(cluster_file), "--nodes", f"{down.name},{nodes[2].name}")
        status = cli("status", VARIANT, "--cluster", str(cluster_file), "--nodes", f"{down.name},{nodes[2].name}")
    finally:
        down.start()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "unreachable at unix://" in failure_line(proc, down)
    assert "0 updated, 1 current, 1 failed" in proc.stdout
    assert status.returncode == 1 and "did not answer" in status.stdout
    assert tag_id(down, test_image.moving_tag) == shown  # untouched, still what it had


def test_stream_save_killed_fails_every_streaming_node_cleanly(nodes, head, old_ids, test_image) -> None:
    victim = nodes[1]
    make_stale(victim, test_image, old_ids)
    cut = threading.Event()

    def hook(p: deploy.Progress) -> None:
        if p.phase == "load" and p.done > 50_000_000 and not cut.is_set():
            for pid in processes("save", head.tag, parent=os.getpid()):
                os.kill(pid, signal.SIGKILL)  # the head's docker save dies mid-stream
                cut.set()

    result = stream.deploy_stream(head, as_nodes([victim]), hook)
    assert cut.is_set()
    row = by_name(result)[victim.name]
    assert row.outcome == "failed" and "docker save on the head failed" in row.error, row
    assert tag_id(victim, test_image.moving_tag) == old_ids[victim.name]
    assert tag_id(victim, test_image.tag) is None


def test_cli_deploy_updates_only_the_stale_node_and_status_agrees(
        nodes, head, registry, pushed, cluster_file, old_ids, test_image, shown) -> None:
    make_stale(nodes[1], test_image, old_ids)
    proc = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    table = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("node")}
    assert table[nodes[1].name][1] == "updated" and shown[:19] in table[nodes[1].name][2], out
    assert {table[n.name][1] for n in (nodes[0], nodes[2])} <= {"current", "updated"}
    assert f"{nodes[1].name} " in proc.stderr and " pull " in proc.stderr  # per-node progress lines
    assert f"every node runs {test_image.moving_tag} = {head.image_id}" in out
    for node in nodes:
        assert tag_id(node, test_image.moving_tag) == shown
        assert tag_id(node, test_image.tag) == shown
    again = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    assert again.returncode == 0 and "0 updated, 3 current, 0 failed" in again.stdout, again.stdout
    status = cli("status", VARIANT, "--cluster", str(cluster_file))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"all 3 nodes match: {head.image_id}" in status.stdout
