"""Distribution to hosts that are hosts: ssh:// nodes in namespaces, a TLS registry on the head's address,
one node on the containerd image store.

The tests are ordered (each still makes its own preconditions): a cold deploy over ssh that
`status` confirms, faults of the ssh layer, a node's engine dying or stalling mid-pull and the
registry down, then a stalled stream.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import pytest

from tests.cluster.clusterkit import VARIANT, make_stale, node_docker, node_id
from tests.support.cli import run_cli as sparkforge
from tests.support.docker import BASE, VARIANTS, config_digest
from tests.support.paths import ROOT
from tests.infra.procs import processes, read_bytes
from sparkforge.distribute import stream
from sparkforge.distribute.images import head_image, read_state
from sparkforge.distribute.cluster import resolve_cluster
from sparkforge.distribute.nodes import PULL_STALL_TIMEOUT
from sparkforge.build.pipeline import LockPolicy, load_plan
from sparkforge.recipe.layout import Layout

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.network, pytest.mark.root]


@pytest.fixture(scope="module")
def test_image(frozen):
    """The test image of this module (built from its frozen copy of mods/)."""
    return frozen[1]


@pytest.fixture(scope="module")
def cli(frozen):
    """The real command line, on the test variant with this module's copy of mods/."""
    def run(*args: str):
        return sparkforge("--images", str(VARIANTS), "--mods", str(frozen[0]), *args, "--base", BASE)
    return run


def rows(stdout: str, names) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines() if line.split()[:1] and
            line.split()[0] in names}


def layers(cluster, host, ref: str) -> str:
    return node_docker(cluster, host, "image", "inspect", "--format", "{{json .RootFS.Layers}}", ref).stdout.decode()


@pytest.fixture(scope="module")
def head(test_image, frozen):
    plan = load_plan(Layout.default(ROOT, images_dir=VARIANTS, mods_dir=frozen[0]), VARIANT, base=BASE,
                     lock_policy=LockPolicy.AUTO).plan
    assert plan.tag == test_image.tag
    return head_image(plan)


