"""Wheel sets and base sources without Docker: which wheel pip picks on a platform, uv's pylock read into a
wheel set, the lock's `wheels` section, the locked install in the Dockerfile, and `vllm.source: base`; against
the index (marked network): the shipped pypi033 lock pins the wheels PyPI serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparkforge.build.pipeline import LockPolicy, load_plan
from sparkforge.build.render import context_files
from sparkforge.inimage import record
from sparkforge.recipe import sources
from sparkforge.recipe.lockfile import lock_path, read_lock
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.plan import PythonTarget
from sparkforge.recipe.planner import plan_variant
from sparkforge.recipe.wheelset import Unresolvable, preference, read_pylock, requirements_txt, resolve_wheel_set
from tests.support.cli import run_cli
from tests.support.paths import IMAGES, ROOT, VARIANTS
from tests.support.recipes import layout

# Two entries of the pylock.toml uv 0.13.8 wrote for vllm==0.33.0 on aarch64-manylinux_2_34, Python 3.12.
PYLOCK = """\
lock-version = "1.0"
created-by = "uv"
requires-python = ">=3.12"

[[packages]]
name = "aiohttp"
version = "3.14.5"
sdist = { url = "https://files.pythonhosted.org/packages/6c/4c/bdccd81e9ee225b69c60e7766c9a5b05364f118f4d383713b89a682d772d/aiohttp-3.14.5.tar.gz", size = 8078052, hashes = { sha256 = "5558a7f5a05af9ecf744af91e5baefc436f93c9333e656c27ec253f9a6bbe178" } }
wheels = [
    { url = "https://files.pythonhosted.org/packages/68/30/173960c42b05a6c59f7558e4b12a4b0d9ba376cf6aa9bde7f9e08a30ca8d/aiohttp-3.14.5-py3-none-any.whl", size = 279517, hashes = { sha256 = "efc21a454892828368b11c2c780de0ff8bc991f73f6b99c6b66e56205470929b" } },
    { url = "https://files.pythonhosted.org/packages/22/ff/c6615806c14aab34f82b9424ccde8ce6e417315fd57ce1c5b4d4747888e1/aiohttp-3.14.5-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl", size = 1896245, hashes = { sha256 = "abfda5cb094a829f7bc25216a32f7db2e85cc65bd59910f8e7b40b3d9b224764" } },
]

