"""Lock files without Docker: recipe-versus-lock checks, locked plans, bad locks, registry digests, diff, outdated, repro tarballs."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import shutil
import tarfile
import struct
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkforge.errors import ConfigError
from sparkforge.repro.diff import diff, diff_snapshots, from_plan
from sparkforge.recipe.lock import apply_lock, compare, lost_pins, make_lock
from sparkforge.recipe.lockfile import MAX_EPOCH, MIN_EPOCH, LockedWheels, Pinned, Unresolved, lock_path, read_lock, \
    write_lock
from sparkforge.recipe.plan import PythonTarget, WheelPin
from sparkforge.repro.outdated import check_components, newer_releases
from sparkforge.recipe.sources import SourceUnavailable
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from sparkforge.build.render import context_files
from sparkforge.recipe.resolve import NotFound, Unreachable, registry_digest, split_repository
from sparkforge.registry import MANIFEST_TYPES
from sparkforge.repro.repro import compare as compare_images
from sparkforge.repro.repro import read_digests
from tests.support import gitserver
from tests.support.cli import BUILD, assert_one_line, run_cli
from tests.support.paths import MODS, ROOT, TEST_MODS, VARIANTS
from tests.support.recipes import layout, unlocked_images

DIGEST = "sha256:" + "ab" * 32
PACKAGES = {"vllm": "0.17.0", "pip": "23.0.1", "Setuptools": "66.1.1", "python-apt": "2.6.0+nmu1~weird"}


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return unlocked_images(tmp_path / "images")


def _with(model, **changes):
    """A copy of a lock's model with some fields changed (the models are frozen)."""
    return model.model_copy(update=changes)


def locked(images: Path, variant: str = "ng17e", packages: dict | None = PACKAGES):
    plan = plan_variant(layout(images), variant)
    lock = make_lock(plan, {"base.digest": Pinned(DIGEST)}, 1767225600, packages=packages,
                     packages_unresolved=None if packages is not None else "no build here")
    write_lock(lock_path(images, variant), lock)
    return plan, lock


def edit(images: Path, variant: str, old: str, new: str) -> None:
    path = images / f"{variant}.yaml"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def test_a_fresh_lock_agrees_and_round_trips(images: Path) -> None:
    plan, lock = locked(images)
    again = read_lock(lock_path(images, "ng17e"))
    assert again == lock
    assert compare(plan, again) == []
    # ray has no version in the recipe: the lock pins what the build installed, or says why not
    ray = lock.components["ray"]
    assert ray.version == Pinned(None, "the build did not install ray[default]")


@pytest.mark.parametrize("why", ["offline", "no build here", "1.0"])
def test_unresolved_packages_read_back_as_unresolved_whatever_the_reason(images: Path, why: str) -> None:
    """{"unresolved": WHY} is the reason the packages are not known, even where WHY could be read as a version."""
    _, lock = locked(images, packages=None)
    path = lock_path(images, "ng17e")
    write_lock(path, lock.model_copy(update={"packages": Unresolved(unresolved=why)}))
    again = read_lock(path)
    assert (again.packages_unresolved, again.installed) == (why, ())
    assert json.loads(path.read_text())["packages"] == {"unresolved": why}


def test_a_lock_names_the_field_the_recipe_changed(images: Path) -> None:
    plan, lock = locked(images)
    edit(images, "ng17e", "version: 0.6.6", "version: 0.6.7")
    edit(images, "ng17", "  - serve-torchrun\n", "")
    diffs = compare(plan_variant(layout(images), "ng17e"), lock)
    assert [(d.field, d.recipe, d.lock) for d in diffs] == [
        ("components.flashinfer.version", "0.6.7", "0.6.6"),
        ("mods", "[marlin-sm12x-fp8, mtp-nvfp4-exclusion, uf17-eager-allreduce, fix-qwen35-tp4-marlin]",
         "[marlin-sm12x-fp8, mtp-nvfp4-exclusion, uf17-eager-allreduce, fix-qwen35-tp4-marlin, serve-torchrun]"),
    ]


