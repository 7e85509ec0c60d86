"""Config stage: read recipes (images/*.yaml) and mods (mods/*/mod.yaml) into validated data; the only YAML reader."""

from __future__ import annotations

import contextlib
import stat
from pathlib import Path
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from pydantic import ValidationError

from .. import inimage
from ..errors import ConfigError, Hint
from ..files import read_regular
from ..inimage.contract import ModKind, Phase
from ..inimage.seam import ModDoc, ModFileDoc, PatchOrigin, VerifyDoc
from .fields import MAX_TAG, MAX_VARIANT, NAME_RE, Name
from .schema import ModSpec, RecipeFile, RemotePatch, Strict

# The file name a patch fetched by URL takes beside the mod's own files (remote.materialize).
REMOTE_PATCH_FILE = "upstream.diff"


# libyaml's loader when PyYAML was built with it: the same safe subset, parsed several times faster. The
# type checker reads it as SafeLoader: both are a SafeConstructor, and that is all _Loader relies on.
if TYPE_CHECKING:
    _BASE_LOADER = yaml.SafeLoader
else:
    _BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
M = TypeVar("M", bound=Strict)
MAX_DEPTH = 64  # nested mappings and lists; a recipe needs 5. Deeper input would crash the parser's recursion.


class _DuplicateKey(Exception):
    """A key written twice in one mapping; the message names both lines."""


class _Loader(_BASE_LOADER):
    """The safe loader, refusing a key written twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                with contextlib.suppress(TypeError):  # an unhashable key: SafeConstructor refuses it in its own words
                    if key in seen:
                        raise _DuplicateKey(f"key {key!r} is written twice, on lines {seen[key]} and {line}; keep one")
                    seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_text(path: Path, missing: str = "file not found") -> str:
    """A file's text; a missing, unreadable, non-regular (a FIFO) or non-UTF-8 file is one line naming it."""
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        raise ConfigError(missing, path=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", path=path) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}; save the file as UTF-8",
                          path=path) from None


def read_yaml(path: Path) -> Any:
    """Parse one YAML file; a parse error, a key written twice or nesting past MAX_DEPTH is one line naming it."""
    text = read_text(path)
    try:
        _check_depth(text, path)
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as exc:
        raise ConfigError(str(exc), path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"malformed YAML: {where}{problem}", path=path) from None


def _check_depth(text: str, path: Path) -> None:
    loader = _BASE_LOADER(text)
    depth = 0
    try:
        while loader.check_event():
            # types-PyYAML leaves Parser.get_event unannotated (CParser's gives Event | None).
            event = loader.get_event()  # type: ignore[no-untyped-call]
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (line {line}); a recipe, mod or "
                                      "cluster file needs a handful", path=path)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    finally:
        loader.dispose()


_NO_DATA = object()


def field_path(loc: tuple[Any, ...], data: Any = _NO_DATA) -> str:
    """A pydantic error location in the user's terms: `mods[0]`, `components.cutlass.ref`."""
    # pydantic puts the union branch it tried (`list[function-after[check(), str]]`, `none`, ...)
    # into the location. Walking the input alongside keeps only the keys and indexes the user
    # wrote; without the input, the parts that name a branch are dropped.
    out = ""
    node = data
    for part in loc:
        if data is not _NO_DATA and isinstance(node, dict) and part in node:
            node = node[part]
        elif data is not _NO_DATA and isinstance(node, list) and isinstance(part, int):
            node = node[part] if 0 <= part < len(node) else None
        elif _is_branch(part) or (data is not _NO_DATA and not isinstance(node, dict)):
            continue
        else:
            node = None  # a key the user did not write: a missing field
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_branch(part: Any) -> bool:
    """A location part that names a type pydantic tried, not a key the user wrote."""
    return isinstance(part, str) and (part in _UNION_BRANCHES or any(c in part for c in "[](),' "))


# The union members of the schemas below, as pydantic names them in a location.
_UNION_BRANCHES = {"str", "int", "bool", "float", "none", "Unknown", "ModChanges", "ComponentSpec", "RemotePatch",
                   "Unresolved"}
# The pydantic error types whose message a user reads better in plain words.
_PLAIN = {"extra_forbidden": "unknown key", "missing": "required field is missing"}


