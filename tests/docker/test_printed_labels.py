"""An image's labels are text nobody here wrote: `history` shows each on one line of its row."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import BASE
from tests.support.recipes import pypi_recipe

pytestmark = pytest.mark.docker

FORGED = "sparkforge-test/vllm:lab-ffffffffffff  2099-01-01 00:00:00  9.9.9  none  spark1"


def test_a_line_break_in_a_label_stays_in_its_row_in_history(tmp_path: Path, cli, base_image) -> None:
    repo = f"sparkforge-test/labels-{os.getpid()}"  # a repository of this test's own
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "lab.yaml").write_text(f"image: {repo}\n" + pypi_recipe("0.17.0"))
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(f"FROM {BASE}\n")
    tag = f"{repo}:lab-0123456789ab"
    subprocess.run(["docker", "build", "-q", "-t", tag, "--label", "io.sparkforge.variant=lab",  # a build of `lab`
                    "--label", f"io.sparkforge.mods=uf17\n{FORGED}",
                    "--label", "org.opencontainers.image.version=0.17.0\x1b[2J", str(tmp_path / "ctx")],
                   check=True, capture_output=True, timeout=300)
    try:
        proc = cli("--images", str(tmp_path / "images"), "history", "lab", check=True)
    finally:
        subprocess.run(["docker", "image", "rm", tag], capture_output=True, timeout=120)
    rows = proc.stdout.splitlines()
    assert len(rows) == 2 and rows[1].startswith("lab-0123456789ab"), proc.stdout
    assert f"uf17\\n{FORGED}" in rows[1] and "0.17.0\\x1b[2J" in rows[1] and "\x1b" not in proc.stdout
