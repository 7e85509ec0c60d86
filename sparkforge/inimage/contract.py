"""The documents the image writes back to the host (mod result, wheel note, build record, smoke check), typed.

Both sides import it (`inimage.contract`, `sparkforge.inimage.contract`); what the host hands the image is in
seam.py. Each document has its own version (its `schema` field); a record written before documents carried one
is read as version 0, which holds the same fields, so images built then still inspect.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, TypeVar, Union

RESULT_VERSION = 1  # record/mods/NN-NAME.json
WHEEL_VERSION = 1  # record/vllm-wheel.json
RECORD_VERSION = 1  # build-record.json, and each mod entry in it
SMOKE_VERSION = 1  # a smoke check's line
KERNELS_FORMAT = 3  # record/kernels.json (its field `format`): 3 added relocatable code and coverage's `kernels`
OLD_OR = (0, 1)  # 0: written before documents carried a version, with the fields of version 1


class ContractError(ValueError):
    """A document does not follow the contract: its version is unknown or a field is missing."""


class JsonError(ValueError):
    """A JSON text the tool does not read: malformed, a key written twice, NaN or Infinity, or nested too deep."""


def parse_json(text: str | bytes) -> Any:
    """JSON as sparkforge reads every JSON file and answer (Python's json keeps the last of two keys, takes NaN)."""
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


D = TypeVar("D", bound="Document")
_HINTS: dict[type, dict[str, Any]] = {}
_JSON_KINDS = ((bool, "true or false"), (int, "a number"), (float, "a number"), (str, "a string"),
               (list, "a list"), (dict, "an object"), (type(None), "null"))


class Document:
    """to_dict/to_json and from_dict/from_json for a frozen dataclass, by its field types read at run time.

    READABLE lists the versions of a `schema` field this side reads (0: none written). OPEN documents ignore keys
    they do not know (a newer writer's); the others refuse them, so a renamed field is never a default taken."""

    NAME: ClassVar[str] = "document"
    READABLE: ClassVar[tuple[int, ...]] = ()
    OPEN: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        # Every Document is a frozen dataclass; the checker sees only the mixin, which is not one.
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls: type[D], data: object, where: str = "", path: str = "") -> D:
        """The document data holds; where names the file (or answer) in every error, path the place in it."""
        where = where or cls.NAME
        at = f"{where}: {path}" if path else where
        if not isinstance(data, dict):
            raise ContractError(f"{at} is {_kind(data)}, not an object")
        hints = _hints(cls)
        schema = _version(cls, data, at) if "schema" in hints else None
        values: dict[str, Any] = {} if schema is None else {"schema": schema}  # 0 where none is written
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # a Document subclass is a dataclass
            if f.name in values:
                continue
            if f.name not in data:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                old = " (written by an older sparkforge: rebuild the image)" if schema == 0 else ""
                raise ContractError(f"{at}: field {f.name!r} is missing{old}")
            values[f.name] = _read(data[f.name], hints[f.name], where, f"{path}.{f.name}" if path else f.name)
        unknown = [] if cls.OPEN else sorted(set(data) - set(hints))
        if unknown:  # after the missing ones: a field renamed on the writer's side is named as missing
            raise ContractError(f"{at}: field {unknown[0]!r} is not one this sparkforge reads")
        return cls(**values)

    @classmethod
    def from_json(cls: type[D], text: str | bytes, where: str = "") -> D:
        try:
            data = parse_json(text)
        except JsonError as exc:
            raise ContractError(f"{where or cls.NAME}: unreadable JSON: {exc}") from None
        return cls.from_dict(data, where)


def _hints(cls: type) -> dict[str, Any]:
    """The field types of a document class, resolved once (its annotations are strings)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _version(cls: type[Document], data: dict[str, Any], at: str) -> int:
    """The document's version, when it is one cls reads; else ContractError saying which side is newer."""
    version = data.get("schema", 0)
    if type(version) is int and version in cls.READABLE:
        return version
    known = ", ".join(str(v) for v in cls.READABLE if v)
    if "schema" not in data:
        raise ContractError(f"{at}: field 'schema' is missing: a document without a version, which this sparkforge "
                            f"does not read (it reads version {known})")
    newer = type(version) is not int or version > max(cls.READABLE)
    raise ContractError(f"{at}: schema {version!r} is not one this sparkforge reads ({known}); it was written by "
                        f"{'a newer' if newer else 'an older'} sparkforge")


def _kind(value: object) -> str:
    """What a JSON value is, in words."""
    return next((name for kind, name in _JSON_KINDS if isinstance(value, kind)), type(value).__name__)


