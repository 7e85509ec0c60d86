"""The kernel check on a real build: the vLLM 0.17.0 release wheel's fat binaries are read in the
image, recorded, and checked against the recipe's GPUs before any tag moves."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import run_cli as sparkforge
from tests.support.docker import BASE, VARIANTS, build_args, image_id

pytestmark = [pytest.mark.docker, pytest.mark.network]


def _by_name(record: dict) -> dict[str, dict]:
    return {Path(e["path"]).name: e for e in record["kernels"]["extensions"]}


def test_the_record_holds_each_extensions_archs(test_image) -> None:
    proc = sparkforge("inspect", test_image.tag, "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)["record"]
    assert record["kernels"]["gpus"] == ["12.0"]
    assert record["kernels"]["dists"] == {"vllm": 6}
    exts = _by_name(record)
    # As the wheel holds them (kernels.py on the downloaded wheel, cuobjdump 13.5 agrees bar the f).
    assert exts["_C.abi3.so"]["cubins"] == ["sm_52", "sm_70", "sm_75", "sm_80", "sm_89", "sm_90", "sm_90a",
                                            "sm_100", "sm_100a", "sm_120", "sm_120a"]
    assert exts["_C.abi3.so"]["ptx"] == ["compute_52", "compute_80", "compute_89", "compute_90"]
    assert exts["_vllm_fa3_C.abi3.so"]["cubins"] == ["sm_90a"]
    assert exts["_flashmla_C.abi3.so"]["cubins"] == ["sm_90a", "sm_100f"]
    assert exts["_vllm_fa2_C.abi3.so"]["ptx"] == ["compute_80"]
    assert exts["_C.abi3.so"]["coverage"]["12.0"]["missing"] == 0
    assert "cumem_allocator.abi3.so" not in exts and record["kernels"]["without_device_code"] >= 1
    assert all(e["path"].startswith("/") and e["error"] is None for e in exts.values())
    assert exts["_C.abi3.so"]["relocatable"] == []
    text = sparkforge("inspect", test_image.tag).stdout
    assert "GPU 12.0" in text and "not needed" in text and "sm_120" in text
    (fa2,) = [line for line in text.splitlines() if "_vllm_fa2_C" in line]
    assert fa2.split()[-2:] == ["JIT", "compute_80"], fa2  # a 12.0 runs FA2 through PTX only


def test_the_static_tier_checks_every_extension(test_image) -> None:
    proc = sparkforge("--images", str(VARIANTS), "test", "testvllm", "--base", BASE, "--tier", "static")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("static") and "kernels" in line]
    assert any("_C.abi3.so" in r and " ok " in r and "12.0: sm_120" in r for r in rows), rows
    assert any("_vllm_fa3_C.abi3.so" in r and "skipped" in r for r in rows), rows
    assert any("_vllm_fa2_C.abi3.so" in r and " ok " in r and "PTX only" in r for r in rows), rows


def test_a_gpu_the_wheel_does_not_cover_fails_before_any_tag_moves(test_image, tmp_path: Path) -> None:
    """The wheel's _C holds 90 SM12x kernels only as sm_120a: a GB10 (12.1) cannot run them, though
    it runs the plain sm_120 cubins beside them."""
    images = tmp_path / "images"
    shutil.copytree(VARIANTS, images)
    (images / "testvllm-gb10.yaml").write_text(
        "extends: testvllm\n"
        "description: testvllm for a GB10, which this wheel does not cover (test variant)\n"
        'gpus: ["12.1"]\n')
    plan = json.loads(sparkforge("--images", str(images), "show", "testvllm-gb10", "--base", BASE, "--json").stdout)
    # The moving tag points at a good image before the build; it must still point there after.
    subprocess.run(["docker", "tag", test_image.tag, plan["moving_tag"]], check=True)
    try:
        proc = sparkforge(*build_args("testvllm-gb10", images=images))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "static smoke tier failed (kernels /" in last and "/vllm/_C.abi3.so" in last, last
        assert "GPU 12.1 cannot run 90 kernels, which exist only in sm_120a" in last, last
        assert "_Z22compute_expert_offsetsPKiPiS1_ib" in last, last
        assert f"{plan['moving_tag']} still points to {test_image.image_id[:19]}" in last, last
        assert "Traceback" not in proc.stderr
        assert image_id(plan["moving_tag"]) == test_image.image_id
        assert image_id(plan["tag"]) is None
    finally:
        subprocess.run(["docker", "rmi", plan["moving_tag"], plan["tag"] + "-candidate"], capture_output=True)
