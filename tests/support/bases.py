"""The bases the Docker tests build on, made before a run (`make test-bases`, a phase of .ci/run).

`make test` makes them too, in its first fixtures; made beforehand they are made on an idle machine, and
every group of tests starts its own builds at once instead of waiting for the busy worker that makes them.
The same locks as the fixtures' (tests/support/once.py): a run started meanwhile waits, then finds them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Callable

from tests.support.docker import image_id
from tests.support.gitsource import ensure_torch_base
from tests.support.once import one_at_a_time
from tests.support.paths import ARM64_BASE, BASE, ROOT


def ensure_base_local() -> str:
    """The local Debian base (scripts/base-local.sh: debootstrap and docker import) when it is missing."""
    with one_at_a_time("base-local"):
        if not image_id(BASE):
            subprocess.run(["bash", str(ROOT / "scripts" / "base-local.sh"), BASE], check=True, timeout=1800)
    return BASE


def ensure_arm64_base() -> str:
    """The local Debian base for arm64 (trixie, made under QEMU by scripts/base-local.sh) when it is missing."""
    with one_at_a_time("base-arm64"):
        if not image_id(ARM64_BASE):
            subprocess.run(["bash", str(ROOT / "scripts" / "base-local.sh"), ARM64_BASE], check=True, timeout=3600,
                           env=dict(os.environ, BASE_SUITE="trixie", BASE_ARCH="arm64"))
    return ARM64_BASE


def ensure_torch(work: Path) -> str:
    """The local base plus a CPU torch and numpy (tests/support/gitsource.py) when it is missing."""
    with one_at_a_time("torch-base"):
        return ensure_torch_base(ensure_base_local(), work)


def main() -> int:
    """The x86-64 bases one after the other, the arm64 base beside them (it waits on QEMU, they on the disk)."""
    work = Path(tempfile.mkdtemp(prefix="sparkforge-test-bases-"))
    arm64: list[BaseException] = []

    def make_arm64() -> None:
        try:
            made("arm64 base", ensure_arm64_base)
        except BaseException as exc:  # noqa: BLE001 - said once the others are made
            arm64.append(exc)

    beside = threading.Thread(target=make_arm64, name="arm64-base", daemon=True)
    beside.start()
    try:
        made("local base", ensure_base_local)
        made("torch base", lambda: ensure_torch(work))
        beside.join()
        if arm64:
            raise arm64[0]
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError, OSError) as exc:
        print(f"test-bases: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("test-bases: interrupted; a base half-made is not tagged, and the next run makes it", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def made(name: str, make: Callable[[], str]) -> None:
    t0 = time.monotonic()
    image = make()
    print(f"test-bases: the {name} {image} is there ({time.monotonic() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