def test_a_changed_mod_is_named_by_its_digest(images: Path, tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    shutil.copytree(MODS, mods)
    lay = Layout.default(ROOT, images_dir=images, mods_dir=mods)
    lock = make_lock(plan_variant(lay, "ng17"), {}, 1767225600, packages=None, packages_unresolved="x")
    (mods / "serve-torchrun" / "NOTE").write_text("changed\n")
    (d,) = compare(plan_variant(lay, "ng17"), lock)
    assert d.field == "mods.serve-torchrun.digest" and d.recipe != d.lock


def test_a_pin_the_recipe_leaves_open_is_the_locks_to_fill(images: Path) -> None:
    plan, lock = locked(images)
    assert plan.base.digest.value is None
    assert compare(plan, lock) == []
    # but a digest the recipe pins must be the lock's
    edit(images, "ng17", "  digest:\n    unknown: the NGC registry is not reachable from where this recipe was "
         "written; `lock` resolves it\n", f"  digest: sha256:{'cd' * 32}\n")
    (d,) = compare(plan_variant(layout(images), "ng17e"), lock)
    assert (d.field, d.recipe, d.lock) == ("base.digest", f"sha256:{'cd' * 32}", DIGEST)


def test_the_locked_plan_pins_base_packages_and_epoch(images: Path) -> None:
    plan, lock = locked(images, "ng17")
    lp = apply_lock(plan, lock)
    assert lp.base.ref == f"nvcr.io/nvidia/vllm:26.02-py3@{DIGEST}"
    assert lp.source_date_epoch == 1767225600
    assert dict(lp.pins) == {"pip": "23.0.1", "setuptools": "66.1.1", "vllm": "0.17.0"}  # no unparsable version
    assert lp.tag != plan.tag and lp.plan_hash != plan.plan_hash
    files = context_files(lp, layout(images))
    assert files["lock/constraints.txt"] == b"pip==23.0.1\nsetuptools==66.1.1\nvllm==0.17.0\n"
    dockerfile = files["Dockerfile"].decode()
    assert f"ARG BASE_IMAGE=nvcr.io/nvidia/vllm:26.02-py3@{DIGEST}" in dockerfile
    runtime = dockerfile[dockerfile.index("AS runtime"):]
    uses = runtime.count("-c /opt/sparkforge/protect/constraints.txt")
    assert uses == runtime.count("-c /opt/sparkforge/protect/constraints.txt -c /opt/sparkforge/lock/constraints.txt")
    assert uses == 1  # the vLLM wheel, in the runtime stage
    # The compile's build tools are not the runtime's packages: only the base's builds constrain them.
    build_stage = dockerfile[dockerfile.index("AS vllm-build"):dockerfile.index("AS runtime")]
    assert '-c /opt/sparkforge/protect/constraints.txt -r "$build_reqs"' in build_stage
    assert "lock/constraints.txt" not in build_stage
    assert dockerfile.count("COPY lock/constraints.txt /opt/sparkforge/lock/constraints.txt") == 1
    assert "lock/constraints.txt" not in context_files(plan, layout(images))


def test_build_locked_refuses_an_edited_recipe_before_docker(images: Path, cli) -> None:
    locked(images, "ng17")
    edit(images, "ng17", "ref: v0.17.0", "ref: v0.17.1")
    proc = cli("--images", str(images), "build", "ng17", "--locked")
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("error: ") and "ng17.lock.json: vllm.ref: recipe says v0.17.1, lock says v0.17.0" in line


def test_a_recipe_moved_to_a_fork_at_the_same_ref_is_not_built_from_the_locked_commit(images: Path, cli) -> None:
    """The lock names the repository its vLLM commit came from: a fork at the same ref is another source, and an
    older lock that names none is refused with its own reason."""
    plan, lock = locked(images, "ng17")
    assert lock.vllm.repo == "https://github.com/vllm-project/vllm.git" and compare(plan, lock) == []
    upstream, fork_url = "https://github.com/vllm-project/vllm.git", "https://git.example/someone/vllm.git"
    edit(images, "ng17", f"  repo: {upstream}", f"  repo: {fork_url}")
    assert_one_line(cli("--images", str(images), "build", "ng17", "--locked"),
                    "ng17.lock.json: vllm.repo: recipe says https://git.example/someone/vllm.git, lock says "
                    "https://github.com/vllm-project/vllm.git; the recipe changed after it was locked")
    fork = plan_variant(layout(images), "ng17")
    unanswered = make_lock(fork, {"vllm.commit": Pinned(None, "no answer")}, 1767225600, packages=None,
                           packages_unresolved="x")
    assert ("vllm.commit", lock.vllm.commit.value) not in lost_pins(lock, unanswered)  # not the fork's to keep
    same = make_lock(plan, {"vllm.commit": Pinned(None, "no answer")}, 1767225600, packages=None,
                     packages_unresolved="x")
    older = _with(lock, vllm=_with(lock.vllm, repo=None))  # a lock made before locks named the repository
    assert ("vllm.commit", lock.vllm.commit.value) in lost_pins(older, same)  # kept: relocking is refused

    edit(images, "ng17", f"  repo: {fork_url}", f"  repo: {upstream}")
    path = lock_path(images, "ng17")
    raw = json.loads(path.read_text())
    del raw["vllm"]["repo"]  # as a lock made before locks named it
    path.write_text(json.dumps(raw))
    older = ("vllm.repo: recipe says https://github.com/vllm-project/vllm.git, lock says nothing (the lock was made "
             "before locks named vLLM's repository)")
    assert "recipe changed" not in assert_one_line(cli("--images", str(images), "build", "ng17", "--locked"),
                                                   older, "lock it again with")
    shown = cli("--images", str(images), "show", "ng17")  # without --locked: not applied, and the warning says why
    assert shown.returncode == 0 and f"warning: ng17.lock.json not used: {older}" in shown.stderr, shown.stderr


def test_a_base_given_on_the_command_line_is_named_as_the_difference_not_the_recipe(images: Path, cli) -> None:
    locked(images, "ng17")
    other = "127.0.0.1:9/someone/base:1"
    shown = cli("--images", str(images), "show", "ng17", "--base", other)
    assert shown.returncode == 0, shown.stderr
    assert ("warning: ng17.lock.json not used: base.repository: --base says 127.0.0.1:9/someone/base, lock says "
            "nvcr.io/nvidia/vllm (lock again with the same option to use a lock)") in shown.stderr, shown.stderr
    line = assert_one_line(cli("--images", str(images), "build", "ng17", "--locked", "--base", other),
                           "ng17.lock.json: base.repository: --base says 127.0.0.1:9/someone/base")
    assert "recipe changed" not in line


def test_build_locked_without_a_lock_is_refused(images: Path, cli) -> None:
    proc = cli("--images", str(images), "build", "ng16", "--locked")
    assert proc.returncode == 2
    assert f"ng16.lock.json: --locked: no lock file; write one with `{BUILD} --images {images} lock ng16`" in proc.stderr


@pytest.mark.parametrize("damage, field", [
    (lambda d: d.update(source_date_epoch="1704067200"), "source_date_epoch"),
    (lambda d: d["base"].update(digest="sha256:short"), "base.digest"),
    (lambda d: d["mods"][0].pop("digest"), "mods[0].digest"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d["components"]["flashinfer"].update(version={"unknown": "x"}), "components.flashinfer.version"),
    (lambda d: d["packages"].update({"bad name!": "1"}), "packages"),
    (lambda d: d["packages"].update({"VLLM": "0.17.0"}), "packages: 'vllm' and 'VLLM' name one package"),
    (lambda d: d["packages"].update({"pip": "23.0.1\n"}), "packages"),
    (lambda d: d["packages"].update({"unresolved": "offline"}), "packages: give the installed packages or"),
    (lambda d: d.update(source_date_epoch=10 ** 30), "source_date_epoch"),
    (lambda d: d.update(source_date_epoch=MAX_EPOCH + 1), "source_date_epoch"),
    (lambda d: d.update(source_date_epoch=True), "source_date_epoch"),
    (lambda d: d.update(built_from={"image_id": DIGEST, "plan_hash": "not a hash"}), "built_from.plan_hash"),
])
def test_a_bad_lock_file_is_one_line_exit_2(images: Path, cli, damage, field) -> None:
    locked(images)
    path = lock_path(images, "ng17e")
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))
    proc = cli("--images", str(images), "build", "ng17e", "--locked")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"ng17e.lock.json: {field}" in proc.stderr


