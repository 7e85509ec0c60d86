"""Real locks and rebuilds: lock against a real local registry, build --locked, refuse an edited recipe, verify-repro on a containerd-store dockerd, diff two builds."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import run_cli as sparkforge
from tests.support.docker import BASE, CA, VARIANTS, build_args, image_id
from tests.support.needs import require
from tests.support.paths import TEST_MODS

from sparkforge.build.pipeline import LockPolicy, load_plan
from sparkforge.recipe.layout import Layout

pytestmark = [pytest.mark.docker, pytest.mark.network]

LOCKED = "testsmall"
MANIFEST_ACCEPT = ", ".join([
    "application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"])


@pytest.fixture(scope="module")
def pushed_base(registry, base_image: str) -> Iterator[str]:
    """The local base, pushed to the module's real registry; returns REPOSITORY (tag bookworm). The tag it made on
    the head goes with the module (the registry's port is new each run)."""
    repo = f"{registry.address}/sparkforge/base-local"
    subprocess.run(["docker", "tag", base_image, f"{repo}:bookworm"], check=True)
    try:
        proc = subprocess.run(["docker", "push", f"{repo}:bookworm"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield repo
    finally:
        subprocess.run(["docker", "image", "rm", "--no-prune", f"{repo}:bookworm"], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def lock_images(pushed_base: str, tmp_path_factory) -> Path:
    """A recipe folder with the small test variant (vLLM 0.2.7's wheel and a test mod: a lock and a locked build
    of the 1.6 GB testvllm took about 25 minutes on 2 busy cores, for the same proof) whose base is the
    registry's copy, digest left to `lock`."""
    images = tmp_path_factory.mktemp("lock") / "images"
    images.mkdir()
    text = (VARIANTS / f"{LOCKED}.yaml").read_text()
    text = text.replace("repository: nvcr.io/nvidia/pytorch", f"repository: {pushed_base}")
    text = text.replace("tag: 26.01-py3", "tag: bookworm")
    (images / f"{LOCKED}.yaml").write_text(text)
    return images


def _registry_digest(repo: str, tag: str) -> str:
    host, _, name = repo.partition("/")
    req = urllib.request.Request(f"http://{host}/v2/{name}/manifests/{tag}", method="HEAD",
                                 headers={"Accept": MANIFEST_ACCEPT})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers["Docker-Content-Digest"]


@pytest.fixture(scope="module")
def locked(lock_images: Path, pushed_base: str) -> dict:
    proc = sparkforge("--images", str(lock_images), "--mods", str(TEST_MODS), "lock", LOCKED, "--ca-cert", CA)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((lock_images / f"{LOCKED}.lock.json").read_text())


def test_lock_asks_the_registry_and_records_a_real_build(locked: dict, pushed_base: str) -> None:
    assert locked["base"] == {"repository": pushed_base, "tag": "bookworm",
                              "digest": _registry_digest(pushed_base, "bookworm")}
    assert locked["packages"]["vllm"] == "0.2.7"
    assert {"pip", "setuptools", "wheel"} <= set(locked["packages"])
    assert [m["name"] for m in locked["mods"]] == ["repro-stamp"]
    assert all(m["digest"].startswith("sha256:") for m in locked["mods"])
    assert locked["source_date_epoch"] >= 315532800
    assert locked["built_from"]["image_id"].startswith("sha256:")
    # lock read the record of its build and left no image behind, under its candidate tag or any other
    candidate = f"sparkforge-test/vllm:{LOCKED}-{locked['built_from']['plan_hash'][:12]}-candidate"
    for ref in (candidate, locked["built_from"]["image_id"]):
        assert subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=60).returncode == 1


def test_build_locked_uses_the_digest_the_constraints_and_the_epoch(locked: dict, lock_images: Path) -> None:
    proc = sparkforge("--images", str(lock_images), "--mods", str(TEST_MODS), "build", LOCKED, "--locked",
                      "--ca-cert", CA, "--no-smoke")  # 0.2.7 has no `vllm` command
    assert proc.returncode == 0, proc.stdout + proc.stderr
    show = json.loads(sparkforge("--images", str(lock_images), "--mods", str(TEST_MODS), "show", LOCKED,
                                 "--json").stdout)
    tag = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("building "))
    assert tag == show["tag"]  # every command applies the lock that agrees with the recipe
    bare = load_plan(Layout.default(images_dir=lock_images, mods_dir=TEST_MODS), LOCKED,
                     lock_policy=LockPolicy.IGNORE).plan
    assert tag != bare.tag  # the locked plan is another plan than the bare recipe
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", tag],
                                       capture_output=True, text=True, check=True).stdout)
    assert labels["org.opencontainers.image.base.digest"] == locked["base"]["digest"]
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", tag, "-c",
                          "cat /opt/sparkforge/lock/constraints.txt; python3 -c 'import json; "
                          "r=json.load(open(\"/opt/sparkforge/build-record.json\")); print(r[\"built_at\"])'"],
                         capture_output=True, text=True, check=True).stdout
    assert "vllm==0.2.7\n" in out
    assert out.strip().endswith("T00:00:00Z")  # the lock's SOURCE_DATE_EPOCH is a midnight


