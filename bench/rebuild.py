"""Rebuild benchmark: a cold build, a rebuild after one install-phase mod changed, and the tool's
overhead on a fully cached build against a raw `docker buildx build` of the same rendered folder;
then the git-source variant (tests/support/gitsource.py): a cold build, and rebuilds after an install-phase
and after a source-phase mod changed; then that variant with an empty and with a warm wheel cache,
each after `docker builder prune -af` on an engine of the bench's own (root), so that the machine's
build cache is left alone. `python bench/rebuild.py --wheel-cache` runs only that last part.

Run with `make bench-rebuild` (needs Docker and the local base: `make base-local`).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkout's sparkforge and tests packages

from tests.support.gitsource import VARIANT as GIT_VARIANT  # noqa: E402
from tests.support.gitsource import TORCH_BASE, GitSource, ensure_torch_base  # noqa: E402

from sparkforge.build.builder import BuildOptions, BuildResult, build_image, buildx_command  # noqa: E402
from sparkforge.build.pipeline import WheelNote, build_variant, load_plan  # noqa: E402
from sparkforge.recipe.layout import Layout  # noqa: E402
from sparkforge.recipe.plan import Plan  # noqa: E402
from sparkforge.build.render import Context, render_context  # noqa: E402

BASE = "sparkforge/base-local:bookworm"
CA = Path("/etc/ssl/certs/ca-certificates.crt")
VARIANT = "testvllm"
REPEATS = 5


def timed(cmd: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return time.monotonic() - start


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="sparkforge-bench-"))
    mods = work / "mods"
    shutil.copytree(ROOT / "mods", mods)
    layout = Layout.default(images_dir=ROOT / "tests" / "variants", mods_dir=mods)
    opts = BuildOptions(network="host", ca_cert=CA, log_dir=work / "logs")

    def build(no_cache: bool = False) -> tuple[Plan, Context, BuildResult, float]:
        plan = load_plan(layout, VARIANT, base=BASE).plan
        ctx = render_context(plan, layout, work / "ctx" / plan.plan_hash[:12])
        start = time.monotonic()
        result = build_image(plan, ctx, BuildOptions(**{**opts.__dict__, "no_cache": no_cache}))
        return plan, ctx, result, time.monotonic() - start

    print(f"bench-rebuild: variant {VARIANT} on {BASE} (real vLLM 0.17.0 wheel, {REPEATS} repeats for overhead)")
    plan, ctx, cold, cold_s = build(no_cache=True)
    print(f"  cold build (--no-cache, fresh cache mounts): {cold_s:7.1f} s, {len(cold.ran)} steps ran")

    # Change one install-phase mod: reword a comment line in the first mod's patch.
    first = plan.mods_in("install")[0]
    assert first.spec.patch is None or isinstance(first.spec.patch, str), f"{first.name}: its patch is fetched by URL"
    patch = mods / first.name / first.spec.patch if first.spec.patch else None
    target = patch or next(p for p in (mods / first.name).iterdir() if p.name != "mod.yaml")
    text = target.read_text()
    changed = text.replace("sparkforge mod", "sparkforge (bench-edited) mod", 1)
    assert changed != text, f"nothing to edit in {target}"
    target.write_text(changed)
    plan2, ctx2, rebuild, rebuild_s = build()
    ran_stages = [f"[{s.name}] {s.command[:60]}" for s in rebuild.ran]
    first_mod_step = min(s.number for s in rebuild.steps if f"mods/{first.name}" in s.command)
    before_mods = [s for s in rebuild.ran if s.stage == "base" or
                   (s.stage == "runtime" and int(s.name.split()[1].split("/")[0]) <
                    int(next(x for x in rebuild.steps if x.number == first_mod_step).name.split()[1].split("/")[0]))]
    print(f"  rebuild after editing mod {first.name}: {rebuild_s:7.1f} s, {len(rebuild.ran)} steps ran")
    for line in ran_stages:
        print(f"      re-ran {line}")
    print(f"  steps before the mods that re-ran: {len(before_mods)}" + (" (FAIL)" if before_mods else " (ok)"))

    # Overhead on a fully cached build: the tool's whole `build` command against raw buildx.
    tool_cmd = [sys.executable, "build.py", "--images", str(ROOT / "tests" / "variants"), "--mods", str(mods),
                "build", VARIANT, "--base", BASE, "--ca-cert", str(CA)]
    raw_cmd = buildx_command(plan2, ctx2, opts, "sparkforge-bench/raw:cached")
    timed(tool_cmd)  # promote tags once, so that the loop measures the steady cached state
    tool_times, raw_times = [], []
    for _ in range(REPEATS):
        raw_times.append(timed(raw_cmd))
        tool_times.append(timed(tool_cmd))
    subprocess.run(["docker", "image", "rm", "sparkforge-bench/raw:cached"], capture_output=True)
    tool_med, raw_med = statistics.median(tool_times), statistics.median(raw_times)
    print(f"  cached build, tool `build` command: median {tool_med:5.2f} s  ({', '.join(f'{t:.2f}' for t in tool_times)})")
    print(f"  cached build, raw docker buildx:    median {raw_med:5.2f} s  ({', '.join(f'{t:.2f}' for t in raw_times)})")
    print(f"ratio rebuild/cold:           {rebuild_s / cold_s:6.3f}  (target < 0.10)")
    print(f"ratio cached tool/raw buildx: {tool_med / raw_med:6.3f}  (target <= 1.5)")
    git_ok = bench_git_source(work)
    shutil.rmtree(work, ignore_errors=True)
    if before_mods or not git_ok:
        sys.exit(1)


def bench_git_source(work: Path) -> bool:
    """The git-source variant: cold, then one install-phase mod edited, then one source-phase mod edited.
    True when the install-phase edit left the compile cached and the source-phase edit re-ran it."""
    git = GitSource(work / "git")
    try:
        ensure_torch_base(BASE, work / "torch-base")
        layout = Layout.default(images_dir=git.images, mods_dir=git.mods)
        opts = BuildOptions(network="host", ca_cert=git.ca_bundle, log_dir=work / "logs")

        def build(no_cache: bool = False) -> tuple[BuildResult, float]:
            plan = load_plan(layout, GIT_VARIANT).plan
            ctx = render_context(plan, layout, work / "ctx" / plan.plan_hash[:12])
            start = time.monotonic()
            result = build_image(plan, ctx, BuildOptions(**{**opts.__dict__, "no_cache": no_cache}))
            return result, time.monotonic() - start

        def edit(mod: str) -> None:
            """Change what the mod applies: a line its patch adds (its summary alone reaches no step: the
            image reads only what it applies)."""
            (patch,) = (git.mods / mod).glob("*.patch")
            text = patch.read_text()
            line = next(n for n in text.splitlines() if n.startswith("+") and not n.startswith("+++") and n[1:].strip())
            patch.write_text(text.replace(line, line + "  # bench-edited", 1))

        def compiled(result: BuildResult) -> bool:
            return any(s.stage == "vllm-build" for s in result.ran)

        print(f"bench-rebuild: git-source variant {GIT_VARIANT} (vLLM 0.17.0 over HTTPS, VLLM_TARGET_DEVICE=empty)")
        cold, cold_s = build(no_cache=True)
        print(f"  cold build (--no-cache):                  {cold_s:7.1f} s, {len(cold.ran)} steps ran")
        edit("uf17-eager-allreduce")
        inst, inst_s = build()
        print(f"  after an install-phase mod edit:          {inst_s:7.1f} s, {len(inst.ran)} steps ran, "
              f"compile {'re-ran (FAIL)' if compiled(inst) else 'cached (ok)'}")
        edit("probe-source-mark")
        src, src_s = build()
        print(f"  after a source-phase mod edit:            {src_s:7.1f} s, {len(src.ran)} steps ran, "
              f"compile {'re-ran (ok)' if compiled(src) else 'cached (FAIL)'}")
        print(f"ratio git install-mod rebuild/cold: {inst_s / cold_s:6.3f}")
        print(f"ratio git source-mod rebuild/cold:  {src_s / cold_s:6.3f}")
        return not compiled(inst) and compiled(src) and bench_wheel_cache(git, work)
    finally:
        git.stop()


def bench_wheel_cache(git: GitSource, work: Path) -> bool:
    """The git-source variant built twice on an engine of its own, each time after `docker builder prune -af`
    there: with an empty wheel cache (the compile runs), then with the wheel the first build stored (it does
    not). True when so. Needs root (the engine); without it, says so and passes."""
    import os

    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        print("bench-rebuild: wheel cache: skipped (an engine of its own needs root and dockerd)")
        return True
    from tests.infra.nodes import CONTAINERD, start_nodes, stop_nodes

    variant = f"{GIT_VARIANT}-pinned"
    (git.images / f"{variant}.yaml").write_text(
        f"extends: {GIT_VARIANT}\ncomponents:\n  sparkprobe:\n    commit: {git.probe}\n")
    layout = Layout.default(images_dir=git.images, mods_dir=git.mods)
    cache = work / "wheel-cache"
    base_dir = tempfile.mkdtemp(prefix="sfb-", dir="/tmp")
    before = None
    (engine,) = start_nodes(1, base_dir, CONTAINERD)
    try:
        save = subprocess.Popen(["docker", "save", TORCH_BASE], stdout=subprocess.PIPE)
        subprocess.run(["docker", "-H", engine.endpoint, "load"], stdin=save.stdout, check=True, capture_output=True)
        save.wait()
        before = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = engine.endpoint  # every docker call of the builds below: build, inspect, tag
        opts = BuildOptions(network="host", ca_cert=git.ca_bundle, log_dir=work / "logs")
        plan = load_plan(layout, variant).plan
        print("bench-rebuild: the wheel cache, on an engine of its own; each build starts with "
              "`docker builder prune -af` there")

        def build() -> tuple[float, WheelNote]:
            subprocess.run(["docker", "-H", engine.endpoint, "builder", "prune", "-af"], check=True,
                           capture_output=True)
            start = time.monotonic()
            done = build_variant(plan, layout, opts, smoke=False, wheel_cache=cache)
            return time.monotonic() - start, done.wheel

        cold_s, cold = build()
        print(f"  empty wheel cache:                        {cold_s:7.1f} s, wheel {cold.origin}"
              + (" (ok)" if cold.origin == "compiled" else " (FAIL)"))
        warm_s, warm = build()
        print(f"  warm wheel cache:                         {warm_s:7.1f} s, wheel {warm.origin}"
              + (" (ok)" if warm.origin == "cache" else " (FAIL)"))
        print(f"ratio git build warm/cold wheel cache: {warm_s / cold_s:6.3f}  (both after a builder prune; the "
              "compile here is VLLM_TARGET_DEVICE=empty, a small part of a CUDA compile)")
        return cold.origin == "compiled" and warm.origin == "cache"
    finally:
        os.environ.pop("DOCKER_HOST", None)
        if before:
            os.environ["DOCKER_HOST"] = before
        stop_nodes([engine], kill=True)
        engine.destroy()
        shutil.rmtree(base_dir, ignore_errors=True)


def main_wheel_cache() -> None:
    """Only the wheel-cache part (`python bench/rebuild.py --wheel-cache`)."""
    work = Path(tempfile.mkdtemp(prefix="sparkforge-bench-"))
    git = GitSource(work / "git")
    try:
        ensure_torch_base(BASE, work / "torch-base")
        ok = bench_wheel_cache(git, work)
    finally:
        git.stop()
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main_wheel_cache() if sys.argv[1:] == ["--wheel-cache"] else main()