@given(st.one_of(st.integers(MIN_EPOCH - 10 ** 6, MIN_EPOCH + 10 ** 6), st.integers(MAX_EPOCH - 10 ** 6, MAX_EPOCH + 10 ** 6),
                 st.integers(-(10 ** 30), 10 ** 30)))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_an_epoch_is_taken_exactly_when_a_wheel_can_store_it(images: Path, epoch: int) -> None:
    """The bound is the zip format's: every file of a wheel built with SOURCE_DATE_EPOCH gets that time, and
    a zip's MS-DOS date holds the years 1980 to 2107."""
    path = lock_path(images, "ng17e")
    if not path.exists():
        locked(images)
    data = json.loads(path.read_text())
    data["source_date_epoch"] = epoch
    path.write_text(json.dumps(data))
    try:
        stamp = time.gmtime(epoch)[:6]
        zipfile.ZipFile(io.BytesIO(), "w").writestr(zipfile.ZipInfo("x", stamp), b"x")
        storable = True
    except (ValueError, OverflowError, OSError, struct.error):
        storable = False
    if storable:
        assert read_lock(path).source_date_epoch == epoch
    else:
        with pytest.raises(ConfigError, match="source_date_epoch"):
            read_lock(path)


def test_malformed_json_names_line_and_column(images: Path, cli) -> None:
    lock_path(images, "ng17").write_text('{"sparkforge_lock": 1,\n  "variant": }\n')
    proc = cli("--images", str(images), "diff", "ng17", "ng17e")
    assert proc.returncode == 2
    assert "ng17.lock.json: malformed lock file: line 2, column 14" in proc.stderr


