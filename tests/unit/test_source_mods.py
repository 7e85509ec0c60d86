"""check-mods verifies a source-phase mod against the whole source tree, also outside the vllm/ package."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.paths import IMAGES, MODS, TEST_MODS


@pytest.mark.network  # a real vLLM release from the package index
def test_source_mod_touching_setup_py_is_verified(cli, tmp_path: Path) -> None:
    images, mods = tmp_path / "images", tmp_path / "mods"
    images.mkdir()
    shutil.copytree(MODS, mods)
    shutil.copytree(TEST_MODS / "probe-source-mark", mods / "probe-source-mark")
    # ng17's pin (v0.17.0's commit) with the test source mod first: checked against the 0.17.0 sdist.
    (images / "ng17.yaml").write_text((IMAGES / "ng17.yaml").read_text())
    (images / "probe.yaml").write_text("extends: ng17\nmods:\n  - probe-source-mark\n  - uf17-eager-allreduce\n")
    proc = cli("--images", str(images), "--mods", str(mods), "check-mods", "probe", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "probe-source-mark" in line)
    assert " applied " in row and "vllm 0.17.0 (PyPI" in row
