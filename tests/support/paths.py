"""Where the project and its test inputs are."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
MODS = ROOT / "mods"
TEST_MODS = ROOT / "tests" / "mods"  # mods that exist only for the tests
VARIANTS = ROOT / "tests" / "variants"
BASE = "sparkforge/base-local:bookworm"
# A Spark's architecture: Debian trixie for arm64 (glibc 2.41, Python 3.13), made under QEMU.
ARM64_BASE = "sparkforge/base-local:trixie-arm64"
CA = "/etc/ssl/certs/ca-certificates.crt"


def shipped_files(folder: Path) -> set[Path] | None:
    """The files of folder that the project ships (git's tracked files), so that a test reads none that a user
    made there (a lock, a variant of their own); None where ROOT is no git checkout (then every file counts)."""
    import subprocess

    proc = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", str(folder.relative_to(ROOT))],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    return {ROOT / name for name in proc.stdout.split("\0") if name}