# ------------------------------------------------------------------ diff


def test_diff_between_variants_lists_exactly_the_changes(images: Path) -> None:
    d = diff("ng17", "ng17e", layout(images))
    assert [(c.section, c.kind, c.name) for c in d.changes] == [
        ("vllm", "changed", "vllm"), ("components", "added", "flashinfer"), ("components", "added", "ray")]
    assert d.changes[0].old == "0.17.0 (git v0.17.0 @ b31e9326a7d9)"
    assert d.changes[0].new == "0.17.1rc1.dev158 (git 600a039f5 @ 600a039f572a)"


def test_diff_of_packages_added_removed_changed(images: Path) -> None:
    a = from_plan(plan_variant(layout(images), "ng17"))
    a = replace(a, packages=(("numpy", "2.1.0"), ("ray", "2.40.0"), ("torch", "2.11.0")))
    b = replace(a, packages=(("flashinfer-python", "0.6.6"), ("numpy", "2.1.0"), ("torch", "2.11.1")))
    d = diff_snapshots(a, b)
    assert [c.line() for c in d.in_section("packages")] == [
        "+ flashinfer-python 0.6.6", "- ray 2.40.0", "~ torch: 2.11.0 -> 2.11.1"]


def test_diff_between_locks_and_cli(images: Path, cli) -> None:
    locked(images, "ng17", {"vllm": "0.17.0", "numpy": "2.1.0"})
    locked(images, "ng17e", {"vllm": "0.17.1rc1.dev158", "numpy": "2.1.0", "flashinfer-python": "0.6.6"})
    proc = cli("--images", str(images), "diff", str(lock_path(images, "ng17")), str(lock_path(images, "ng17e")))
    assert proc.returncode == 0, proc.stderr
    assert "+ flashinfer-python 0.6.6" in proc.stdout
    assert "~ vllm: 0.17.0 -> 0.17.1rc1.dev158" in proc.stdout
    assert ("mods        same: marlin-sm12x-fp8, mtp-nvfp4-exclusion, uf17-eager-allreduce, fix-qwen35-tp4-marlin, "
            "serve-torchrun") in proc.stdout
    # A lock of a fork at the same ref and commit is not the same vLLM.
    fork = images / "fork.lock.json"
    raw = json.loads(lock_path(images, "ng17").read_text())
    raw["vllm"]["repo"] = "https://git.example/someone/vllm.git"
    fork.write_text(json.dumps(raw))
    proc = cli("--images", str(images), "diff", str(lock_path(images, "ng17")), str(fork))
    assert proc.returncode == 0, proc.stderr
    assert "~ repo: https://github.com/vllm-project/vllm.git -> https://git.example/someone/vllm.git" in proc.stdout


