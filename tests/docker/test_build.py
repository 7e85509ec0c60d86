"""Real BuildKit builds of the test variant: smoke tier, tags, record, cache, and the failure paths."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sparkforge.build.builder import _BuildLog
from tests.support.cli import run_cli as sparkforge
from tests.support import needs
from tests.support.cuda import smoke_rows
from tests.support.docker import BASE, VARIANTS, build_args, fresh_variant, image_id
from tests.support.paths import MODS, ROOT

pytestmark = [pytest.mark.docker, pytest.mark.network]


def test_build_smoke_and_tags(test_image) -> None:
    assert image_id(test_image.moving_tag) == test_image.image_id
    assert image_id(test_image.tag) == test_image.image_id
    assert image_id(test_image.tag + "-candidate") is None
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                                        test_image.tag], capture_output=True, text=True, check=True).stdout)
    assert labels["io.sparkforge.variant"] == "testvllm"
    assert labels["org.opencontainers.image.version"] == "0.17.0"
    assert labels["io.sparkforge.plan-hash"].startswith(test_image.tag.rsplit("-", 1)[1])


def test_inspect_shows_every_pin_and_mod(test_image) -> None:
    proc = sparkforge("inspect", test_image.moving_tag, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    record = data["record"]
    assert record["tag"] == test_image.tag
    assert record["vllm"]["version"] == "0.17.0"
    assert record["installed"]["vllm"] == "0.17.0"
    assert record["vllm"]["built_commit"] == "b31e9326a"  # what the 0.17.0 wheel records
    assert [(m["name"], m["result"]) for m in record["mods"]] == [
        ("uf17-eager-allreduce", "applied"), ("fix-qwen35-tp4-marlin", "applied"), ("serve-torchrun", "applied")]
    assert all(m["digest"].startswith("sha256:") for m in record["mods"])
    assert record["build"]["torch_cuda_arch_list"] == "12.1a"
    assert record["base"]["repository"] == "sparkforge/base-local"
    text = sparkforge("inspect", test_image.moving_tag).stdout
    for needle in ("uf17-eager-allreduce", "fix-qwen35-tp4-marlin", "serve-torchrun", "0.17.0", "12.1a",
                   "UNPINNED", "built"):
        assert needle in text
    # The recipe pins no base digest (--base names a local image): the image says which base it was built from.
    # By its registry digest where the engine knows one (the containerd store gives an imported image its
    # manifest's, the same as its ID), else by its ID.
    base_id = image_id(BASE)
    resolved = data["labels"]["io.sparkforge.base.resolved"]
    assert resolved in (base_id, f"{BASE.partition(':')[0]}@{base_id}"), resolved
    assert (f"  base         {BASE} @ {resolved} (not pinned; the base the engine held when it built)") in text, text


def test_static_tier_passes_and_gpu_tiers_say_why_they_skip(test_image) -> None:
    proc = sparkforge("--images", str(VARIANTS), "test", "testvllm", "--base", BASE,
                      "--tier", "static", "--tier", "gpu", "--tier", "serve")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The local base has none of the protected packages: nothing to compare, so that check is skipped, not ok.
    protected = next(line for line in proc.stdout.splitlines() if "base packages not replaced by pip" in line)
    assert " skipped " in protected and "the base has none of the protected packages" in protected, protected
    assert "torchrun server script" in proc.stdout
    assert "failed" not in proc.stdout
    rows = smoke_rows(proc.stdout)
    (state, reason), = {rows["gpu", "(whole tier)"], rows["serve", "(whole tier)"]}  # both, for one reason
    assert state == "skipped"
    if not (needs.missing("gpu") or needs.missing("gpu-runtime")):  # a GPU host: the image has no torch
        assert reason.startswith(f"{test_image.tag} has no importable torch"), reason
    elif shutil.which("nvidia-smi") is None:
        assert reason == "no NVIDIA GPU on this host (nvidia-smi not found)"


def test_static_tier_fails_on_an_image_that_breaks_what_it_checks(test_image, tmp_path) -> None:
    # The local base has none of the protected packages, so on the image itself that check is skipped with
    # nothing to compare: an image derived from it claims that the base had another pip and loses the
    # torchrun server script, and both checks must fail.
    broken = f"sparkforge-test/broken-static:{test_image.image_id.split(':')[-1][:12]}"
    (tmp_path / "Dockerfile").write_text(
        f"FROM {test_image.tag}\n"
        "RUN python3 -c \"import json; p = '/opt/sparkforge/protect/protected.json'; d = json.load(open(p)); "
        "d['pip'] = '0.0.1'; json.dump(d, open(p, 'w'))\" && rm /opt/sparkforge/serve_torchrun.py\n")
    built = subprocess.run(["docker", "buildx", "build", "--load", "--network", "host", "-t", broken, str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    try:
        proc = sparkforge("--images", str(VARIANTS), "test", "testvllm", "--base", BASE, "--image", broken,
                          "--tier", "static")
    finally:
        subprocess.run(["docker", "rmi", "-f", broken], capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if "failed" in line]
    assert any("base packages not replaced by pip" in line and "pip 0.0.1 ->" in line for line in failed), proc.stdout
    assert any("torchrun server script" in line for line in failed), proc.stdout


def steps_that_ran(stdout: str) -> list[str]:
    """The steps a build ran rather than took from the cache, read from the build log it names."""
    log = _BuildLog(progress=lambda step, seconds: None)
    for line in Path(stdout.split("; log: ", 1)[1].split()[0]).read_text().splitlines():
        log.feed(line)
    return [f"[{step.name}] {step.command}" for step in log.steps.values() if step.ran]


def test_second_build_of_the_same_plan_is_fully_cached(test_image) -> None:
    """A second build runs none of the variant's own steps and gives the same image.

    The base stage (FROM the base, the copy of the in-image package, protect) is the same for every variant
    on this base. While the other engine groups build, BuildKit re-ran those two steps in fresh CI runs, in
    two builds back to back, with the same result; they, and only they, may run again. A render that is not
    the same twice changes what a later step copies, and that step runs."""
    for _ in range(2):
        proc = sparkforge(*build_args("testvllm"))
        assert proc.returncode == 0, proc.stderr
    ran = steps_that_ran(proc.stdout)
    assert all(step.startswith("[base ") for step in ran), ran
    assert image_id(test_image.moving_tag) == test_image.image_id


def test_no_ca_bundle_or_secret_in_the_image(test_image) -> None:
    config = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config}}",
                                        test_image.tag], capture_output=True, text=True, check=True).stdout)
    env = " ".join(config.get("Env") or [])
    assert "CERT" not in env and "secrets" not in env
    proc = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", test_image.tag,
                           "-c", "ls -A /run/secrets 2>/dev/null | wc -l"], capture_output=True, text=True)
    assert proc.stdout.strip() == "0"
    history = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", test_image.tag],
                             capture_output=True, text=True, check=True).stdout
    assert "ca-certificates.crt" not in history


def _broken_mods(tmp_path: Path) -> Path:
    mods = tmp_path / "mods"
    shutil.copytree(MODS, mods)
    patch = mods / "uf17-eager-allreduce" / "uf17.patch"
    text = patch.read_text()
    context = "             self.cudagraph_mode = CUDAGraphMode.NONE"
    assert context in text
    patch.write_text(text.replace(context, "             self.cudagraph_mode = CUDAGraphMode.NOT_THERE"))
    return mods


def test_a_broken_mod_fails_the_build_and_keeps_the_tags(test_image, tmp_path: Path) -> None:
    proc = sparkforge(*build_args("testvllm", mods=_broken_mods(tmp_path)))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: mods: uf17-eager-allreduce: mod uf17-eager-allreduce failed: "
                                "vllm/config/compilation.py: hunk @@"), lines[-1]
    assert f"{test_image.moving_tag} still points to {test_image.image_id[:19]}" in lines[-1]
    # Above the error, the failing step's own last lines.
    shown = [line for line in lines if line.startswith("  | ")]
    assert shown and shown[0].startswith("  | step [") and "its last lines:" in shown[0], proc.stderr
    assert any("uf17-eager-allreduce" in line for line in shown[1:]), proc.stderr
    assert "Traceback" not in proc.stderr
    assert image_id(test_image.moving_tag) == test_image.image_id
    assert image_id(test_image.tag) == test_image.image_id


def test_a_failed_smoke_test_keeps_the_previous_good_image(test_image, tmp_path: Path) -> None:
    with fresh_variant("sparkforge-test/vllm", "testprobe"):
        images, mods = tmp_path / "images", tmp_path / "mods"
        shutil.copytree(VARIANTS, images)
        shutil.copytree(MODS, mods)
        probe = mods / "smoke-probe"
        probe.mkdir()
        (probe / "probe.txt").write_text("probe\n")
        meta = """\
