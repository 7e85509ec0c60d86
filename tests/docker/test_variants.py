"""The variants that compile nothing, on the real engine: pypi033's x86-64 counterpart (PyPI's real vLLM 0.33.0
wheel, its lock's wheel set installed with hashes enforced, the kernel check for a GB10), and a `vllm.source:
base` variant on a local base that carries a real vLLM release."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import run_cli as sparkforge
from tests.support.docker import BASE, VARIANTS, build_args, image_id
from tests.support.paths import CA, IMAGES, TEST_MODS

pytestmark = [pytest.mark.docker, pytest.mark.network]

V033 = "testvllm033"
BUILD_TIMEOUT = 3600  # a 1.7 GB image: exporting and unpacking it took 20 minutes on 2 busy cores
BASE_VLLM = "sparkforge-test/base-vllm027:bookworm"  # the local base plus PyPI's vLLM 0.2.7, made below


def _plan(images: Path, variant: str, *args: str, mods: Path | None = None) -> dict:
    proc = sparkforge("--images", str(images), *(["--mods", str(mods)] if mods else []), "show", variant, "--json",
                      *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def locked033(base_image: str, tmp_path_factory) -> Path:
    """A copy of the test variants with testvllm033 locked on this machine (`lock --no-build`: the wheel set
    from PyPI through uv, without a build) and built with `build --locked`; the folder."""
    images = tmp_path_factory.mktemp("v033") / "images"
    shutil.copytree(VARIANTS, images)
    lock = sparkforge("--images", str(images), "lock", V033, "--base", BASE, "--no-build")
    assert lock.returncode == 0, lock.stdout + lock.stderr
    proc = sparkforge(*build_args(V033, "--locked", images=images), timeout=BUILD_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return images


@pytest.mark.parametrize("variant", [V033, "testarm033"])
def test_the_counterparts_carry_pypi033s_mods_and_kernel_entries(variant: str) -> None:
    ours, shipped = _plan(VARIANTS, variant), _plan(IMAGES, "pypi033")
    for key in ("kernels_not_needed", "gpus", "env"):
        assert ours[key] == shipped[key], key
    assert [m["name"] for m in ours["mods"]] == [m["name"] for m in shipped["mods"]]
    assert ours["vllm"]["version"] == shipped["vllm"]["version"] == "0.33.0"


def test_the_locked_wheel_set_is_installed_with_its_hash(locked033: Path) -> None:
    lock = json.loads((locked033 / f"{V033}.lock.json").read_text())
    files = lock["wheels"]["packages"]["vllm"]["files"]
    assert [f["file"] for f in files] == ["vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"]
    plan = _plan(locked033, V033, "--base", BASE)
    record = json.loads(sparkforge("inspect", plan["tag"], "--json").stdout)["record"]
    assert record["installed"]["vllm"] == "0.33.0"
    assert plan["wheel_set"][0]["files"][0][1] == files[0]["sha256"]


def test_a_wheel_whose_hash_is_not_the_locks_is_refused(locked033: Path, tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(locked033, images)
    path = images / f"{V033}.lock.json"
    lock = json.loads(path.read_text())
    wheel = lock["wheels"]["packages"]["vllm"]["files"][0]
    good = wheel["sha256"]
    wheel["sha256"] = ("0" if wheel["sha256"][0] != "0" else "1") + wheel["sha256"][1:]
    path.write_text(json.dumps(lock, indent=2))
    plan = _plan(images, V033, "--base", BASE)
    proc = sparkforge(*build_args(V033, "--locked", images=images), timeout=BUILD_TIMEOUT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # the download on this machine refuses it, before any build step runs
    assert (f"pip download of the wheel set failed: vllm==0.33.0: the index's file has sha256 {good}, the lock says "
            f"{wheel['sha256']}") in last, last
    assert image_id(plan["tag"]) is None


def test_the_kernel_check_passes_for_a_gb10_with_the_entries(locked033: Path) -> None:
    proc = sparkforge("--images", str(locked033), "test", V033, "--base", BASE, "--tier", "static")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "kernels" in line]
    for name in ("_C_stable_libtorch", "_moe_C_stable_libtorch", "_flashkda_C", "_vllm_fa2_C"):
        row = next((r for r in rows if f"/{name}." in r), "")
        assert row and "failed" not in row and "skipped" not in row, (name, rows)
    for name in ("_vllm_fa3_C", "_flashmla_C", "_flashmla_extension_C", "_deepselect_C", "_qutlass_C"):
        assert any(f"/{name}." in r and "skipped" in r for r in rows), (name, rows)


@pytest.fixture(scope="module")
def vllm_base(base_image: str, tmp_path_factory) -> str:
    """The local base plus PyPI's real vLLM 0.2.7 wheel (no dependencies), as an NGC vLLM image carries its
    vLLM: built here, never pulled."""
    if image_id(BASE_VLLM) is None:
        work = tmp_path_factory.mktemp("base-vllm")
        (work / "Dockerfile").write_text(
            f"FROM {base_image}\n"
            "RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \\\n"
            "    python3 -m pip install --break-system-packages --no-cache-dir --no-deps vllm==0.2.7\n")
        proc = subprocess.run(["docker", "buildx", "build", "--load", "--network", "host", "--secret",
                               f"id=ca,src={CA}", "-t", BASE_VLLM, str(work)], capture_output=True, text=True,
                              timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return BASE_VLLM


def test_check_mods_reads_the_bases_own_tree(vllm_base: str) -> None:
    proc = sparkforge("--images", str(VARIANTS), "--mods", str(TEST_MODS), "check-mods", "testbase")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "repro-stamp" in line)
    assert "applied" in row, proc.stdout
    text = " ".join(proc.stdout.split())
    assert f"installed in the base {vllm_base}" in text, text
    assert "/dist-packages/vllm" in text and f"image {image_id(vllm_base)[:19]}" in text, text


def test_a_base_variant_keeps_the_bases_vllm_and_applies_its_mod(vllm_base: str) -> None:
    proc = sparkforge("--images", str(VARIANTS), "--mods", str(TEST_MODS), "build", "testbase", "--ca-cert", CA,
                      "--no-smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = _plan(VARIANTS, "testbase", mods=TEST_MODS)
    # vllm 0.2.7 imports torch, which the base lacks: its file is found without importing it.
    grep = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python3", plan["tag"], "-c",
                           "import importlib.metadata as m, importlib.util, pathlib; print(m.version('vllm')); "
                           "print('SPARKFORGE_REPRO_STAMP' in pathlib.Path(importlib.util.find_spec('vllm').origin)"
                           ".read_text())"],
                          capture_output=True, text=True, timeout=120)
    assert grep.stdout.split() == ["0.2.7", "True"], grep.stdout + grep.stderr
    record = json.loads(sparkforge("inspect", plan["tag"], "--json").stdout)["record"]
    assert record["vllm"]["source"] == "base"
    assert record["protected"].get("vllm") == "0.2.7"
    assert [(m["name"], m["result"]) for m in record["mods"]] == [("repro-stamp", "applied")]


def test_a_base_that_carries_another_release_is_refused(vllm_base: str, tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(VARIANTS, images)
    (images / "testbase-wrong.yaml").write_text(
        "extends: testbase\ndescription: testbase naming another release (test variant)\n"
        'vllm: {version: "0.2.6"}\nmods: []\n')
    proc = sparkforge("--images", str(images), "build", "testbase-wrong", "--ca-cert", CA, "--no-smoke")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "build failed at step [base" in last, last
    log = Path(re.search(r"\(build log: (\S+\.log)\)", last)[1]).read_text()
    assert "the base carries vllm 0.2.7, but the recipe says vllm.version 0.2.6" in log, log[-2000:]


def test_the_030_counterpart_carries_ng030s_install_mods() -> None:
    """tests/variants/testvllm030.yaml, ng030's install mods on PyPI's 0.30.0 wheel, for a build by hand: the suite
    proves those mods on the 0.30.0 source (check-mods) and builds the same mods on the 0.33.0 wheel above."""
    ng030 = sparkforge("show", "ng030", "--json")
    assert ng030.returncode == 0, ng030.stderr
    install_mods = [m["name"] for m in json.loads(ng030.stdout)["mods"] if m["spec"]["phase"] == "install"]
    assert install_mods
    counterpart = _plan(VARIANTS, "testvllm030", "--base", BASE)
    assert [m["name"] for m in counterpart["mods"]] == install_mods
    assert counterpart["vllm"]["version"] == "0.30.0"