def _read(value: object, hint: Any, where: str, path: str) -> Any:
    """value as the type hint says (a JSON list becomes a tuple where the field is one), or ContractError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # a field is one type, or that type or null
        return _read(value, inner, where, path)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            raise ContractError(f"{where}: {path} {value!r} is not one of "
                                f"{', '.join(str(e.value) for e in hint)}") from None
    if isinstance(hint, type) and issubclass(hint, Document):
        return hint.from_dict(value, where, path)
    want = origin or hint
    expected = next(name for kind, name in _JSON_KINDS if kind is (list if want is tuple else want))
    if not isinstance(value, list if want is tuple else want) or (want in (int, float) and isinstance(value, bool)):
        raise ContractError(f"{where}: {path} is {_kind(value)}, not {expected}")
    if want is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ContractError(f"{where}: {path} holds {len(value)} items, not {len(args)}")
        return tuple(_read(v, a, where, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if want in (tuple, list) and args:
        items = [_read(v, args[0], where, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if want is tuple else items
    if want is dict and args and isinstance(value, dict):  # checked above; this says it to the type checker
        return {k: _read(v, args[1], where, f"{path}.{k}") for k, v in value.items()}
    return value


def _plain(value: object) -> Any:
    """A field's value as JSON holds it."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Document):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class ModResult(Document):
    """What applying one mod did in the image: record/mods/NN-NAME.json."""

    NAME: ClassVar[str] = "mod result"
    READABLE: ClassVar[tuple[int, ...]] = OLD_OR

    name: str
    result: ModState
    phase: Phase
    root: str
    schema: int = RESULT_VERSION


@dataclass(frozen=True)
class WheelNote(Document):
    """The vLLM wheel an image installed: record/vllm-wheel.json."""

    NAME: ClassVar[str] = "wheel note"
    READABLE: ClassVar[tuple[int, ...]] = OLD_OR

    origin: WheelOrigin
    filename: str
    sha256: str
    cache_key: str | None
    compiled_for: str | None
    schema: int = WHEEL_VERSION


@dataclass(frozen=True)
class RecordedMod(Document):
    """A mod as the build record names it: its digest, phase and result (and a fetched patch's origin)."""

    NAME: ClassVar[str] = "recorded mod"
    READABLE: ClassVar[tuple[int, ...]] = OLD_OR

    name: str
    digest: str
    phase: Phase
    result: ModState | None
    patch: dict[str, Any] | None = None
    schema: int = RECORD_VERSION

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.patch is None:
            out.pop("patch")
        return out


@dataclass(frozen=True)
class GpuCoverage(Document):
    """What one GPU cannot run of its major's device code: its kernels (None: unknown), how many no code it runs
    holds, two of their names, the targets holding them, and the targets whose names are unread."""

    NAME: ClassVar[str] = "kernel coverage"

    kernels: int | None = None
    missing: int = 0
    examples: tuple[str, ...] = ()
    only_in: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()


@dataclass(frozen=True)
class KernelExtension(Document):
    """One shared library with device code: its targets and coverage per GPU, or why they could not be read."""

    NAME: ClassVar[str] = "kernel record"

    path: str
    cubins: tuple[str, ...]
    ptx: tuple[str, ...]
    relocatable: tuple[str, ...] = ()
    coverage: dict[str, GpuCoverage] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class KernelRecord(Document):
    """The kernel scan (kernels.py): record/kernels.json and the build record's `kernels`; an older `format` lacks
    fields, read with their defaults."""

    NAME: ClassVar[str] = "kernel record"

    extensions: tuple[KernelExtension, ...]
    without_device_code: int
    gpus: tuple[str, ...] = ()
    not_needed: tuple[str, ...] = ()
    dists: dict[str, int] = field(default_factory=dict)  # per scanned distribution, its extensions with device code
    format: int = KERNELS_FORMAT


@dataclass(frozen=True)
class Unpinned(Document):
    """A value the plan does not pin yet, and the reason: in plan.json and in the build record."""

    NAME: ClassVar[str] = "unpinned value"
    OPEN: ClassVar[bool] = False

    field: str
    reason: str


@dataclass(frozen=True)
class BuildRecord(Document):
    """What an image says about itself: /opt/sparkforge/build-record.json. The plan's parts are kept as plan.json
    holds them, and read as JSON (an image of any age may be inspected)."""

    NAME: ClassVar[str] = "build record"
    READABLE: ClassVar[tuple[int, ...]] = OLD_OR

    variant: str
    chain: list[str]
    tag: str
    plan_hash: str
    base: dict[str, Any]
    vllm: dict[str, Any]
    components: list[Any]
    installed: dict[str, str | None]  # each component's package (and vllm): its version, or None: not installed
    mods: tuple[RecordedMod, ...]
    protected: dict[str, str]
    build: dict[str, Any]
    env: tuple[tuple[str, str], ...]
    built_at: str
    python: str
    tool_version: str
    unpinned: tuple[Unpinned, ...]
    packages: dict[str, str] | None = None
    source_date_epoch: int | None = None
    kernels: KernelRecord | None = None
    machine: str | None = None  # the machine the image's Python ran on when it wrote this (aarch64, x86_64)
    schema: int = RECORD_VERSION

    @property
    def wheel(self) -> WheelNote | None:
        """The wheel the image installed, when the image recorded one."""
        note = self.vllm.get("installed_wheel")
        return WheelNote.from_dict(note, self.NAME, "vllm.installed_wheel") if note else None


@dataclass(frozen=True)
class SmokeCheck(Document):
    """One check of a smoke tier, one JSON line each on the tool's output."""

    NAME: ClassVar[str] = "smoke check"
    READABLE: ClassVar[tuple[int, ...]] = OLD_OR

    check: str
    state: CheckState
    detail: str = ""
    schema: int = SMOKE_VERSION


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