[[packages]]
name = "tilelang"
version = "0.1.12"
sdist = { url = "https://files.pythonhosted.org/packages/6d/9a/5776adb5b6e03e141c8cff020e16c45b87c9b7a7a5bdfe83416d6cc23933/tilelang-0.1.12.tar.gz", size = 93565090, hashes = { sha256 = "595b39581d099a53f875bd8d553863e7e4f58998052b58764f5472cbfbb87043" } }
wheels = [{ url = "https://files.pythonhosted.org/packages/fb/a4/ff0b14d00d29fe418063cd97490f55aa9cad6f981a6fbbf29124b024637d/tilelang-0.1.12-cp38-abi3-manylinux_2_34_aarch64.whl", size = 46281933, hashes = { sha256 = "a1701eba4ad603d73f1b128b88f6a2350f1b1161729e5b2d1e540a1ec7a82d52" } }]
"""
GB10 = PythonTarget("3.12", "aarch64-manylinux_2_34")


def test_pip_prefers_the_newest_glibc_and_the_exact_python() -> None:
    order = [str(t) for t in preference(GB10)]
    at = order.index
    assert at("cp312-cp312-manylinux_2_34_aarch64") < at("cp312-cp312-manylinux_2_28_aarch64") \
        < at("cp312-cp312-manylinux2014_aarch64") < at("cp312-abi3-manylinux_2_34_aarch64") < at("py3-none-any")
    assert "cp312-cp312-manylinux_2_35_aarch64" not in order and not any("x86_64" in t for t in order)


def test_a_pylock_becomes_the_wheels_pip_may_pick_best_first() -> None:
    aiohttp, tilelang = read_pylock(PYLOCK, GB10)
    assert [f[0] for f in aiohttp.files] == [
        "aiohttp-3.14.5-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
        "aiohttp-3.14.5-py3-none-any.whl"]
    assert aiohttp.files[0][2] == 1896245 and tilelang.files[0][0].endswith("manylinux_2_34_aarch64.whl")
    text = requirements_txt((aiohttp, tilelang))
    assert text.startswith("aiohttp==3.14.5 \\\n    --hash=sha256:abfda5cb") and "5558a7f5" not in text  # no sdist


def test_a_distribution_without_a_wheel_for_the_platform_is_refused() -> None:
    """tilelang 0.1.12 has only a manylinux_2_34 aarch64 wheel: an older glibc would compile it."""
    with pytest.raises(Unresolvable, match=r"tilelang 0.1.12 has no wheel for Python 3.12 on aarch64-manylinux_2_28"):
        read_pylock(PYLOCK, PythonTarget("3.12", "aarch64-manylinux_2_28"))


def test_the_shipped_lock_gives_pypi033_its_wheel_set() -> None:
    loaded = load_plan(Layout.default(), "pypi033")
    plan = loaded.plan
    assert loaded.lock is not None and len(plan.wheel_set) == 199
    assert {p.name: p.version for p in plan.wheel_set}.items() >= {
        "vllm": "0.33.0", "torch": "2.14.0", "flashinfer-python": "0.7.2.post1", "tilelang": "0.1.12"}.items()
    for pin in plan.wheel_set:  # every file is one pip takes on a GB10 with Python 3.12
        assert all(f[0].endswith(("_aarch64.whl", "-any.whl")) for f in pin.files), pin
    assert "wheels" not in dict(plan.unpinned())
    assert "wheels" in dict(load_plan(Layout.default(), "pypi033", lock_policy=LockPolicy.IGNORE).plan.unpinned())
    files = context_files(plan, Layout.default())
    docker = files["Dockerfile"].decode()
    assert ("RUN --mount=type=bind,from=wheel-set,target=/opt/sparkforge/wheel-set \\\n    python3 -m pip install -c "
            "/opt/sparkforge/protect/constraints.txt --no-cache-dir --no-index --find-links /opt/sparkforge/wheel-set --require-hashes "
            "--only-binary :all: --no-compile -r /opt/sparkforge/lock/requirements.txt; \\\n"
            "    python3 -I -B /opt/sparkforge/inimage compile\n") in docker
    assert "vllm==0.33.0" not in docker
    reqs = files["lock/requirements.txt"].decode()
    assert ("vllm==0.33.0 \\\n    --hash=sha256:e9e404f52c8494b69bd83fe99fe7ecfa9f6b89fbd156d2a9639c24ea41d6d606\n"
            in reqs)


def test_a_recipe_whose_python_changed_is_refused_by_its_lock(tmp_path: Path, cli) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    path = images / "pypi033.yaml"
    path.write_text(path.read_text().replace("platform: aarch64-manylinux_2_34", "platform: aarch64-manylinux_2_39"))
    proc = cli("--images", str(images), "build", "pypi033", "--locked", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert ("pypi033.lock.json: python.platform: recipe says aarch64-manylinux_2_39, lock says "
            "aarch64-manylinux_2_34") in proc.stderr


@pytest.mark.parametrize("damage, field", [
    (lambda w: w.update(unresolved="both"), "wheels"),
    (lambda w: w["packages"]["vllm"]["files"][0].update(sha256="e9e4"), "wheels.packages.vllm.files[0].sha256"),
    (lambda w: w["packages"]["vllm"].update(files=[]), "wheels.packages.vllm.files"),
    (lambda w: w.update(platform="arm64"), "wheels.platform"),
])
def test_a_bad_wheels_section_is_one_line_exit_2(tmp_path: Path, cli, damage, field) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    path = lock_path(images, "pypi033")
    data = json.loads(path.read_text())
    damage(data["wheels"])
    path.write_text(json.dumps(data))
    proc = cli("--images", str(images), "show", "pypi033")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"pypi033.lock.json: {field}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("recipe, field", [
    ("vllm: {source: base, version: '0.31.0', ref: v0.31.0}\n", "vllm.ref"),
    ("vllm: {source: base, version: '0.31.0', install_deps: true}\n", "vllm.install_deps"),
    ("python: {version: '3.12', platform: aarch64-manylinux_2_34}\n", "python"),
])
def test_a_base_source_takes_only_its_version(tmp_path: Path, cli, recipe: str, field: str) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images, ignore=shutil.ignore_patterns("*.lock.json"))
    (images / "child.yaml").write_text("extends: ngc2610\n" + recipe)
    proc = cli("--images", str(images), "show", "child")
    assert proc.returncode == 2, proc.stderr
    assert f"child.yaml: {field}" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_base_source_keeps_the_bases_vllm_protected_and_checked() -> None:
    docker = context_files(plan_variant(Layout.default(), "ngc2610"), Layout.default())["Dockerfile"].decode()
    assert ("inimage protect --out /opt/sparkforge/protect torch torchvision torchaudio triton numpy vllm \\\n"
            " && python3 -I -B /opt/sparkforge/inimage base-vllm 0.31.0\n") in docker
    assert "python3 -m pip install" not in docker
    assert "--dist vllm" in docker  # its extensions are scanned as an installed vLLM's


def test_the_base_vllm_check_takes_a_local_build_of_the_release_only(monkeypatch) -> None:
    for found, problem in [("0.31.0", None), ("0.31.0+nv26.10", None), ("0.31.0rc1", "carries vllm 0.31.0rc1"),
                           ("0.30.0", "carries vllm 0.30.0, but the recipe says vllm.version 0.31.0"),
                           (None, "has no vllm installed")]:
        monkeypatch.setattr(record, "installed", lambda name, v=found: v)
        got, _ = record.base_vllm("0.31.0")
        assert (got is None) if problem is None else (problem in (got or "")), (found, got)


@pytest.mark.network
def test_the_locked_vllm_wheels_are_the_ones_pypi_serves() -> None:
    served = {name: url.partition("#sha256=")[2] for name, url in sources.project_files("vllm", refresh=True)}
    lock = read_lock(lock_path(IMAGES, "pypi033"))
    (vllm,) = [p for p in lock.wheels.pins if p.name == "vllm"]
    assert [(f[0], served[f[0]]) for f in vllm.files] == [(f[0], f[1]) for f in vllm.files]


@pytest.mark.network
def test_uv_resolves_a_wheel_set_for_another_platform_without_downloading_it() -> None:
    plan = plan_variant(layout(VARIANTS), "testvllm033")  # x86-64, Python 3.11, --no-deps
    found = resolve_wheel_set(plan)
    assert [(p.name, p.version) for p in found.packages] == [("vllm", "0.33.0")]
    name, sha, size = found.packages[0].files[0]
    assert name == "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl" and size == found.download > 300_000_000
    served = {n: url.partition("#sha256=")[2] for n, url in sources.project_files("vllm")}
    assert served[name] == sha


@pytest.mark.network
def test_check_mods_says_what_it_read_for_a_base_it_does_not_have(cli) -> None:
    proc = cli("check-mods", "ngc2610")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert "PyPI, the release the base carries; the base's own tree is not read" in text, text
    assert ROOT.exists()


def test_the_dry_run_names_the_wheel_set_folder_and_downloads_nothing(tmp_path: Path) -> None:
    proc = run_cli("build", "pypi033", "--dry-run", env={"SPARKFORGE_CACHE": str(tmp_path)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    folder = next(w.split("=", 1)[1] for w in proc.stdout.split() if w.startswith("wheel-set="))
    assert folder.startswith(str(tmp_path / "wheel-sets")) and "--build-context" in proc.stdout
    assert "a build first downloads the wheel set" in proc.stdout
    assert not (tmp_path / "wheel-sets").exists()


SIX = ("six-1.16.0-py2.py3-none-any.whl", "8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254", 11053)
IDNA = ("idna-3.7-py3-none-any.whl", "82fee1fc78add43492d3a1898bfa6d8a904cc97d8427f683ed8e798d07761aa0", 66836)


@pytest.mark.network
def test_fetch_downloads_the_locked_files_once_and_keeps_each_by_its_hash(tmp_path: Path, monkeypatch) -> None:
    """The real index, this machine's pip: the set's folder holds exactly its files; each is kept by its sha256;
    a file gone from the folder comes back from that store, without the network."""
    from dataclasses import replace

    from sparkforge.build import wheelfetch
    from sparkforge.errors import BuildError
    from sparkforge.recipe.download import cached, sha256_of
    from sparkforge.recipe.plan import WheelPin

    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "cache"))
    plan = plan_variant(Layout.default(ROOT), "pypi033")
    plan = replace(plan, wheel_set=(WheelPin("idna", "3.7", (IDNA,)), WheelPin("six", "1.16.0", (SIX,))))
    said: list[str] = []
    folder = wheelfetch.fetch(plan, say=said.append)
    assert sorted(p.name for p in folder.iterdir()) == [IDNA[0], SIX[0]]
    assert all(cached(sha, name).stat().st_size == size for name, sha, size in (SIX, IDNA))
    assert said[0].startswith("wheel set: 2 wheels, 0.00 GB; 0 already here")
    assert wheelfetch.fetch(plan, say=said.append) == folder and len(said) == 2  # whole: nothing to do, nothing said
    bad = replace(plan, wheel_set=(WheelPin("six", "1.16.0", ((SIX[0], "0" * 64, SIX[2]),)),))
    with pytest.raises(BuildError, match=f"failed: six==1.16.0: the index's file has sha256 {SIX[1]}, the lock says {'0' * 64}"):
        wheelfetch.fetch(bad)
    assert not [p for p in (tmp_path / "cache" / "wheel-sets").iterdir() if p.name.startswith(".")]  # no half set
    (folder / SIX[0]).unlink()
    monkeypatch.setattr(wheelfetch, "index_url", lambda: "http://127.0.0.1:9/simple")  # the files come from the store
    assert wheelfetch.fetch(plan, say=said.append) == folder and said[-1].endswith("; all 2 already here")
    assert sorted(p.name for p in folder.iterdir()) == [IDNA[0], SIX[0]]
    monkeypatch.undo()
    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "cache"))
    cached(SIX[1], SIX[0]).write_bytes(b"x" * SIX[2])  # the same size, other bytes: only its hash tells
    assert wheelfetch.fetch(plan, say=said.append) == folder and "1 already here" in said[-2]
    assert sha256_of(cached(SIX[1], SIX[0])) == SIX[1] == sha256_of(folder / SIX[0])
