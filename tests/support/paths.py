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