name: smoke-probe
summary: a drop-in file whose in-image check the test flips
description: covers the path where the build passes and the static smoke tier fails
component: image
targets: {versions: ">=0.1"}
phase: install
kind: files
files:
  - {src: probe.txt, dest: /opt/sparkforge/probe.txt}
verify:
  - {file: /opt/sparkforge/probe.txt, contains: probe}
  - python: "import sys; sys.exit(0)"
"""
        (probe / "mod.yaml").write_text(meta)
        (images / "testprobe.yaml").write_text("extends: testvllm\nmods:\n  add: [smoke-probe]\n")
        good = sparkforge(*build_args("testprobe", images=images, mods=mods))
        assert good.returncode == 0, good.stdout + good.stderr
        moving = "sparkforge-test/vllm:testprobe"
        good_id = image_id(moving)
        assert good_id
        (probe / "mod.yaml").write_text(meta.replace("sys.exit(0)", "sys.exit('deliberately failing check')"))
        bad = sparkforge(*build_args("testprobe", images=images, mods=mods))
        assert bad.returncode == 1
        assert "deliberately failing check" in bad.stdout
        last = bad.stderr.strip().splitlines()[-1]
        assert last.startswith("error: testprobe: static smoke tier failed (") and "probe" in last, last
        assert "; image left as sparkforge-test/vllm:testprobe-" in last, last
        assert f"{moving} still points to {good_id[:19]}" in last
        assert image_id(moving) == good_id


def test_the_immutable_tag_never_moves_silently(test_image, tmp_path: Path) -> None:
    """A build of a plan whose immutable tag already names another image of the variant (as a rebuild that gave
    other bytes leaves it) keeps its image beside the tag and moves neither tag; --move-tag moves both and keeps
    the old image reachable as a tag of its own, which `history` lists (only this variant's builds)."""
    with fresh_variant("sparkforge-test/vllm", "testmove"):
        images = tmp_path / "images"
        shutil.copytree(VARIANTS, images)
        (images / "testmove.yaml").write_text("extends: testvllm\n")
        first = sparkforge(*build_args("testmove", images=images))
        assert first.returncode == 0, first.stderr
        moving = "sparkforge-test/vllm:testmove"
        built = image_id(moving)
        tag = next(line.split()[1] for line in first.stdout.splitlines() if line.startswith("tagged ") and ":testmove-" in line)
        # Another image of this variant, as a rebuild that gave other bytes would leave: the build with a label more.
        subprocess.run(["docker", "buildx", "build", "--load", "--provenance=false", "-t", tag, "-"], check=True,
                       capture_output=True, timeout=600, input=f"FROM {tag}\nLABEL io.sparkforge.test=other\n".encode())
        other = image_id(tag)
        assert built and other and built != other
        b12, o12 = built.removeprefix("sha256:")[:12], other.removeprefix("sha256:")[:12]
        kept, old_kept = f"{tag}.{b12}", f"{tag}.{o12}"
        foreign = f"{moving}-000000000000"  # reads like a build's tag, but its image is no build of this variant
        subprocess.run(["docker", "tag", BASE, foreign], check=True, capture_output=True, timeout=60)
        again = sparkforge(*build_args("testmove", images=images))
        assert again.returncode == 0, again.stderr
        said = [line for line in again.stdout.splitlines() if "already names image" in line]
        assert said == [f"{tag} already names image {o12}, an earlier build of this plan; this build made {b12}, "
                        f"kept as {kept}; neither tag moved (build --move-tag moves them, keeping {o12} as "
                        f"{old_kept})"], again.stdout
        assert (image_id(tag), image_id(moving), image_id(kept)) == (other, built, built)

        moved = sparkforge(*build_args("testmove", "--move-tag", images=images))
        assert moved.returncode == 0, moved.stderr
        assert (image_id(tag), image_id(moving), image_id(old_kept)) == (built, built, other)
        assert f"{tag} moved from image {o12} to {b12}; {o12} stays as {old_kept}" in moved.stdout

        history = sparkforge("--images", str(images), "history", "testmove", "--base", BASE)
        assert history.returncode == 0, history.stderr
        rows = {line.split()[0]: line for line in history.stdout.splitlines()[1:]}
        short = lambda ref: ref.split(":", 1)[1]  # noqa: E731
        assert set(rows) == {short(tag), short(kept), short(old_kept)}, history.stdout
        assert "<- testmove" in rows[short(tag)] and "<- testmove" in rows[short(kept)], history.stdout
        assert "<- testmove" not in rows[short(old_kept)], history.stdout
        header = history.stdout.splitlines()[0].split()
        assert header[:6] == ["tag", "tagged", "(UTC)", "vLLM", "base", "mods"], history.stdout
        # each build's base: the local base, which the recipe does not pin, by the ID the engine held it under
        base12 = image_id(BASE).removeprefix("sha256:")[:12]
        assert all(f" {base12} " in row for row in rows.values()), history.stdout


@pytest.mark.parametrize("args,words", [
    (["build", "ng17", "--ca-cert", "/nonexistent/ca.pem"], "--ca-cert: CA bundle not found"),
    (["test", "ng17", "--tier", "bogus"], "--tier: 'bogus' is not one of 'static', 'gpu', 'serve'"),
    (["inspect", "sparkforge-test/vllm:no-such-tag"], "IMAGE: image sparkforge-test/vllm:no-such-tag not found"),
    (["--images", str(VARIANTS), "test", "testvllm", "--image", "sparkforge-test/vllm:no-such-tag"],
     "--image: image sparkforge-test/vllm:no-such-tag not found"),
])
def test_bad_build_input_is_one_line(args, words) -> None:
    proc = sparkforge(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert words in proc.stderr.strip().splitlines()[-1]


def test_inspect_of_an_image_sparkforge_did_not_build_is_bad_input(base_image) -> None:
    proc = sparkforge("inspect", base_image)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == (f"error: IMAGE: {base_image} has no /opt/sparkforge/build-record.json: it was not built "
                           "by sparkforge\n")


def test_a_base_that_cannot_be_pulled_is_one_line_that_says_how_to_swap_it(base_image) -> None:
    # Nothing listens on port 9 of loopback: the same failure as nvcr.io out of reach, with no traffic out.
    unreachable = "127.0.0.1:9/sparkforge-test/ngc-base:26.02-py3"
    before = image_id("sparkforge-test/vllm:testvllm")
    proc = sparkforge("--images", str(VARIANTS), "build", "testvllm", "--base", unreachable, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert f"the base image {unreachable} cannot be pulled" in lines[0] and "--base" in lines[0], lines[0]
    assert image_id("sparkforge-test/vllm:testvllm") == before, "no tag moves"


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def test_sigterm_stops_the_build_it_started_and_moves_no_tag(test_image) -> None:
    import signal
    import sys
    import time

    before = image_id(test_image.moving_tag)
    cli = subprocess.Popen([sys.executable, str(ROOT / "build.py"), *build_args("testvllm", "--no-cache")],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        children: set[int] = set()
        while time.monotonic() < deadline and not children:
            children = {c for c in _children(cli.pid)
                        if b"buildx" in Path(f"/proc/{c}/cmdline").read_bytes()} if cli.poll() is None else set()
            time.sleep(0.2)
        assert children, "the build never started docker buildx"
        cli.send_signal(signal.SIGTERM)
        cli.wait(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    # The CLI stops and waits for each child it started before it exits: none is left the moment it is gone.
    assert not [c for c in children if Path(f"/proc/{c}").exists()], "docker buildx outlived the CLI"
    assert cli.returncode == 128 + signal.SIGTERM
    assert image_id(test_image.moving_tag) == before
