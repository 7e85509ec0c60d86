"""The wheel set of a variant: every wheel its pip install takes, resolved for the image's platform.

uv resolves for another platform from the index's metadata alone, without downloading the wheels (4.4 GB for
vLLM 0.33.0 on aarch64); a distribution without a wheel for the platform would compile at build time: refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from packaging import tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from ..inimage import proc
from .plan import Plan, PythonTarget, WheelPin
from .fields import SHA256_RE
from .sources import index_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

RESOLVE_TIMEOUT = 900.0  # seconds: uv reads a few hundred index pages; more is a hung index
# The oldest manylinux of each architecture, and the legacy names of glibc 2.17, 2.12 and 2.5 (PEP 600).
OLDEST_GLIBC_MINOR = {"aarch64": 17, "x86_64": 5}
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


class Unresolvable(Exception):
    """The wheel set cannot be resolved from here; the message says why."""


@dataclass(frozen=True)
class WheelSet:
    """A resolved wheel set and who resolved it."""

    python: PythonTarget
    resolver: str  # e.g. "uv 0.13.8"
    packages: tuple[WheelPin, ...]

    @property
    def download(self) -> int:
        """Bytes pip downloads for the set: the wheel it picks of each distribution."""
        return download_bytes(self.packages)


def download_bytes(packages: Iterable[WheelPin]) -> int:
    return sum(p.files[0][2] for p in packages if p.files)


def platforms(target: PythonTarget) -> list[str]:
    """The platform tags pip takes on the target, most preferred first (every manylinux down, then linux)."""
    arch, _, manylinux = target.platform.partition("-")
    newest = int(manylinux.rsplit("_", 1)[1])
    found = []
    for minor in range(newest, OLDEST_GLIBC_MINOR[arch] - 1, -1):
        found.append(f"manylinux_2_{minor}_{arch}")
        if minor in LEGACY_MANYLINUX:
            found.append(f"{LEGACY_MANYLINUX[minor]}_{arch}")
    return [*found, f"linux_{arch}"]


def preference(target: PythonTarget) -> list[tags.Tag]:
    """The wheel tags pip takes on the target, most preferred first (the order pip picks in)."""
    platforms_ = platforms(target)
    version = tuple(int(x) for x in target.version.split("."))
    return [*tags.cpython_tags(version, platforms=platforms_), *tags.compatible_tags(version, platforms=platforms_)]


def read_pylock(text: str, target: PythonTarget) -> tuple[WheelPin, ...]:
    """The wheel set of uv's pylock.toml (PEP 751): per distribution the wheels pip may pick, most preferred first."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Unresolvable(f"the resolver wrote no readable pylock.toml: {exc}") from None
    rank = {tag: i for i, tag in enumerate(preference(target))}
    pins = []
    for package in data.get("packages", []):
        name, version = canonicalize_name(str(package.get("name", ""))), str(package.get("version", ""))
        files = sorted(f for f in (_wheel(w, rank) for w in package.get("wheels", [])) if f is not None)
        if not files:
            raise Unresolvable(f"{name} {version} has no wheel for Python {target.version} on {target.platform}: "
                               "pip would compile it from source")
        pins.append(WheelPin(name, version, tuple(f[1:] for f in files)))
    return tuple(sorted(pins, key=lambda p: p.name))


def _wheel(entry: Any, rank: dict[tags.Tag, int]) -> tuple[int, str, str, int] | None:
    """(rank, file name, sha256, size) of a pylock wheel entry the target takes, or None."""
    filename = str(entry.get("url", "")).rsplit("/", 1)[-1]
    try:
        _, _, _, wheel_tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    best = min((rank[t] for t in wheel_tags if t in rank), default=None)
    sha = str((entry.get("hashes") or {}).get("sha256", ""))
    size = entry.get("size")
    if best is None or not SHA256_RE.fullmatch(sha) or not isinstance(size, int):
        return None
    return best, filename, sha, size


def requirements(plan: Plan) -> list[str]:
    """What the wheel set is resolved from: the vLLM release and the pip components, as pinned by the recipe."""
    return [f"{plan.vllm.package}=={plan.vllm.version}"] + [c.requirement for c in plan.components if c.kind == "pip"]


def overrides(plan: Plan) -> list[str]:
    """What the resolution leaves out (protected packages, python.leave_out): an override with a marker that never
    holds drops the package and what only it needs (torch's CUDA libraries)."""
    names = [name.split("[")[0] for name in plan.protect] + list(plan.python.leave_out if plan.python else ())
    return [f'{name} ; sys_platform == "never"' for name in names]


def _run(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """A run of uv that gives up after timeout; it is stopped with us on Ctrl-C."""
    try:
        return proc.run(cmd, what=f"uv {' '.join(cmd[1:3])}", capture_output=True, text=True, timeout=timeout, **kw)
    except proc.CommandError as exc:
        raise Unresolvable(str(exc)) from None


def resolve_wheel_set(plan: Plan, *, ca_cert: Path | None = None, timeout: float = RESOLVE_TIMEOUT) -> WheelSet:
    """Resolve the plan's wheel set with uv for plan.python from the index alone (ca_cert: a proxy's CA bundle)."""
    target = plan.python
    if target is None:
        raise Unresolvable("the recipe names no python: {version, platform} to resolve for")
    try:  # the uv of the project environment (the `uv` package of requirements.lock)
        from uv import find_uv_bin
    except ImportError:
        raise Unresolvable("uv is not installed in the project environment (make venv installs it from "
                           "requirements.lock)") from None
    uv = [find_uv_bin()]
    # uv's settings come from this command line alone: no uv.toml (--no-config), no UV_* variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    if ca_cert is not None:
        env["SSL_CERT_FILE"] = str(ca_cert)
    version = _run([*uv, "--version"], 60, env=env).stdout.split()
    with tempfile.TemporaryDirectory(prefix="sparkforge-wheelset-") as tmp:
        reqs, out = Path(tmp) / "requirements.in", Path(tmp) / "pylock.toml"
        reqs.write_text("".join(r + "\n" for r in requirements(plan)))
        cmd = [*uv, "pip", "compile", str(reqs), "--output-file", str(out), "--format", "pylock.toml",
               "--python-platform", target.platform, "--python-version", target.version, "--no-config",
               "--no-header", "--quiet", "--index-url", index_url(), "--no-build"]
        if not plan.vllm.install_deps:
            cmd.append("--no-deps")
        elif overrides(plan):
            (Path(tmp) / "overrides.txt").write_text("".join(o + "\n" for o in overrides(plan)))
            cmd += ["--override", str(Path(tmp) / "overrides.txt")]
        done = _run(cmd, timeout, env=env, cwd=tmp)
        if done.returncode != 0:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            raise Unresolvable(f"uv pip compile failed: {' '.join(lines[-3:]) or f'exit code {done.returncode}'}")
        packages = read_pylock(out.read_text(encoding="utf-8"), target)
    return WheelSet(target, " ".join(version[:2]) or "uv", packages)


def requirements_txt(packages: Iterable[WheelPin]) -> str:
    """The set as a pip requirements file for --require-hashes (every wheel pip may pick)."""
    lines = []
    for p in packages:
        hashes = "".join(f" \\\n    --hash=sha256:{sha}" for _, sha, _ in p.files)
        lines.append(f"{p.name}=={p.version}{hashes}\n")
    return "".join(lines)
