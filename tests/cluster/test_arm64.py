"""A Spark's platform from this x86-64 machine: testarm64 (vLLM 0.20.0's aarch64 wheel, a patch mod and a
drop-in file mod on an arm64 Debian) built for linux/arm64 by the real command line, its RUN steps and its
static tier run under QEMU; then `deploy` to namespace hosts, whose engines are amd64, is refused for each
node in one line before anything is sent."""

from __future__ import annotations

import json
import platform
import re
import subprocess
from pathlib import Path

import pytest

from sparkforge.build.builder import STILL_RUNNING
from tests.cluster.clusterkit import node_docker
from tests.support.bases import ensure_arm64_base
from tests.support.cli import run_cli as sparkforge
from tests.support.docker import CA, VARIANTS

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.network, pytest.mark.root,
              pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for arm64 from an x86-64 machine, "
                                 "against amd64 nodes; on a Spark every build test builds for arm64 natively")]

VARIANT = "testarm64"


def cli(*args: str, timeout: float = 600):
    return sparkforge("--images", str(VARIANTS), *args, timeout=timeout)


@pytest.fixture(scope="module")
def arm_image() -> dict:
    """testarm64 built (and its static tier passed) on this engine; its plan as `show --json` gives it."""
    ensure_arm64_base()
    built = cli("build", VARIANT, "--ca-cert", CA, timeout=3600)
    assert built.returncode == 0, built.stdout + built.stderr
    return {**json.loads(cli("show", VARIANT, "--json").stdout), "built": built}


def test_a_long_step_under_emulation_says_again_what_it_is_doing(arm_image: dict) -> None:
    """Every step whose own output spans more than STILL_RUNNING seconds (pip's install, under QEMU, in a cold
    build) shows its progress again with its latest line, so a long wait is never silent."""
    built = arm_image["built"]
    log = Path(built.stdout.split("; log: ", 1)[1].split()[0])
    times: dict[str, list[float]] = {}
    names = {}
    for line in log.read_text(errors="replace").splitlines():
        if m := re.match(r"^#(\d+) \[([^\]]+)\] ", line):
            names[m.group(1)] = m.group(2)
        elif (m := re.match(r"^#(\d+) ([0-9.]+) ", line)) and m.group(1) in names:
            times.setdefault(names[m.group(1)], []).append(float(m.group(2)))
    long = [name for name, seen in times.items() if max(seen) - min(seen) > 3 * STILL_RUNNING
            and not name.startswith(("internal", "context "))]  # BuildKit's own steps are not shown
    for name in long:
        assert re.search(rf"^  {VARIANT} \d\d:\d\d \[{re.escape(name)}\] \.\.\. ", built.stderr, re.M), \
            (name, built.stderr[-3000:])


def test_the_image_is_arm64_with_its_mods_and_the_kernels_of_the_aarch64_wheel(arm_image: dict) -> None:
    assert arm_image["platform"] == "linux/arm64"
    inspected = cli("inspect", arm_image["tag"], "--json")
    assert inspected.returncode == 0, inspected.stderr
    data = json.loads(inspected.stdout)
    record = data["record"]
    assert record["machine"] == "aarch64"  # what the image's own Python saw, under QEMU
    assert [(m["name"], m["result"]) for m in record["mods"]] == [
        ("uf17-eager-allreduce", "applied"), ("serve-torchrun", "applied")]
    kernels = record["kernels"]
    assert kernels["gpus"] == ["12.1"]
    assert sorted(kernels["not_needed"]) == ["_flashmla_C", "_flashmla_extension_C", "_vllm_fa3_C"]
    assert len(kernels["extensions"]) >= 7, kernels  # the wheel's aarch64 libraries with device code, each read
    config = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .}}", arm_image["tag"]],
                                       capture_output=True, text=True, check=True, timeout=60).stdout)
    assert (config["Os"], config["Architecture"]) == ("linux", "arm64")
    text = cli("inspect", arm_image["tag"])
    assert "  platform     linux/arm64 (its Python ran as aarch64)" in text.stdout


def test_deploy_refuses_each_amd64_node_in_one_line_before_anything_is_sent(cluster, cluster_file,
                                                                           arm_image: dict) -> None:
    tag = arm_image["tag"]
    proc = cli("deploy", VARIANT, "--cluster", str(cluster_file), "--mode", "stream", "--nodes", "node1,node3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    for name in ("node1", "node3"):
        assert (f"{name}: failed: its engine runs amd64 images, and {tag} is built for linux/arm64; nothing was "
                "sent to it") in said, said
        host = next(h for h in cluster.nodes if h.name == name)
        assert node_docker(cluster, host, "image", "inspect", tag).returncode != 0


def test_status_says_an_amd64_node_cannot_run_the_arm64_image(cluster_file, arm_image: dict) -> None:
    proc = cli("status", VARIANT, "--cluster", str(cluster_file), "--nodes", "node1,node2")
    said = proc.stdout + proc.stderr
    for name in ("node1", "node2"):
        line = next(x for x in said.splitlines() if x.split()[:1] == [name])
        assert "its engine runs amd64 images" in line, said


def test_the_builder_here_runs_arm64_steps() -> None:
    from sparkforge.build.builder import BuildOptions, builder_platforms, engine_arch

    assert engine_arch(None) == "amd64"
    assert {"linux/amd64", "linux/arm64"} <= set(builder_platforms(BuildOptions()))