def test_build_locked_refuses_a_recipe_edited_after_locking(locked: dict, lock_images: Path) -> None:
    recipe = lock_images / f"{LOCKED}.yaml"
    original = recipe.read_text()
    mods = ("--images", str(lock_images), "--mods", str(TEST_MODS))
    try:
        recipe.write_text(original.replace("mods:\n  - repro-stamp", "mods: []\n#"))
        proc = sparkforge(*mods, "build", LOCKED, "--locked", "--ca-cert", CA)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert f"{LOCKED}.lock.json: mods: recipe says " in proc.stderr and "lock says [repro-stamp]" in proc.stderr
        assert "building" not in proc.stdout  # refused before Docker
        # (the mod too: it targets 0.2.7 only, which the recipe check would say first)
        recipe.write_text(original.replace('version: "0.2.7"', 'version: "0.2.8"')
                          .replace("mods:\n  - repro-stamp", "mods: []\n#"))
        proc = sparkforge(*mods, "build", LOCKED, "--locked")
        assert proc.returncode == 2
        assert "vllm.version: recipe says 0.2.8, lock says 0.2.7" in proc.stderr
    finally:
        recipe.write_text(original)


@pytest.fixture(scope="module")
def classic_node():
    """One extra real dockerd on the classic image store (tests/infra/nodes.py): the head is on the containerd
    store, as a new Docker 29 install is, so the refusal needs an engine of its own."""
    require("dockerd")
    from tests.infra.nodes import CLASSIC, start_nodes, stop_nodes

    base = tempfile.mkdtemp(prefix="sfr-", dir="/tmp")  # short: unix socket paths max 107 bytes
    started = start_nodes(1, base, daemon_config=CLASSIC, prefix="cls")
    yield started[0]
    try:
        stop_nodes(started)
    finally:
        for node in started:
            node.destroy()
        shutil.rmtree(base, ignore_errors=True)


def test_verify_repro_refuses_the_classic_store_in_one_line(classic_node, base_image: str) -> None:
    proc = sparkforge("--images", str(VARIANTS), "--mods", str(TEST_MODS), "verify-repro", "testsmall", "--base", BASE,
                      "--builder-host", classic_node.endpoint)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "classic store" in proc.stderr and "--builder-host" in proc.stderr
    assert classic_node.endpoint in proc.stderr  # it names the engine it asked


def test_verify_repro_gives_identical_digests(base_image: str) -> None:
    # On the head (the containerd store, as the users' engine). A small release wheel
    # (tests/variants/testsmall.yaml): two --no-cache builds of testvllm and their uncompressed exports took
    # about 10 GB of disk and 5 minutes here, for the same proof.
    proc = sparkforge("--images", str(VARIANTS), "--mods", str(TEST_MODS), "verify-repro", "testsmall", "--base",
                      BASE, "--ca-cert", CA)
    print(proc.stdout)  # the two digests, for the CI log
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("build ")]
    assert len(lines) == 2
    assert lines[0].split()[3] == lines[1].split()[3]  # manifest digests
    assert lines[0].split()[6] == lines[1].split()[6]  # image IDs
    assert "identical: both builds give manifest sha256:" in proc.stdout


def test_diff_of_two_builds_that_differ_by_one_mod(test_image, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    text = (VARIANTS / "testvllm.yaml").read_text().replace("  - fix-qwen35-tp4-marlin\n", "")
    # A name of its own: a build named testvllm would move the moving tag the build tests check.
    (images / "testvllm-nofix.yaml").write_text(text)
    proc = sparkforge(*build_args("testvllm-nofix", images=images))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    other = json.loads(sparkforge("--images", str(images), "show", "testvllm-nofix", "--base", BASE,
                                  "--json").stdout)["tag"]
    assert image_id(other) and image_id(other) != test_image.image_id
    proc = sparkforge("diff", test_image.tag, other)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "  mods        - fix-qwen35-tp4-marlin sha256:" in out
    for section in ("base", "vllm", "components"):
        assert f"  {section:<11} same: " in out
    assert "  packages    same: " in out
    assert out.rstrip().endswith("1 change")
