"""What the gpu tests (tests/gpu) build and read, checked where there is no GPU: the CUDA variant's recipe
resolves to the plan those tests rely on, nvidia-smi's list of GPUs is read right, and the smoke table the
command line prints is read back into the checks it was made from."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from sparkforge.build.smoke import Check, TierResult
from sparkforge.cli.views import smoke_table
from tests.support.cli import run_cli
from tests.support.cuda import VARIANT, VLLM, parse_devices, recipe, smoke_rows
from tests.support.paths import BASE


@pytest.mark.parametrize("capabilities", [["12.1"], ["8.9", "12.0"]])
def test_the_cuda_variant_is_the_release_wheel_with_its_dependencies_for_the_host_s_gpus(
        tmp_path: Path, capabilities: list[str]) -> None:
    (tmp_path / f"{VARIANT}.yaml").write_text(recipe(capabilities))
    proc = run_cli("--images", str(tmp_path), "show", VARIANT, "--base", BASE, "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert (plan["vllm"]["source"], plan["vllm"]["version"], plan["vllm"]["install_deps"]) == ("pypi", VLLM, True)
    assert plan["build"]["torch_cuda_arch_list"] == ";".join(capabilities)
    assert plan["gpus"] == capabilities and plan["mods"] == []
    assert f"{plan['base']['repository']}:{plan['base']['tag']}" == BASE


def test_nvidia_smi_s_list_of_gpus_is_read_per_line() -> None:
    assert parse_devices("12.1, NVIDIA GB10\n") == [("12.1", "NVIDIA GB10")]
    assert parse_devices("8.9, NVIDIA GeForce RTX 4090\n9.0, NVIDIA H100 80GB HBM3\n\n") == [
        ("8.9", "NVIDIA GeForce RTX 4090"), ("9.0", "NVIDIA H100 80GB HBM3")]


def test_the_smoke_table_reads_back_into_its_checks() -> None:
    results = [TierResult("gpu", (Check("torch.cuda.is_available()", "ok", "NVIDIA GB10"),
                                  Check("sm_121 in TORCH_CUDA_ARCH_LIST", "failed", "8.0"))),
               TierResult("serve", (Check("server healthy", "failed", "the server's container exited"),
                                    Check("server log kept", "failed", "build/logs/sparkforge-serve-7-41000.log"))),
               TierResult("static", (Check("mod m: python: " + "import x; " * 7, "ok", ""),),
                          skipped="not asked for")]
    printed = io.StringIO()
    Console(file=printed, width=100, soft_wrap=True).print(smoke_table(results))  # narrow: cells wrap
    rows = smoke_rows("some line before the table\n" + printed.getvalue() + "\nand one after\n")
    assert rows == {("gpu", "torch.cuda.is_available()"): ("ok", "NVIDIA GB10"),
                    ("gpu", "sm_121 in TORCH_CUDA_ARCH_LIST"): ("failed", "8.0"),
                    ("serve", "server healthy"): ("failed", "the server's container exited"),
                    ("serve", "server log kept"): ("failed", "build/logs/sparkforge-serve-7-41000.log"),
                    ("static", "(whole tier)"): ("skipped", "not asked for"),
                    ("static", "mod m: python: " + "import x; " * 6 + "import x;"): ("ok", "")}
    assert len(printed.getvalue().splitlines()) > len(rows) + 1  # some of them did wrap
