"""make check-arm64: vLLM 0.33.0's real aarch64 wheel set, every dependency included, installed for linux/arm64.

tests/variants/testarm033 (the arm64 counterpart of images/pypi033, on the local arm64 base) is locked with the
real lock path (uv resolves the whole set from the index, nothing downloaded), then built with `build --locked`
under QEMU, cold (`--no-cache`): this machine's pip downloads the 199 wheels (into the cache: a second run finds
them there), the image's pip installs them offline with hashes enforced, inimage compile byte-compiles them on
every core, the kernel scan reads vLLM's and torch's aarch64 libraries and the static tier judges them for
12.1. Last, the image imports vllm and torch (no GPU is needed for the import). It prints each phase's time,
read from the build's words and BuildKit's log, and the image's size.

Too heavy for every test run: 4.3 GB to download and about as much to unpack, under emulation. Needs Docker
with arm64 emulation (.ci/provision registers it), the network to PyPI and the local arm64 base (made here when
missing: tests/support/bases.py).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkout's sparkforge and tests packages

from sparkforge.inimage import proc  # noqa: E402
from tests.support.bases import ensure_arm64_base  # noqa: E402

VARIANT = "testarm033"
CA = "/etc/ssl/certs/ca-certificates.crt"
STEP = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
DONE = re.compile(r"^#(\d+) DONE ([0-9.]+)s$")
LINE = re.compile(r"^#(\d+) ([0-9.]+) (.*)$")


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The real command line, in a process group of its own that Ctrl-C and SIGTERM stop with this script."""
    return proc.run([sys.executable, str(ROOT / "build.py"), *args], timeout=timeout, capture_output=True, text=True,
                    cwd=ROOT)


def step_times(log: Path) -> dict[str, tuple[float, dict[str, float]]]:
    """Per step of interest: its whole time and, for pip's, when each phase began, from the step's start (pip
    installs once it has downloaded every wheel; inimage compile starts once pip says it installed them)."""
    text = log.read_text(errors="replace").splitlines()
    wanted = {"pip": "--require-hashes", "scan": "kernels scan", "record": "inimage record"}
    marks = {"compile": "Successfully installed"}
    numbers: dict[str, str] = {}
    for line in text:
        if (m := STEP.match(line)):
            for name, needle in wanted.items():
                if needle in m.group(3) and name not in numbers:
                    numbers[name] = m.group(1)
    out: dict[str, tuple[float, dict[str, float]]] = {}
    for name, number in numbers.items():
        total: float | None = None
        began: dict[str, float] = {}
        for line in text:
            if (m := DONE.match(line)) and m.group(1) == number:
                total = float(m.group(2))
            elif (m := LINE.match(line)) and m.group(1) == number:
                for mark, needle in marks.items():
                    if m.group(3).startswith(needle):
                        began.setdefault(mark, float(m.group(2)))
        if total is not None:
            out[name] = (total, began)
    return out


def main() -> int:
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # proc.run stops the build then
    work = Path(tempfile.mkdtemp(prefix="sparkforge-check-arm64-"))
    try:
        t0 = time.monotonic()
        base = ensure_arm64_base()
        print(f"check-arm64: the arm64 base {base} is there ({time.monotonic() - t0:.0f} s)", flush=True)
        images = work / "images"
        shutil.copytree(ROOT / "tests" / "variants", images)
        cli = ("--images", str(images))
        t0 = time.monotonic()
        lock = run_cli(*cli, "lock", VARIANT, "--no-build")
        if lock.returncode != 0:
            print(f"check-arm64: lock failed: {lock.stderr.strip()}", file=sys.stderr)
            return 1
        said = next((x.strip() for x in (lock.stdout + lock.stderr).splitlines() if "wheels for Python" in x), "")
        print(f"check-arm64: lock {time.monotonic() - t0:.1f} s: {said}", flush=True)
        logs = work / "logs"
        t0 = time.monotonic()
        build = run_cli(*cli, "build", VARIANT, "--locked", "--no-cache", "--ca-cert", CA, "--log-dir", str(logs),
                        timeout=4 * 3600)
        took = time.monotonic() - t0
        log = max(logs.glob("*.log"), key=lambda p: p.stat().st_mtime, default=None)
        if build.returncode != 0:
            said = build.stderr.strip()
            tail = said[-2000:].split("\n", 1)[-1] if len(said) > 2000 else said  # whole lines only
            print(f"check-arm64: build failed after {took:.0f} s: {tail}", file=sys.stderr)
            if log:
                shutil.copy(log, ROOT / "build" / "check-arm64-failed.log")
                print(f"check-arm64: its log: {ROOT / 'build' / 'check-arm64-failed.log'}", file=sys.stderr)
            return 1
        steps = step_times(log) if log else {}
        plan = json.loads(run_cli(*cli, "show", VARIANT, "--json").stdout)
        tag = plan["tag"]
        print(f"check-arm64: build --locked --no-cache {took:.0f} s, static tier passed; {tag}")
        fetched = next((m.group(1) for line in (build.stdout + build.stderr).splitlines()
                        if (m := re.search(r"wheel set: [0-9.]+ GB here after ([0-9]+) s", line))), None)
        if fetched is not None:
            print(f"  download (this machine's pip)      {int(fetched):7d} s")
        if "pip" in steps:
            total, began = steps["pip"]
            if "compile" in began:
                print(f"  install (pip --no-compile)         {began['compile']:7.0f} s")
                print(f"  byte-compile (inimage compile)     {total - began['compile']:7.0f} s")
            else:
                print(f"  pip install and compile            {total:7.0f} s")
        if "scan" in steps:
            print(f"  kernel scan                        {steps['scan'][0]:7.0f} s")
        record = json.loads(run_cli("inspect", tag, "--json").stdout)["record"]
        kernels = record.get("kernels") or {}
        extensions = kernels.get("extensions") or []
        print(f"  kernels: {len(extensions)} CUDA extensions scanned for {', '.join(kernels.get('gpus') or [])}; "
              f"not needed: {', '.join(kernels.get('not_needed') or []) or 'none'}; machine {record.get('machine')}")
        t0 = time.monotonic()
        probe = subprocess.run(["docker", "run", "--rm", "--platform", "linux/arm64", "--network", "none",
                                "--entrypoint", "python3", tag, "-c",
                                "import torch, vllm; print(vllm.__version__, torch.__version__)"],
                               capture_output=True, text=True, timeout=3600)
        if probe.returncode != 0:
            print(f"check-arm64: import vllm, torch failed: {probe.stderr.strip()[-1500:]}", file=sys.stderr)
            return 1
        print(f"  import vllm, torch                 {time.monotonic() - t0:7.0f} s: {probe.stdout.strip()}")
        size = int(subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True,
                                  text=True, check=True, timeout=60).stdout.strip())
        print(f"  image size (as the engine reports it) {size / 1e9:.2f} GB; wheel set {said}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
