"""A variant with a mod whose patch is fetched by URL builds, passes the static tier, and records the URL.

The test variant (real vLLM 0.17.0 wheel, the real install-phase mods) plus one mod whose patch is
a real upstream change (tests/upstream.py: one file's diff from vLLM 0.17.0 to 0.18.1), served over
HTTPS on loopback with a test CA. The build gets the system bundle plus that CA as --ca-cert, and
reuses the cached layers of the other testvllm builds up to the new mod.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support import fileserver
from tests.support import upstream
from tests.support.docker import BASE, VARIANTS
from tests.support.paths import MODS

pytestmark = [pytest.mark.docker, pytest.mark.network]

MOD = "colpali-template"
CHILD = """\
# Covers: a mod whose patch is named by URL (an upstream change), built into the test variant.
extends: testvllm
description: vLLM 0.17.0 test variant with an upstream patch fetched by URL
mods: {add: [colpali-template]}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    diff = upstream.release_diff()
    srv = fileserver.start(tmp_path_factory.mktemp("certs"))
    url = srv.put("/vllm/colpali.diff", diff)
    yield srv, url, diff
    srv.stop()


def run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return run_cli(*args, env={"SPARKFORGE_CACHE": str(cache)})


def test_url_mod_builds_and_records_its_source(base_image: str, served, tmp_path: Path) -> None:
    srv, url, diff = served
    images, mods = tmp_path / "images", tmp_path / "mods"
    images.mkdir()
    shutil.copy(VARIANTS / "testvllm.yaml", images / "testvllm.yaml")
    (images / "testvllm-url.yaml").write_text(CHILD)
    for name in ("uf17-eager-allreduce", "fix-qwen35-tp4-marlin", "serve-torchrun"):
        shutil.copytree(MODS / name, mods / name)
    (mods / MOD).mkdir()
    (mods / MOD / "mod.yaml").write_text(upstream.mod_yaml(MOD, url=url, digest=upstream.sha256(diff),
                                                           versions=">=0.17.0,<0.18.1"))
    bundle = fileserver.bundle(srv.ca, tmp_path / "ca-bundle.crt")
    common = ("--images", str(images), "--mods", str(mods))

    proc = run(*common, "build", "testvllm-url", "--base", BASE, "--ca-cert", str(bundle), cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert srv.requests["/vllm/colpali.diff"] == 1
    static = " ".join(proc.stdout.split())
    assert f"mod {MOD} recorded ok applied" in static
    assert re.search(rf"mod {MOD}: {re.escape(upstream.FILE)} contains \S.*? ok ", static), static

    plan = json.loads(run(*common, "show", "testvllm-url", "--base", BASE, "--json", cache=tmp_path / "cache").stdout)
    pinned = {"url": url, "pr": None, "sha256": upstream.sha256(diff)}  # the record keeps the seam's PatchPin: no PR here
    record = json.loads(subprocess.run(["docker", "run", "--rm", plan["tag"], "cat",
                                        "/opt/sparkforge/build-record.json"], capture_output=True, text=True,
                                       check=True).stdout)
    (entry,) = [m for m in record["mods"] if m["name"] == MOD]
    assert entry["result"] == "applied" and entry["patch"] == pinned
    assert entry["digest"] == next(m["digest"] for m in plan["mods"] if m["name"] == MOD)
    added = subprocess.run(["docker", "run", "--rm", plan["tag"], "python3", "-c",
                            "import importlib.util, pathlib; root = importlib.util.find_spec('vllm')"
                            ".submodule_search_locations[0]; "
                            f"print(pathlib.Path(root).parent.joinpath({upstream.FILE!r}).read_text())"],
                           capture_output=True, text=True, check=True).stdout
    assert upstream.ADDED in added  # the installed 0.17.0 file now holds the upstream line
    shown = run(*common, "inspect", plan["tag"], cache=tmp_path / "cache")
    assert f"-> applied; patch {url} sha256 {upstream.sha256(diff)[:12]}" in shown.stdout, shown.stdout + shown.stderr
