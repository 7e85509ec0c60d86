"""The two image stores side by side: the same builds on a classic-store engine and on a containerd-store
engine (the store of a fresh Docker 29 install), each an engine of the bench's own (root), started from the
same dockerd with only `features.containerd-snapshotter` told apart.

On each: a cold build of the test variant (`--no-cache`, through the tool's own build verb: build, static
smoke tier, tags), a fully cached build (the median of 5), a `docker save` of the image (what a stream deploy sends), and the
disk the engine's data root holds after them (`du`: a containerd store keeps each layer compressed in its
content store and unpacked in its snapshotter). Ratios are containerd / classic, measured in one run.

Run with `make bench-rebuild` (its first part) or alone with `python bench/stores.py`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkout's sparkforge and tests packages

from sparkforge.build.builder import BuildOptions  # noqa: E402
from sparkforge.build.pipeline import build_variant, load_plan  # noqa: E402
from sparkforge.recipe.layout import Layout  # noqa: E402
from tests.infra.nodes import CLASSIC, CONTAINERD, Node, start_nodes, stop_nodes  # noqa: E402

BASE = "sparkforge/base-local:bookworm"
CA = Path("/etc/ssl/certs/ca-certificates.crt")
VARIANT = "testvllm"
CACHED_RUNS = 5  # a cached build takes well under a second: one run is mostly noise


@dataclass(frozen=True)
class Figures:
    cold: float  # seconds: the tool's build verb, --no-cache
    cached: float  # seconds: the same build again, every step from the cache (median of CACHED_RUNS)
    save: float  # seconds: docker save of the image to /dev/null
    saved_bytes: int
    disk: int  # bytes under the engine's data root after both builds


def _du(path: Path) -> int:
    proc = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True, timeout=600)
    return int(proc.stdout.split()[0])


def _on(engine: Node, work: Path) -> Figures:
    save = subprocess.Popen(["docker", "save", BASE], stdout=subprocess.PIPE)
    subprocess.run(["docker", "-H", engine.endpoint, "load"], stdin=save.stdout, check=True, capture_output=True,
                   timeout=1800)
    save.wait(timeout=60)
    os.environ["DOCKER_HOST"] = engine.endpoint  # every docker call of the builds below
    layout = Layout.default(images_dir=ROOT / "tests" / "variants", mods_dir=ROOT / "mods")
    plan = load_plan(layout, VARIANT, base=BASE).plan

    def build(no_cache: bool) -> float:
        opts = BuildOptions(network="host", ca_cert=CA, log_dir=work / "logs", no_cache=no_cache)
        start = time.monotonic()
        build_variant(plan, layout, opts, smoke=True)
        return time.monotonic() - start

    cold = build(no_cache=True)
    cached = statistics.median(build(no_cache=False) for _ in range(CACHED_RUNS))
    start = time.monotonic()
    saved = subprocess.run(["docker", "-H", engine.endpoint, "save", plan.tag], capture_output=True, check=True,
                           timeout=1800).stdout
    save_s = time.monotonic() - start
    return Figures(cold, cached, save_s, len(saved), _du(engine.data_root))


def main() -> int:
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        print("bench-stores: skipped (engines of its own need root and dockerd)")
        return 0
    work = Path(tempfile.mkdtemp(prefix="sparkforge-bench-stores-"))
    base_dir = tempfile.mkdtemp(prefix="sfs-", dir="/tmp")
    before = os.environ.get("DOCKER_HOST")
    out: dict[str, Figures] = {}
    version = subprocess.run(["dockerd", "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    print(f"bench-stores: {VARIANT} on {BASE}, on two engines of this run ({version}), one per image store")
    try:
        for name, config in (("classic", CLASSIC), ("containerd", CONTAINERD)):
            (engine,) = start_nodes(1, base_dir, config, prefix=name[:3])
            try:
                out[name] = _on(engine, work)
            finally:
                os.environ.pop("DOCKER_HOST", None)
                stop_nodes([engine], kill=True)
                engine.destroy()
    finally:
        if before:
            os.environ["DOCKER_HOST"] = before
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(base_dir, ignore_errors=True)
    print(f"  {'':28} {'classic':>12} {'containerd':>12} {'ratio':>8}")
    rows: tuple[tuple[str, Callable[[Figures], float]], ...] = (
        ("cold build, build verb (s)", lambda f: f.cold), ("cached build, build verb (s)", lambda f: f.cached),
        ("docker save of the image (s)", lambda f: f.save), ("docker save size (MB)", lambda f: f.saved_bytes / 1e6),
        ("engine data root (MB)", lambda f: f.disk / 1e6))
    for label, pick in rows:
        a, b = pick(out["classic"]), pick(out["containerd"])
        print(f"  {label:28} {a:12.1f} {b:12.1f} {b / a:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