def validation_error(exc: ValidationError, path: Path, data: Any = _NO_DATA, hint: Hint | None = None) -> ConfigError:
    """One ConfigError for a pydantic error: the field in the user's terms and what is wrong."""
    errors = exc.errors()
    # Of the branches of a union, report the one the user meant: a value error over a type mismatch.
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    msg = _PLAIN.get(err["type"]) or err["msg"].removeprefix("Value error, ")
    if err["type"] == "string_type" and path.suffix in (".yaml", ".yml"):
        msg = f"expected a string, got {type(err['input']).__name__} (quote numbers in YAML)"
    elif err["type"].endswith("_type"):
        msg = f"{msg}, got {type(err['input']).__name__}"
    return ConfigError(msg, path=path, field=field_path(tuple(err["loc"]), data) or None, hint=hint)


def validated(model: type[M], data: Any, path: Path) -> M:
    """data read into model; a fault is one ConfigError naming path and the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path, data) from None


def load_mod(mods_dir: Path, name: str, *, used_by: Path | None = None) -> tuple[ModSpec, Path]:
    """Load mods/<name>/mod.yaml and check that every asset it names exists."""
    folder = mods_dir / name
    meta = folder / "mod.yaml"
    try:
        if not stat.S_ISREG(meta.stat().st_mode):  # a folder or a FIFO by that name is no mod.yaml either
            raise FileNotFoundError
    except OSError as exc:
        why = f": {exc.strerror}" if exc.strerror and not isinstance(exc, FileNotFoundError) else ""
        raise ConfigError(f"unknown mod {_clip(name)!r}: {_clip(str(meta))} does not exist{why}", path=used_by or meta,
                          field="mods") from None
    data = read_yaml(meta)
    if not isinstance(data, dict):
        raise ConfigError("mod.yaml must be a YAML mapping", path=meta)
    spec = validated(ModSpec, data, meta)
    if spec.name != name:
        raise ConfigError(f"name {spec.name!r} differs from the folder name {name!r}", path=meta, field="name")
    local_patch = spec.patch if isinstance(spec.patch, str) else None
    assets = [("patch", local_patch), ("patcher", spec.patcher)] + [("files", f.src) for f in spec.files]
    for field, rel in assets:
        if rel is not None and not (folder / rel).is_file():
            raise ConfigError(f"{rel!r} is not a file in {folder}", path=meta, field=field)
    if isinstance(spec.patch, RemotePatch) and (folder / REMOTE_PATCH_FILE).exists():
        raise ConfigError(f"{REMOTE_PATCH_FILE} is the name the fetched patch takes in the build; rename "
                          f"this mod's own file", path=folder / REMOTE_PATCH_FILE, field="patch")
    # A path outside its tree is refused before any build; a patch named by URL, once fetched (remote.materialize).
    try:
        inimage.check_static(mod_document(spec, local_patch), folder)
    except inimage.ModFailure as exc:
        raise ConfigError(str(exc), path=meta, field=spec.kind) from None
    return spec, folder


def mod_document(spec: ModSpec, patch: str | None, source: PatchOrigin | None = None) -> ModDoc:
    """The mod as the applier reads it (mod.json); source: where a fetched patch came from."""
    return ModDoc(name=spec.name, component=spec.component, phase=Phase(spec.phase), kind=ModKind(spec.kind),
                  patch=patch, patcher=spec.patcher,
                  files=tuple(ModFileDoc(src=f.src, dest=f.dest, mode=f.mode) for f in spec.files),
                  verify=tuple(VerifyDoc(file=v.file, contains=v.contains, python=v.python, needs=tuple(v.needs))
                               for v in spec.verify),
                  patch_source=source)


def _clip(text: str, most: int = 120) -> str:
    """A name as given, cut in the middle when it is far too long to be one."""
    return text if len(text) <= most else f"{text[:most - 40]}...{text[-30:]}"


class _ModDumper(yaml.SafeDumper):
    """Writes a text of several lines as a literal block, as mods are written by hand."""


_ModDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def mod_yaml_text(data: dict[str, Any], path: Path) -> str:
    """mod.yaml for data (checked against the schema first), in the order the keys are given."""
    validated(ModSpec, data, path)
    return yaml.dump(data, Dumper=_ModDumper, sort_keys=False, allow_unicode=True, width=110)


class Recipe(Strict):
    """A variant after `extends` is resolved: the merged recipe and the files it came from."""

    variant: Name
    chain: tuple[str, ...]  # the variant first, then its parent, grandparent, ...
    files: tuple[str, ...]  # the recipe files, in the same order
    data: RecipeFile


def recipe_path(images_dir: Path, name: str) -> Path:
    return images_dir / f"{name}.yaml"


def list_variants(images_dir: Path) -> list[str]:
    if not images_dir.is_dir():
        raise ConfigError("recipe folder not found", path=images_dir)
    return sorted(p.stem for p in images_dir.glob("*.yaml"))


def load_variant(images_dir: Path, name: str) -> Recipe:
    """Load a variant and its ancestors, and merge them parent first."""
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a variant name (lowercase letters, digits and '-')", path=images_dir)
    if len(name) > MAX_VARIANT:
        raise ConfigError(f"the variant name is {len(name)} characters long; its tag ({name[:12]}...-<12 hex>) "
                          f"would pass Docker's {MAX_TAG}: rename it to at most {MAX_VARIANT}",
                          path=recipe_path(images_dir, name), field="variant name")
    chain: list[str] = []
    paths: list[Path] = []
    files: list[RecipeFile] = []
    current: str | None = name
    while current is not None:
        path = recipe_path(images_dir, current)
        child_path = paths[-1] if paths else None
        if current in chain:
            cycle = " -> ".join(chain[chain.index(current):] + [current])
            raise ConfigError(f"extends forms a cycle: {cycle}", path=child_path, field="extends")
        if not path.exists():  # a FIFO or a folder by that name is refused when read, naming what it is
            if child_path is None:
                known = ", ".join(list_variants(images_dir)) or "none"
                raise ConfigError(f"unknown variant {name!r} (known: {known})", path=images_dir)
            raise ConfigError(f"unknown parent variant {current!r}: {path} does not exist",
                              path=child_path, field="extends")
        raw = read_yaml(path)
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError("a recipe must be a YAML mapping", path=path)
        files.append(validated(RecipeFile, raw or {}, path))
        chain.append(current)
        paths.append(path)
        current = files[-1].extends

    merged: dict[str, Any] = {}
    for recipe, path in zip(reversed(files), reversed(paths)):
        merged = _merge(merged, recipe.model_dump(exclude_unset=True), path)
    merged.pop("extends", None)
    data = validated(RecipeFile, merged, paths[0])  # a merge only recombines valid parts: a guard
    # Plans record each recipe relative to the recipe folder's parent, wherever the checkout lives, and by its own
    # name, not where a link leads (a recipe may be a link to a file elsewhere).
    folder = images_dir.resolve()
    shown = tuple((folder / p.name).relative_to(folder.parent).as_posix() for p in paths)
    return Recipe(variant=name, chain=tuple(chain), files=shown, data=data)


_REPLACED_WHOLE = {"digest", "commit"}


def _merge(parent: dict[str, Any], child: dict[str, Any], path: Path, where: str = "") -> dict[str, Any]:
    """A scalar overrides, a mapping merges (null deletes a key), a list replaces; `mods: {remove, add}` edits."""
    out = dict(parent)
    for key, value in child.items():
        if key == "mods" and not where and isinstance(value, dict):
            out["mods"] = _edit_mods(list(parent.get("mods") or []), value, path)
        elif value is None and where:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key not in _REPLACED_WHOLE:
            out[key] = _merge(out[key], value, path, f"{where}{key}.")
        else:
            out[key] = value
    return out


def _edit_mods(mods: list[str], change: dict[str, list[str]], path: Path) -> list[str]:
    for name in change.get("remove", []):
        if name not in mods:
            raise ConfigError(f"cannot remove {name!r}: the parent does not list it", path=path, field="mods.remove")
        mods.remove(name)
    for name in change.get("add", []):
        if name in mods:
            raise ConfigError(f"cannot add {name!r}: it is already listed", path=path, field="mods.add")
        mods.append(name)
    return mods
