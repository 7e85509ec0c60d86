"""The recipe side of the kernel check: the `gpus` and `kernels_not_needed` fields, their defaults,
their place in the plan and the tag, and `show`'s warning from vLLM 0.30.0's arch filtering."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sparkforge.recipe.archlist import cuda_archs, loose_intersection, sm12x_warnings
from tests.support.recipes import pypi_recipe

RECIPE = pypi_recipe("0.30.0")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "images").mkdir()
    (tmp_path / "mods").mkdir()
    (tmp_path / "images" / "good.yaml").write_text(RECIPE)
    return tmp_path


def _show(cli, project: Path, variant: str = "good", *extra: str):
    return cli("--images", str(project / "images"), "--mods", str(project / "mods"), "show", variant, *extra,
               cwd=project)


def _plan(cli, project: Path, variant: str = "good") -> dict:
    proc = _show(cli, project, variant, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("arch_list, gpus", [
    ("12.1a", ["12.1"]), ("12.0a;12.1a", ["12.0", "12.1"]), ("8.0+PTX;9.0a;12.0f", ["8.0", "9.0", "12.0"]),
    ("12.0;12.0a", ["12.0"]),
])
def test_gpus_default_to_the_arch_list(cli, project, arch_list, gpus):
    (project / "images" / "good.yaml").write_text(RECIPE.replace('"12.1a"', f'"{arch_list}"'))
    assert _plan(cli, project)["gpus"] == gpus


def test_gpus_and_not_needed_are_part_of_the_plan_and_the_tag(cli, project):
    before = _plan(cli, project)
    (project / "images" / "good.yaml").write_text(RECIPE + 'gpus: ["12.1"]\n')
    same = _plan(cli, project)
    assert same["gpus"] == ["12.1"] and same["tag"] == before["tag"]  # written out, as the default gives it
    (project / "images" / "good.yaml").write_text(RECIPE + 'gpus: ["12.0", "12.1"]\n')
    assert _plan(cli, project)["tag"] != before["tag"]
    (project / "images" / "good.yaml").write_text(RECIPE + "kernels_not_needed: {_vllm_fa3_C: Hopper only}\n")
    plan = _plan(cli, project)
    assert plan["kernels_not_needed"] == [["_vllm_fa3_C", "Hopper only"]] and plan["tag"] != before["tag"]
    shown = _show(cli, project).stdout
    assert "gpus        12.1" in shown and "not needed  _vllm_fa3_C: Hopper only" in shown


def test_the_distributions_to_scan_are_part_of_the_plan_and_the_tag(cli, project):
    before = _plan(cli, project)
    (project / "images" / "good.yaml").write_text(RECIPE + "kernels_scan: []\n")
    assert _plan(cli, project)["tag"] == before["tag"]  # an empty list is the default: the tag stays
    (project / "images" / "good.yaml").write_text(RECIPE + "kernels_scan: [torch, nvidia-nccl-cu13]\n")
    plan = _plan(cli, project)
    assert plan["kernels_scan"] == ["torch", "nvidia-nccl-cu13"] and plan["tag"] != before["tag"]
    assert "scan        torch, nvidia-nccl-cu13" in _show(cli, project).stdout
    out = project / "out"
    proc = cli("--images", str(project / "images"), "--mods", str(project / "mods"), "render", "good", "-o", str(out),
               cwd=project)
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in (out / "Dockerfile").read_text().splitlines() if " kernels scan " in x]
    assert "--dist vllm --dist torch --dist nvidia-nccl-cu13 " in line


def test_a_child_replaces_gpus_and_removes_an_exception(cli, project):
    (project / "images" / "good.yaml").write_text(RECIPE + 'gpus: ["12.1"]\nkernels_not_needed: {a_C: x, b_C: y}\n')
    (project / "images" / "kid.yaml").write_text('extends: good\ngpus: ["9.0"]\nkernels_not_needed: {a_C: null}\n')
    plan = _plan(cli, project, "kid")
    assert plan["gpus"] == ["9.0"] and plan["kernels_not_needed"] == [["b_C", "y"]]


def test_an_empty_gpu_list_says_the_image_has_no_kernels_on_purpose(cli, project):
    (project / "images" / "good.yaml").write_text(RECIPE + "gpus: []\n")
    plan = _plan(cli, project)
    assert plan["gpus"] == []
    (project / "images" / "kid.yaml").write_text('extends: good\ngpus: ["12.1"]\n')
    assert _plan(cli, project, "kid")["gpus"] == ["12.1"]


@pytest.mark.parametrize("body, field", [
    ('gpus: ["sm_121"]', "gpus[0]"),
    ('gpus: ["12.1a"]', "gpus[0]"),
    ('gpus: ["12"]', "gpus[0]"),
    ("gpus: [12.1]", "gpus[0]"),
    ('gpus: "12.1"', "gpus"),
    ('gpus: ["12.10"]', "gpus[0]"),
    ('gpus: ["12.1", "12.1"]', "gpus"),
    ('gpus: ["１２.１"]', "gpus[0]"),
    ("kernels_not_needed: {../x: why}", "kernels_not_needed"),
    ("kernels_not_needed: {_vllm_fa3_C.abi3.so: why}", "kernels_not_needed"),
    ('kernels_not_needed: {_vllm_fa3_C: "  "}', "kernels_not_needed._vllm_fa3_C"),
    ("kernels_not_needed: [_vllm_fa3_C]", "kernels_not_needed"),
    ("kernels_not_needed: {_vllm_fa3_C: null}", "kernels_not_needed._vllm_fa3_C"),
    ('kernels_scan: ["torch[opt]"]', "kernels_scan[0]"),
    ("kernels_scan: [torch, Torch]", "kernels_scan"),
    ('kernels_scan: ["torch; rm -rf /"]', "kernels_scan[0]"),
    ("kernels_scan: torch", "kernels_scan"),
])
def test_bad_fields_give_one_line_and_exit_2(cli, project, body, field):
    (project / "images" / "good.yaml").write_text(RECIPE + textwrap.dedent(body) + "\n")
    proc = _show(cli, project)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: ") and "good.yaml" in lines[0] and field in lines[0], lines[0]


# ------------------------------------------------------------------ vLLM 0.30.0's arch filtering


@pytest.mark.parametrize("src, tgt, out", [
    # The cases the comments of cmake/utils.cmake in vLLM 0.30.0 describe.
    (["12.0f"], ["12.1a"], ["12.1a"]),                    # a family source matches a target of its major
    (["8.0+PTX", "12.0f"], ["12.0"], ["12.0f"]),          # an exact base match keeps the source's suffix
    (["12.0a", "12.1a"], ["12.0a", "12.1a"], ["12.0a", "12.1a"]),
    (["7.5", "8.0", "9.0", "12.0"], ["12.0a", "12.1a"], ["12.0a"]),  # a suffixed target takes its base away
    (["7.5", "8.0", "9.0", "12.0"], ["12.1a"], ["12.0"]),  # the highest source of the same major
    (["8.0+PTX"], ["9.0"], ["8.0+PTX"]),                  # PTX crosses majors
    (["8.0"], ["9.0"], []),                               # SASS does not
    (["9.0a", "10.0f"], ["12.0"], []),                    # FlashMLA's list against a GB10 build: dropped
])
def test_loose_intersection(src, tgt, out):
    assert loose_intersection(src, tgt) == out


@pytest.mark.parametrize("arch_list, generic", [
    ("12.1a", ["12.0"]), ("12.0a;12.1a", ["12.0a"]), ("12.0f", ["12.0f"]), ("12.0", ["12.0"]),
    ("9.0a;12.1a", ["9.0a", "12.0"]),
])
def test_cuda_archs_under_cuda_13(arch_list, generic):
    assert cuda_archs(arch_list) == generic


def test_the_warning_names_the_list_and_the_gpu():
    assert sm12x_warnings("12.1a", ("12.1",)) == []
    assert sm12x_warnings("12.0f", ("12.0", "12.1")) == []
    (line,) = sm12x_warnings("12.0a;12.1a", ("12.0", "12.1", "9.0"))
    assert line.startswith("TORCH_CUDA_ARCH_LIST=12.0a;12.1a gives GPU 12.1 no generic kernels and no SM12x kernels")
    assert sm12x_warnings("9.0a", ("12.1",))


def test_show_warns_in_one_line_and_still_succeeds(cli, project):
    (project / "images" / "good.yaml").write_text(RECIPE.replace('"12.1a"', '"12.0a;12.1a"'))
    proc = _show(cli, project)
    assert proc.returncode == 0
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("warning: ") and "good.yaml" in line and "GPU 12.1" in line, line
    (project / "images" / "good.yaml").write_text(pypi_recipe("0.17.0").replace('"12.1a"', '"12.0a;12.1a"'))
    assert _show(cli, project).stderr == ""  # 0.17.0's CMake gives sm_120 for that list: no warning


def test_the_shipped_variants_draw_no_warning(cli):
    for variant in ("ng16", "ng17", "ng17e", "ng030"):
        proc = cli("show", variant)
        assert proc.returncode == 0 and "TORCH_CUDA_ARCH_LIST" not in proc.stderr, (variant, proc.stderr)
