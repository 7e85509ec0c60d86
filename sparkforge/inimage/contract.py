"""The documents that cross between the host and the image, typed and versioned in one place.

Both sides import this module: the image as `inimage.contract`, the host as
`sparkforge.inimage.contract`. Every document carries `schema`; `from_json` refuses an unknown
version or a missing field in one line. A document an older sparkforge wrote has no `schema`
field; it is read as version 0, which holds the same fields, so such images still inspect.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

SCHEMA = 1
READABLE = (0, SCHEMA)  # 0: written before documents carried a version


class ContractError(ValueError):
    """A document does not follow the contract: its version is unknown or a field is missing."""


class JsonError(ValueError):
    """A JSON text the tool does not read: malformed, a key written twice in one object, NaN or Infinity
    (no JSON numbers), or nested deeper than the parser goes."""


def parse_json(text: str | bytes) -> Any:
    """JSON as sparkforge reads every JSON file and answer (locks, records, cache entries, documents, a
    registry's replies): Python's json would keep the last of two equal keys silently and take NaN."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise JsonError("nested too deeply to read") from None
    except JsonError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonError(f"line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:  # bytes that are not UTF-8, an integer of over 4300 digits
        raise JsonError(str(exc)) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonError(f"key {key!r} is written twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JsonError(f"{name} is not a JSON number")


class ModState(str, Enum):
    """What applying a mod did."""

    APPLIED = "applied"
    ALREADY = "already"
    FAILED = "failed"


class CheckState(str, Enum):
    """The outcome of a verify check or a smoke check."""

    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


class WheelOrigin(str, Enum):
    """Where the vLLM wheel an image installed came from."""

    COMPILED = "compiled"
    CACHE = "cache"
    RECIPE = "recipe"


class Phase(str, Enum):
    SOURCE = "source"
    INSTALL = "install"


class ModKind(str, Enum):
    PATCH = "patch"
    PATCHER = "patcher"
    FILES = "files"


def read_versioned(text: str | bytes, where: str) -> dict:
    """A document the host writes for the image as a plain mapping (plan.json, a mod's mod.json),
    refused in one line when it is not JSON, not a mapping, or of a version this side cannot read."""
    try:
        data = parse_json(text)
    except JsonError as exc:
        raise ContractError(f"{where}: unreadable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ContractError(f"{where}: not a JSON object")
    if data.get("schema", 0) not in READABLE:
        raise ContractError(f"{where}: schema {data.get('schema')!r} is not one this sparkforge reads ({SCHEMA})")
    return data


class _Document:
    """to_json/from_json for a frozen dataclass; ENUMS names the fields held as an Enum, NESTED
    the fields holding a list of another document."""

    NAME: ClassVar[str] = "document"
    ENUMS: ClassVar[dict[str, type[Enum]]] = {}
    NESTED: ClassVar[dict[str, type]] = {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Enum):
                value = value.value
            elif f.name in self.NESTED:
                value = [item.to_dict() for item in value]
            out[f.name] = value
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str = ""):
        where = where or cls.NAME
        if not isinstance(data, dict):
            raise ContractError(f"{where}: not a JSON object")
        schema = data.get("schema", 0)
        if schema not in READABLE:
            raise ContractError(f"{where}: schema {schema!r} is not one this sparkforge reads ({SCHEMA}); "
                                "it was written by a newer sparkforge")
        values: dict[str, Any] = {"schema": schema}
        for f in dataclasses.fields(cls):
            if f.name == "schema":
                continue
            if f.name not in data:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                old = " (written by an older sparkforge: rebuild the image)" if schema == 0 else ""
                raise ContractError(f"{where}: field {f.name!r} is missing{old}")
            value = data[f.name]
            if f.name in cls.ENUMS and value is not None:
                try:
                    value = cls.ENUMS[f.name](value)
                except ValueError:
                    raise ContractError(f"{where}: {f.name} {value!r} is not one of "
                                        f"{', '.join(e.value for e in cls.ENUMS[f.name])}") from None
            elif f.name in cls.NESTED:
                if not isinstance(value, list):
                    raise ContractError(f"{where}: {f.name} is not a list")
                value = tuple(cls.NESTED[f.name].from_dict(v, f"{where}: {f.name}[{i}]") for i, v in enumerate(value))
            values[f.name] = value
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = ""):
        try:
            data = parse_json(text)
        except JsonError as exc:
            raise ContractError(f"{where or cls.NAME}: unreadable JSON: {exc}") from None
        return cls.from_dict(data, where)


@dataclass(frozen=True)
class ModResult(_Document):
    """What applying one mod did in the image: record/mods/NN-NAME.json."""

    NAME: ClassVar[str] = "mod result"
    ENUMS: ClassVar[dict[str, type[Enum]]] = {"result": ModState, "phase": Phase}

    name: str
    result: ModState
    phase: Phase
    root: str
    schema: int = SCHEMA


@dataclass(frozen=True)
class WheelNote(_Document):
    """The vLLM wheel an image installed: record/vllm-wheel.json."""

    NAME: ClassVar[str] = "wheel note"
    ENUMS: ClassVar[dict[str, type[Enum]]] = {"origin": WheelOrigin}

    origin: WheelOrigin
    filename: str
    sha256: str
    cache_key: str | None
    compiled_for: str | None
    schema: int = SCHEMA


@dataclass(frozen=True)
class RecordedMod(_Document):
    """A mod as the build record names it: its digest, phase and result (and a fetched patch's origin)."""

    NAME: ClassVar[str] = "recorded mod"
    ENUMS: ClassVar[dict[str, type[Enum]]] = {"result": ModState, "phase": Phase}

    name: str
    digest: str
    phase: Phase
    result: ModState | None
    patch: dict | None = None
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.patch is None:
            out.pop("patch")
        return out


@dataclass(frozen=True)
class BuildRecord(_Document):
    """What an image says about itself: /opt/sparkforge/build-record.json. The plan's own parts
    (base, vllm, components, build) are kept as the plan wrote them."""

    NAME: ClassVar[str] = "build record"
    NESTED: ClassVar[dict[str, type]] = {"mods": RecordedMod}

    variant: str
    chain: list
    tag: str
    plan_hash: str
    base: dict
    vllm: dict
    components: list
    installed: dict
    mods: tuple[RecordedMod, ...]
    protected: dict
    build: dict
    env: list
    built_at: str
    python: str
    tool_version: str
    unpinned: list
    packages: dict | None = None
    source_date_epoch: int | None = None
    kernels: dict | None = None  # the kernel scan (kernels.py): each CUDA extension's cubins and PTX
    schema: int = SCHEMA

    @property
    def wheel(self) -> WheelNote | None:
        """The wheel the image installed, when the image recorded one."""
        note = self.vllm.get("installed_wheel")
        return WheelNote.from_dict(note, f"{self.NAME}: vllm.installed_wheel") if note else None


@dataclass(frozen=True)
class SmokeCheck(_Document):
    """One check of a smoke tier, one JSON line each on the tool's output."""

    NAME: ClassVar[str] = "smoke check"
    ENUMS: ClassVar[dict[str, type[Enum]]] = {"state": CheckState}

    check: str
    state: CheckState
    detail: str = ""
    schema: int = SCHEMA


@dataclass(frozen=True)
class Result:
    """One mod applied: its state, and for a failure the reason (naming the file or hunk)."""

    mod: str
    state: ModState
    detail: str = field(default="")

    def line(self) -> str:
        text = {ModState.APPLIED: "applied", ModState.ALREADY: "already applied, skipped",
                ModState.FAILED: "FAILED"}[self.state]
        return f"mod {self.mod}: {text}" + (f": {self.detail}" if self.detail else "")
