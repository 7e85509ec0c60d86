"""First-build benchmark: the first build of pypi033's x86-64 counterpart (tests/variants/testvllm033: PyPI's
vLLM 0.33.0 wheel, its lock's wheel set, no compile) against the git-source test variant (tests/support/
gitsource.py: vLLM 0.17.0 from git, compiled with VLLM_TARGET_DEVICE=empty), on the same engine and both cold:
`--no-cache`, which also starts BuildKit's cache mounts (pip, git, ccache) afresh. It prints each time, the
bytes each build downloads and the ratio.

Then the cost of emulation: tests/variants/testarm64 built cold for linux/arm64 (a Spark's platform) on the
local arm64 base, its RUN steps under QEMU, against the same recipe built for linux/amd64 (`--platform`) on
the same Debian release for this machine, natively. Each installs its architecture's vLLM 0.20.0 wheel.

The bytes are what pip reports in the build log ("Downloading FILE (SIZE)", to a tenth of a unit), plus, for
the git-source variant, the served vLLM repository's objects (a loopback git server here, GitHub for a real
variant; the blob-less fetch of one commit takes at most that). The counterpart's lock gives its exact bytes
too (the sizes the index lists), printed beside.

Run with `make bench-first-build` (needs Docker, the network to PyPI and the local base: `make base-local`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkout's sparkforge and tests packages

from tests.support.bases import ensure_arm64_base  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402
from tests.support.docker import image_id  # noqa: E402
from tests.support.gitsource import VARIANT as GIT_VARIANT  # noqa: E402
from tests.support.gitsource import GitSource, ensure_torch_base  # noqa: E402

from sparkforge.build.builder import BuildOptions, build_image  # noqa: E402
from sparkforge.build.pipeline import LockPolicy, load_plan  # noqa: E402
from sparkforge.build.render import render_context  # noqa: E402
from sparkforge.recipe.layout import Layout  # noqa: E402
from sparkforge.recipe.wheelset import download_bytes  # noqa: E402

BASE = "sparkforge/base-local:bookworm"
X86_TRIXIE = "sparkforge/base-local:trixie"  # the arm64 base's release, for this machine
ARM64_VARIANT = "testarm64"
CA = Path("/etc/ssl/certs/ca-certificates.crt")
VARIANT = "testvllm033"
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
DOWNLOAD_RE = re.compile(r"Downloading (\S+\.(?:whl|tar\.gz|zip)) \(([0-9.]+) (B|kB|MB|GB)\)")


def pip_downloads(log: Path) -> dict[str, int]:
    """File -> bytes of every download pip reported in a build log (each file once)."""
    found: dict[str, int] = {}
    for name, size, unit in DOWNLOAD_RE.findall(log.read_text(errors="replace")):
        found[name.rsplit("/", 1)[-1]] = int(float(size) * UNITS[unit])
    return found


def cold_build(layout: Layout, variant: str, opts: BuildOptions, work: Path, **kw: Any) -> tuple[float, Path]:
    plan = load_plan(layout, variant, **kw).plan
    ctx = render_context(plan, layout, work / "ctx" / plan.plan_hash[:12], ca_cert=opts.ca_cert)
    start = time.monotonic()
    result = build_image(plan, ctx, BuildOptions(**{**opts.__dict__, "no_cache": True}))
    return time.monotonic() - start, result.log_path


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def emulation(opts: BuildOptions, work: Path) -> dict[str, float]:
    """testarm64 built cold for linux/arm64 under QEMU, and for linux/amd64 natively; both times and the ratio."""
    ensure_arm64_base()
    if not image_id(X86_TRIXIE):
        subprocess.run(["bash", str(ROOT / "scripts" / "base-local.sh"), X86_TRIXIE], check=True, timeout=3600,
                       env=dict(os.environ, BASE_SUITE="trixie"))
    layout = Layout.default(images_dir=ROOT / "tests" / "variants")
    arm_s, _ = cold_build(layout, ARM64_VARIANT, opts, work)
    x86_s, _ = cold_build(layout, ARM64_VARIANT, opts, work, base=X86_TRIXIE, platform="linux/amd64")
    print(f"  {ARM64_VARIANT} for linux/arm64 under QEMU {arm_s:7.1f} s; for linux/amd64 natively {x86_s:7.1f} s")
    print(f"ratio first build, emulated arm64 / native amd64: {arm_s / x86_s:6.3f}")
    return {"arm64_emulated_s": round(arm_s, 1), "amd64_native_s": round(x86_s, 1),
            "emulation_ratio": round(arm_s / x86_s, 3)}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="sparkforge-bench-first-"))
    git = None
    try:
        images = work / "images"
        shutil.copytree(ROOT / "tests" / "variants", images)
        lock = run_cli("--images", str(images), "lock", VARIANT, "--base", BASE, "--no-build")
        if lock.returncode != 0:
            sys.exit(f"bench-first-build: lock {VARIANT} failed: {lock.stderr.strip()}")
        layout = Layout.default(images_dir=images)
        opts = BuildOptions(network="host", ca_cert=CA, log_dir=work / "logs")
        plan = load_plan(layout, VARIANT, base=BASE, lock_policy=LockPolicy.LOCKED).plan
        print(f"bench-first-build: {VARIANT} (vLLM 0.33.0 x86-64 wheel from its lock, no compile) against "
              f"{GIT_VARIANT} (vLLM 0.17.0 from git, compiled), each with --no-cache on {BASE}")
        wheel_s, wheel_log = cold_build(layout, VARIANT, opts, work, base=BASE, lock_policy=LockPolicy.LOCKED)
        wheel_bytes = sum(pip_downloads(wheel_log).values())
        print(f"  {VARIANT:<12} first build {wheel_s:7.1f} s, downloads {wheel_bytes / 1e6:8.1f} MB (pip's log; "
              f"the lock lists {download_bytes(plan.wheel_set) / 1e6:.1f} MB)")

        git = GitSource(work / "git")
        ensure_torch_base(BASE, work / "torch-base")
        git_layout = Layout.default(images_dir=git.images, mods_dir=git.mods)
        git_opts = BuildOptions(network="host", ca_cert=git.ca_bundle, log_dir=work / "logs")
        git_s, git_log = cold_build(git_layout, GIT_VARIANT, git_opts, work)
        pip_bytes = sum(pip_downloads(git_log).values())
        served = tree_bytes(git.root / "repos" / "vllm.git" / "objects")
        print(f"  {GIT_VARIANT:<12} first build {git_s:7.1f} s, downloads {(pip_bytes + served) / 1e6:8.1f} MB "
              f"({pip_bytes / 1e6:.1f} MB of build requirements by pip's log, at most {served / 1e6:.1f} MB of vLLM's "
              "git objects)")
        print(f"ratio first build, no compile / compile: {wheel_s / git_s:6.3f}  (the compile here is "
              "VLLM_TARGET_DEVICE=empty, a small part of a CUDA compile; its users report 20 min to 3 h for a CUDA "
              "one on a Spark)")
        figures = emulation(opts, work)
        print(json.dumps({"no_compile_s": round(wheel_s, 1), "compile_s": round(git_s, 1),
                          "no_compile_bytes": wheel_bytes, "compile_bytes": pip_bytes + served,
                          "ratio": round(wheel_s / git_s, 3)} | figures))
    finally:
        if git is not None:
            git.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