@pytest.fixture(scope="module")
def pushed(registry, cluster_file, test_image, cli):
    proc = cli("push", VARIANT, "--cluster", str(cluster_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_each_host_has_its_own_engine_over_ssh_and_no_route_out(cluster) -> None:
    drivers = {}
    for host in cluster.nodes:
        proc = cluster.ssh(host, "docker", "info", "--format", "{{.DockerRootDir}} {{.Driver}}")
        assert proc.returncode == 0, proc.stderr
        root, drivers[host.name] = proc.stdout.split()
        assert root == str(host.engine.data_root)
    assert drivers == {"node1": "overlay2", "node2": "overlay2", "node3": "overlayfs"}  # node3: containerd store
    for host in [cluster.head, *cluster.nodes]:
        route = host.exec("ip", "route", "get", "8.8.8.8", check=False)
        assert route.returncode != 0 and "unreachable" in route.stderr, route.stdout


def test_cold_deploy_over_ssh_from_the_tls_registry_and_status(cluster, cluster_file, registry, pushed, cli,
                                                              test_image, head) -> None:
    address = f"{cluster.head.address}:5443"
    assert f"pushed {address}/{test_image.tag}" in pushed.stdout
    # push's default from this containerd-store head, whose engine trusts the cluster's CA: the engine's own push
    assert "route: the engine's own push" in pushed.stdout and "engine's push failed" not in pushed.stdout
    olds = {h.name: make_stale(cluster, h, test_image) for h in cluster.nodes}
    proc = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"to 3 nodes from {address}" in proc.stdout
    assert "3 updated, 0 current, 0 failed" in proc.stdout, proc.stdout
    table = rows(proc.stdout, olds)
    for host in cluster.nodes:
        assert table[host.name][1] == "updated"
        mine = node_id(cluster, host, test_image.moving_tag)
        assert mine == node_id(cluster, host, test_image.tag) and mine != olds[host.name]
        assert layers(cluster, host, test_image.tag) == layers_head(test_image)
    # Identity is not the ID: the classic-store nodes (Docker 28.5 and 26) show the config digest, the
    # containerd-store node the manifest digest the registry holds, which after the engine's own push is the
    # head's: the head, on the containerd store too, shows the manifest digest of its own build.
    config = config_digest(test_image.tag)
    assert {node_id(cluster, h, test_image.tag) for h in cluster.nodes[:2]} == {config} != {test_image.image_id}
    assert node_id(cluster, cluster.nodes[2], test_image.tag) == test_image.image_id

    status = cli("status", VARIANT, "--cluster", str(cluster_file))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"all 3 nodes match: {test_image.image_id}" in status.stdout
    again = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 updated, 3 current, 0 failed; 0 B moved" in again.stdout, again.stdout


def layers_head(test_image) -> str:
    import subprocess

    return subprocess.run(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", test_image.tag],
                          capture_output=True, timeout=60).stdout.decode()


def test_a_stopped_sshd_and_an_unknown_host_key_fail_fast_and_the_other_node_updates(
        cluster, cluster_file, registry, pushed, cli, test_image, tmp_path) -> None:
    down, stranger, stale = cluster.nodes
    olds = {h.name: make_stale(cluster, h, test_image) for h in cluster.nodes}
    # A known_hosts that lacks the stranger's key, in a copy of the cluster file.
    known = tmp_path / "known_hosts"
    known.write_text("".join(h.known_hosts_line + "\n" for h in cluster.nodes if h is not stranger))
    other = tmp_path / "cluster.yaml"
    other.write_text(cluster_file.read_text().replace(str(cluster.known_hosts), str(known)))
    down.stop_sshd()
    try:
        proc = cli("deploy", VARIANT, "--cluster", str(other))
    finally:
        cluster.start_sshd(down)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 updated, 0 current, 2 failed" in proc.stdout, proc.stdout
    lines = {h.name: [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{h.name}: failed: ")]
             for h in (down, stranger)}
    assert len(lines[down.name]) == 1 and f"unreachable at {down.endpoint}: connection refused" in lines[down.name][0]
    assert len(lines[stranger.name]) == 1 and "host key of" in lines[stranger.name][0]
    assert "unknown or changed" in lines[stranger.name][0]
    assert "Traceback" not in proc.stderr
    table = rows(proc.stdout, olds)
    for host in (down, stranger):
        assert table[host.name][1] == "failed"
        # It failed on the refusal, not on a limit: the longest a node waits is the pull's stall limit.
        assert float(table[host.name][5].rstrip("s")) < PULL_STALL_TIMEOUT, table[host.name]
        assert node_id(cluster, host, test_image.moving_tag) == olds[host.name]  # keeps its old image
    assert table[stale.name][1] == "updated"
    assert node_id(cluster, stale, test_image.moving_tag) == node_id(cluster, stale, test_image.tag)


def failure_lines(proc, host) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{host.name}: failed: ")]


def images(cluster, host) -> list[str]:
    return sorted(node_docker(cluster, host, "images", "-qa", "--no-trunc").stdout.decode().split())


@contextlib.contextmanager
def during_pull(host, act, after: int = 20_000_000):
    """Call act() once this host's engine, pulling for a `docker pull` run by its sshd, has read `after`
    more bytes; yields an Event that is set when it has."""
    acted, stop = threading.Event(), threading.Event()

    def watch() -> None:
        start = None
        while not stop.is_set():
            pid = host.engine.pid()
            if pid and processes("pull", env=f"DOCKER_HOST={host.engine.endpoint}", program="docker"):
                start = read_bytes(pid) if start is None else start
                if read_bytes(pid) - start > after:
                    act()
                    acted.set()
                    return
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield acted
    finally:
        stop.set()
        watcher.join()


def assert_only_victim_kept_old(proc, cluster, victim, test_image, olds: dict) -> None:
    """The victim's moving tag is still on its old image and it has no new tag; every other node is updated."""
    assert node_id(cluster, victim, test_image.moving_tag) == olds[victim.name]
    assert node_id(cluster, victim, test_image.tag) is None
    for host in cluster.nodes:
        if host is not victim:
            assert not failure_lines(proc, host), proc.stdout
            assert node_id(cluster, host, test_image.moving_tag) == node_id(cluster, host, test_image.tag)
            assert node_id(cluster, host, test_image.moving_tag) != olds[host.name]


def test_a_node_whose_engine_dies_mid_pull_fails_alone_and_keeps_its_old_image(
        cluster, cluster_file, registry, pushed, cli, test_image) -> None:
    victim = cluster.nodes[1]
    olds = {h.name: make_stale(cluster, h, test_image) for h in cluster.nodes}
    try:
        with during_pull(victim, victim.engine.crash) as crashed:  # SIGKILL its dockerd mid-download
            proc = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    finally:
        if victim.engine.pid() is None:
            victim.engine.start()  # the later tests, and the fixture's teardown, find it running again
    assert crashed.is_set(), "the victim's engine was never seen pulling"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 updated, 0 current, 1 failed" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = failure_lines(proc, victim)
    assert len(lines) == 1 and f"still on {olds[victim.name][:19]}" in lines[0], proc.stdout
    assert_only_victim_kept_old(proc, cluster, victim, test_image, olds)


def test_registry_down_every_node_fails_in_one_line_and_nothing_changes(cluster, cluster_file, registry, pushed,
                                                                         cli, test_image) -> None:
    olds = {h.name: make_stale(cluster, h, test_image) for h in cluster.nodes}
    before = {h.name: images(cluster, h) for h in cluster.nodes}
    stopped = registry("stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    try:
        proc = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    finally:
        started = registry("start")
        assert started.returncode == 0, started.stdout + started.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 updated, 0 current, 3 failed" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr
    address = f"{cluster.head.address}:5443"
    for host in cluster.nodes:
        lines = failure_lines(proc, host)
        assert len(lines) == 1, proc.stdout
        assert f"pull of {address}/{test_image.tag} failed" in lines[0] and "connection refused" in lines[0], lines
        assert f"still on {olds[host.name][:19]}" in lines[0]
        assert node_id(cluster, host, test_image.moving_tag) == olds[host.name]
        assert node_id(cluster, host, test_image.tag) is None
        assert images(cluster, host) == before[host.name]  # nothing half-pulled, nothing tagged


def test_a_stalled_pull_is_stopped_and_only_that_node_fails(cluster, cluster_file, registry, pushed, cli,
                                                           test_image) -> None:
    victim = cluster.nodes[0]
    olds = {h.name: make_stale(cluster, h, test_image) for h in cluster.nodes}
    frozen: list[int] = []
    thaws: list[threading.Timer] = []

    def freeze() -> None:
        # The victim's dockerd stops answering mid-download, alive: its docker pull prints nothing more.
        pid = victim.engine.pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        # Without a stall limit the deploy would wait for the engine: thaw it later, so the test fails, not hangs.
        thaw = threading.Timer(240, os.kill, (pid, signal.SIGCONT))
        thaw.daemon = True
        thaw.start()
        thaws.append(thaw)

    pulling = f"DOCKER_HOST={victim.engine.endpoint}"
    try:
        with during_pull(victim, freeze) as stalled:
            # 60 s: well above the longest silence of a healthy node, the containerd-store one while it
            # unpacks a layer (up to 26 s seen here with the machine busy).
            proc = cli("deploy", VARIANT, "--cluster", str(cluster_file), "--stall", "60")
        # The node's docker pull ended with the connection (its terminal hung up), the engine still frozen.
        left = processes("pull", env=pulling, program="docker")
        for _ in range(100):
            if not left:
                break
            time.sleep(0.1)
            left = processes("pull", env=pulling, program="docker")
    finally:
        for thaw in thaws:
            thaw.cancel()
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert stalled.is_set(), "the victim's engine was never seen pulling"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 updated, 0 current, 1 failed" in proc.stdout, proc.stdout
    lines = failure_lines(proc, victim)
    assert len(lines) == 1, proc.stdout
    assert f"pull of {cluster.head.address}:5443/{test_image.tag} stalled: no progress for 60s" in lines[0]
    assert not left, f"the node's docker pull still runs: {left}"
    assert_only_victim_kept_old(proc, cluster, victim, test_image, olds)


def _remote_loader(host) -> int | None:
    """The pid of `docker load` run by this host's sshd (its environment names the host's engine)."""
    found = processes("load", env=f"DOCKER_HOST={host.engine.endpoint}", program="docker")
    return found[0] if found else None


def test_stream_a_stalled_node_is_dropped_and_the_others_finish(cluster, cluster_file, test_image, head,
                                                               tmp_path) -> None:
    victim, _, other = cluster.nodes  # other: the containerd-store node
    olds = {h.name: make_stale(cluster, h, test_image) for h in (victim, other)}
    target = resolve_cluster(cluster_file, [victim.name, other.name], None)
    stopped: list[int] = []
    done = threading.Event()

    def stopper() -> None:
        # Freeze (not kill) the victim's docker load once 30 MB went in: it stays alive, reading nothing.
        while not done.is_set():
            pid = _remote_loader(victim)
            if pid and read_bytes(pid) > 30_000_000:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                return
            done.wait(0.05)

    watcher = threading.Thread(target=stopper, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        result = stream.deploy_stream(head, target.nodes, state_dir=tmp_path, stall_timeout=8)
    finally:
        done.set()
        watcher.join()
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
    seconds = time.monotonic() - t0
    assert stopped, "the victim's docker load was never seen"
    by = {r.node.name: r for r in result.results}
    assert by[victim.name].outcome == "failed" and "stalled" in by[victim.name].error, by[victim.name]
    assert by[other.name].outcome == "updated", by[other.name]
    assert by[other.name].bytes_moved > 100_000_000
    assert node_id(cluster, victim, test_image.moving_tag) == olds[victim.name]
    assert node_id(cluster, other, test_image.moving_tag) == node_id(cluster, other, test_image.tag)
    # The containerd node's ID is the manifest digest of the saved tarball, now recorded on the head.
    recorded = read_state(tmp_path, head.repository)["manifests"][head.tag]
    assert node_id(cluster, other, test_image.tag) in recorded
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", recorded[0])
    print(f"stream with one stalled node: {seconds:.1f}s")


def test_deploy_previous_moves_every_node_back_and_status_shows_it(cluster, cluster_file, registry, pushed, cli,
                                                                   test_image, frozen, tmp_path) -> None:
    import shutil

    from tests.support.paths import CA

    first = cli("deploy", VARIANT, "--cluster", str(cluster_file))
    assert first.returncode == 0, first.stdout + first.stderr
    # A second, real build: one install-phase mod changed (a copy of mods/), so a new tag.
    mods = tmp_path / "mods"
    shutil.copytree(frozen[0], mods)
    plan = load_plan(Layout.default(ROOT, images_dir=VARIANTS, mods_dir=frozen[0]), VARIANT, base=BASE,
                     lock_policy=LockPolicy.AUTO).plan
    mod = plan.mods_in("install")[0]
    with open(mods / mod.name / "mod.yaml", "a", encoding="utf-8") as f:
        f.write("# changed for the rollback test\n")
    changed = ("--images", str(VARIANTS), "--mods", str(mods))
    built = sparkforge(*changed, "build", VARIANT, "--base", BASE, "--ca-cert", CA, "--no-smoke")
    assert built.returncode == 0, built.stdout + built.stderr
    for verb in ("push", "deploy"):
        proc = sparkforge(*changed, verb, VARIANT, "--base", BASE, "--cluster", str(cluster_file))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 updated" in proc.stdout
    newer = {h.name: node_id(cluster, h, test_image.moving_tag) for h in cluster.nodes}
    # status compares with the build the last deploy set, whichever recipe asks, and says so.
    status = cli("status", VARIANT, "--cluster", str(cluster_file))
    newer_tag = next(w for w in proc.stdout.split() if w.startswith(f"{test_image.moving_tag}-"))
    assert status.returncode == 0 and f"compared with {newer_tag}, the build the last deploy set" in status.stdout, (
        status.stdout + status.stderr)

    back = cli("deploy", VARIANT, "--cluster", str(cluster_file), "--previous")
    assert back.returncode == 0, back.stdout + back.stderr
    assert f"deploying {test_image.tag}" in back.stdout and "0 failed" in back.stdout
    status = cli("status", VARIANT, "--cluster", str(cluster_file))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"all 3 nodes match: {test_image.image_id}" in status.stdout and "compared with" not in status.stdout
    for host in cluster.nodes:
        assert node_id(cluster, host, test_image.moving_tag) != newer[host.name]
    history = cli("history", VARIANT)
    assert history.returncode == 0
    # the row of this very tag (another test may have kept a rebuild of it as TAG.ID beside it)
    line = next(ln for ln in history.stdout.splitlines() if ln.split()[:1] == [test_image.tag.rpartition(":")[2]])
    assert "node1, node2, node3" in line, history.stdout
