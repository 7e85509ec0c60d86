"""The small CUDA variant of the gpu tests (tests/gpu), and how the tests read what `test` prints.

The variant is the vLLM 0.33.0 release wheel installed with its dependencies on the local Debian base
(Python 3.11; the release asks for >=3.11): pip brings the torch 2.14.0 it pins (requirements/cuda.txt),
a CUDA 13 build on PyPI for x86-64 and aarch64 (it requires the nvidia-*-cu13 packages), as vLLM's own
wheels are (VLLM_MAIN_CUDA_VERSION "13.0" in vllm/envs.py). Its arch list and GPUs are the compute
capabilities of the host's GPUs, so the gpu tier's check of the arch list is a check of this host. Nothing
is compiled. It runs where the driver runs CUDA 13.0 (tests/support/needs.py: cuda-driver).
"""

from __future__ import annotations

import platform
import subprocess

VARIANT = "testcuda"
VLLM = "0.33.0"


def recipe(capabilities: list[str]) -> str:
    """The recipe, for GPUs of these compute capabilities ("12.1")."""
    arch_list = ";".join(capabilities)
    return f"""# Written by tests/support/cuda.py for the gpu tests: the gpu and serve smoke tiers on this host's GPUs.
description: vLLM {VLLM} release wheel with its dependencies (a CUDA 13.0 torch from PyPI), for {arch_list}
image: sparkforge-test/vllm
platform: linux/{"arm64" if platform.machine() == "aarch64" else "amd64"}
base:
  repository: sparkforge/base-local
  tag: bookworm
  digest:
    unknown: made on this machine by `make base-local`; no registry holds it
vllm:
  source: pypi
  version: "{VLLM}"
  install_deps: true
build:
  torch_cuda_arch_list: "{arch_list}"
gpus: [{", ".join(f'"{c}"' for c in capabilities)}]
"""


def devices() -> list[tuple[str, str]]:
    """The compute capability and name of each of this host's GPUs, as nvidia-smi reports them."""
    proc = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap,name", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30, check=True)
    return parse_devices(proc.stdout)


def parse_devices(text: str) -> list[tuple[str, str]]:
    found = []
    for line in filter(str.strip, text.splitlines()):
        capability, name = line.split(",", 1)
        found.append((capability.strip(), name.strip()))
    return found


def smoke_rows(stdout: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(tier, check) -> (result, detail) from the table `build.py test` prints, its columns found by its
    header (tier, check, result, detail); a cell that wrapped goes on in the same column of the next lines."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:4] == ["tier", "check", "result", "detail"])
    starts = [0, *(lines[head].index(word) for word in ("check", "result", "detail"))]
    rows: list[list[str]] = []
    for line in lines[head + 1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], len(line)])]
        if cells[0] in ("static", "gpu", "serve"):
            rows.append(cells)
        elif not cells[0] and rows and line.strip():
            rows[-1] = [" ".join(filter(None, pair)) for pair in zip(rows[-1], cells)]
        else:
            break  # the end of the table
    return {(tier, check): (result, detail) for tier, check, result, detail in rows}