# ------------------------------------------------------------------ registry digest, with the token flow


class _Registry(http.server.BaseHTTPRequestHandler):
    manifest = b'{"schemaVersion": 2}'
    seen: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/token"):
            body = json.dumps({"token": "t0k"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.do_HEAD()

    def do_HEAD(self) -> None:
        type(self).seen.append({"path": self.path, "accept": self.headers.get("Accept"),
                                "auth": self.headers.get("Authorization")})
        if self.headers.get("Authorization") != "Bearer t0k":
            host = f"127.0.0.1:{self.server.server_address[1]}"
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="http://{host}/token",service="reg",'
                             'scope="repository:team/base:pull"')
            self.end_headers()
            return
        if self.path != "/v2/team/base/manifests/1.0":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", MANIFEST_TYPES[0])
        self.send_header("Content-Length", str(len(self.manifest)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(self.manifest)


def test_registry_digest_follows_the_token_flow_and_asks_for_indexes() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        digest = registry_digest(f"127.0.0.1:{port}/team/base", "1.0")
        assert digest == "sha256:" + hashlib.sha256(_Registry.manifest).hexdigest()  # no header: hashed body
        assert _Registry.seen[0]["auth"] is None and _Registry.seen[-1]["auth"] == "Bearer t0k"
        assert "application/vnd.oci.image.index.v1+json" in _Registry.seen[0]["accept"]
        assert "application/vnd.docker.distribution.manifest.v2+json" in _Registry.seen[0]["accept"]
        with pytest.raises(Unreachable) as err:
            registry_digest(f"127.0.0.1:{port}/team/base", "2.0")
        assert type(err.value) is NotFound and str(err.value) == f"127.0.0.1:{port} has no team/base:2.0"
    finally:
        server.shutdown()


def test_repository_names_split_like_docker() -> None:
    assert split_repository("nvcr.io/nvidia/vllm") == ("nvcr.io", "nvidia/vllm")
    assert split_repository("127.0.0.1:5000/sparkforge/base") == ("127.0.0.1:5000", "sparkforge/base")
    assert split_repository("sparkforge/base-local") == ("registry-1.docker.io", "sparkforge/base-local")
    assert split_repository("debian") == ("registry-1.docker.io", "library/debian")


# ------------------------------------------------------------------ outdated


def test_outdated_lists_newer_final_releases(images: Path) -> None:
    releases = {"vllm": ["0.16.0", "0.17.0", "0.17.1", "0.18.0"], "flashinfer-python": ["0.6.6", "0.7.0"],
                "ray": ["2.40.0", "2.41.0"]}
    assert newer_releases("vllm", "0.17.1rc1.dev158", releases.__getitem__) == ("0.17.1", "0.18.0")
    comps = {c.component: c for c in check_components(plan_variant(layout(images), "ng17e"), releases.__getitem__)}
    assert comps["vllm"].newer == ("0.17.1", "0.18.0")
    assert comps["flashinfer"].newer == ("0.7.0",) and comps["flashinfer"].newest == "0.7.0"
    assert comps["ray"].pinned == "UNPINNED" and comps["ray"].newer == ("2.40.0", "2.41.0")
    assert comps["cutlass"].newer == () and comps["cutlass"].note.startswith("not checked")
    # What the table says: a component whose releases were not read is "not checked", never "up to date".
    assert [comps[c].verdict for c in ("vllm", "flashinfer", "cutlass")] == ["0.17.1, 0.18.0", "0.7.0", "not checked"]
    none_newer = check_components(plan_variant(layout(images), "ng17e"), lambda project: [])
    assert {c.component: c.verdict for c in none_newer}["vllm"] == "up to date"

    def unreachable(project: str) -> list[str]:
        raise SourceUnavailable(f"cannot fetch https://pypi.org/simple/{project}/")

    down = check_components(plan_variant(layout(images), "ng17e"), unreachable)
    assert {c.component: c.verdict for c in down} == {c.component: "not checked" for c in down}


# ------------------------------------------------------------------ repro: naming what differs


def _oci_tar(path: Path, files: dict[str, bytes], created: str) -> None:
    """A minimal single-image OCI tarball, as buildx exports it, with one fixed and one varying layer."""
    blobs: dict[str, bytes] = {}

    def add(body: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        blobs[digest] = body
        return digest

    def layer(entries: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, body in entries.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(body), 1704067200
                tf.addfile(info, io.BytesIO(body))
        return buf.getvalue()

    layers = [add(layer({"etc/fixed": b"same"})), add(layer(files))]
    config = add(json.dumps({"created": created, "history": [{"created_by": "COPY fixed"},
                                                             {"created_by": "RUN /bin/bash -euo pipefail -c pip"}]}).encode())
    manifest = add(json.dumps({"config": {"digest": config}, "layers": [{"digest": d} for d in layers]}).encode())
    index = json.dumps({"manifests": [{"digest": manifest}]}).encode()
    with tarfile.open(path, "w") as tf:
        for name, body in [("index.json", index)] + [(f"blobs/{d.replace(':', '/')}", b) for d, b in blobs.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))


def test_repro_names_the_layer_and_the_files_that_differ(tmp_path: Path) -> None:
    _oci_tar(tmp_path / "1.tar", {"a.pyc": b"x1", "same.py": b"s", "gone": b"g"}, "2024-01-01T00:00:00Z")
    _oci_tar(tmp_path / "2.tar", {"a.pyc": b"x2", "same.py": b"s", "new": b"n"}, "2024-01-02T00:00:00Z")
    first, second = read_digests(tmp_path / "1.tar"), read_digests(tmp_path / "2.tar")
    assert first.manifest != second.manifest and first.layers[0] == second.layers[0]
    cfg, layers = compare_images(first, second)
    assert cfg == ("created",)
    (layer,) = layers
    assert layer.index == 2 and layer.step == "pip"
    assert [(f.path, f.what) for f in layer.files] == [
        ("a.pyc", ("content",)), ("gone", ("only in build 1",)), ("new", ("only in build 2",))]
    _oci_tar(tmp_path / "3.tar", {"a.pyc": b"x1", "same.py": b"s", "gone": b"g"}, "2024-01-01T00:00:00Z")
    assert read_digests(tmp_path / "3.tar").manifest == first.manifest


def test_a_pin_the_earlier_lock_made_is_lost_only_for_the_same_source(images: Path) -> None:
    plan, lock = locked(images)
    unresolved = make_lock(plan, {"base.digest": Pinned(None, "no answer")}, 1767225600, packages=None,
                           packages_unresolved="x")
    assert lost_pins(lock, unresolved) == [("base.digest", DIGEST)]
    assert lost_pins(unresolved, lock) == []  # a pin gained
    other_tag = _with(unresolved, base=_with(unresolved.base, tag="other"))
    assert lost_pins(lock, other_tag) == []  # another base: the old digest is not its
    gone = make_lock(plan, {"base.digest": Pinned(None, "no such tag", answered=True)}, 1767225600, packages=None,
                     packages_unresolved="x")
    assert lost_pins(lock, gone) == []  # the registry answered that the tag is gone: nothing to keep
    target = PythonTarget("3.12", "aarch64-manylinux_2_34")
    pin = WheelPin("vllm", "0.17.0", (("vllm-0.17.0-cp38-abi3-manylinux_2_28_aarch64.whl", "ab" * 32, 1),))
    with_set = _with(lock, wheels=LockedWheels.of(target, "uv", (pin,)))
    no_answer = _with(unresolved, wheels=LockedWheels.of(target, None, (), "the index did not answer"))
    assert lost_pins(with_set, no_answer) == [("base.digest", DIGEST), ("wheels", "a set of 1 wheel")]
    bumped = _with(no_answer, vllm=_with(no_answer.vllm, version="0.18.0"))
    assert lost_pins(with_set, bumped) == [("base.digest", DIGEST)]  # another release: another wheel set
    commit = "cd" * 20
    name, cutlass = next((n, c) for n, c in lock.components.items() if c.kind == "git")
    had = _with(lock, components=lock.components | {name: _with(cutlass, commit=Pinned(commit))})
    others = {n: c for n, c in unresolved.components.items() if n != name}
    renamed = _with(unresolved, components=others | {"cutlass44": _with(cutlass, commit=Pinned(None, "no answer"))})
    assert ("components.cutlass44.commit", commit) in lost_pins(had, renamed)  # the same repo and ref, renamed
    moved = _with(renamed, components=others | {"cutlass44": _with(renamed.components["cutlass44"], ref="v4.5.0")})
    assert [f for f, _ in lost_pins(had, moved) if f.startswith("components.")] == []  # another ref
    twin = _with(cutlass, commit=Pinned("ef" * 20))  # the same source, its own pin
    unanswered = others | {name: _with(cutlass, commit=Pinned(None, "no answer"))}
    assert ("components.cutlass.commit", commit) in lost_pins(_with(had, components=had.components | {"zz-cutlass-twin": twin}),
                                                              _with(unresolved, components=unanswered))


@pytest.mark.needs("git")
def test_locking_again_where_the_remote_does_not_answer_keeps_the_lock_and_its_pin(tmp_path: Path) -> None:
    """A lock that resolved a component's commit is not rewritten without it when the remote is down: exit 1, one
    line naming the lock file and the field, the file unchanged; a recipe that names another ref may drop it."""
    tree = tmp_path / "tree"
    (tree / "probe").mkdir(parents=True)
    (tree / "probe" / "__init__.py").write_text("")
    (tmp_path / "repos").mkdir()
    commit = gitserver.init_repo(tmp_path / "repos", "probe", tree, tag="v1.0")
    srv = gitserver.start(tmp_path / "repos", tmp_path / "certs")
    images = tmp_path / "images"
    images.mkdir()
    recipe = images / "testsmall.yaml"
    recipe.write_text((VARIANTS / "testsmall.yaml").read_text() + (
        f"components:\n  probe:\n    git: {srv.repo_url('probe')}\n    ref: v1.0\n"
        "    commit:\n      unknown: lock resolves it\n    dest: /opt/src/probe\n"))
    env = {"GIT_SSL_CAINFO": str(srv.ca)}

    def lock():
        return run_cli("lock", "testsmall", "--no-build", images=images, mods=TEST_MODS, env=env, timeout=300)

    try:
        first = lock()
        assert first.returncode == 0, first.stdout + first.stderr
    finally:
        srv.stop()
    path = images / "testsmall.lock.json"
    written = path.read_bytes()
    assert json.loads(written)["components"]["probe"]["commit"] == commit
    assert_one_line(lock(), f"{path}: components.probe.commit: cannot be resolved now: cannot ask", f"pins it to {commit}",
                    code=1, progress=("  ",))
    assert path.read_bytes() == written and sorted(p.name for p in images.iterdir()) == [path.name, recipe.name]
    recipe.write_text(recipe.read_text().replace("ref: v1.0", "ref: v2.0"))  # another source: nothing to keep
    other = lock()
    assert other.returncode == 0, other.stdout + other.stderr
    assert "unresolved" in json.loads(path.read_text())["components"]["probe"]["commit"]


def test_locking_again_with_nothing_changed_leaves_the_file_alone(tmp_path: Path) -> None:
    """Same pins, same bytes: the file is not rewritten (its time stays), so a lock changes only with a pin."""
    images = tmp_path / "images"
    images.mkdir()
    text = (VARIANTS / "testsmall.yaml").read_text()
    assert "repository: nvcr.io/nvidia/pytorch" in text
    # A base on a loopback port nothing listens on: the digest stays unresolved, asked of this machine only.
    (images / "testsmall.yaml").write_text(text.replace("nvcr.io/", "127.0.0.1:9/"))
    path = images / "testsmall.lock.json"
    first = run_cli("lock", "testsmall", "--no-build", images=images, mods=TEST_MODS, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    again = run_cli("lock", "testsmall", "--no-build", images=images, mods=TEST_MODS, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert path.stat().st_mtime_ns == 1_000_000_000
