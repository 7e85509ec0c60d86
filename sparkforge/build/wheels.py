"""The wheel cache, and the wheel a build installs without compiling (the recipe's, or a cached compile's).

A cache entry is used only when its key (`wheelkey`) is this build's and its wheel still has the sha256 it
recorded. The cache is a plain folder (<key>/entry.json + the wheel + the compile's records) machines can share.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BuildError, ConfigError
from ..files import NotRegularFile, name_path, read_regular, write_atomic
from ..inimage.contract import JsonError, parse_json
from ..recipe import download
from ..recipe.plan import Plan
from ..recipe.sources import cache_dir
from .wheelkey import CACHE_FORMAT, base_identity, cache_key, differences, key_inputs

CONTEXT = "vllm-wheel"  # the named build context the Dockerfile reads a wheel from
ENTRY_WHEEL_RE = re.compile(r"\Awheels/vllm-[A-Za-z0-9._+-]+\.whl\Z")  # where an entry keeps its wheel
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")
ENTRY = "entry.json"
MARKER = ".sparkforge-wheel-cache"  # in the root of every folder sparkforge made or used as a wheel cache
USED = ".last-used"  # a folder of the cache root: one file per key, touched on each use (never inside an entry,
# whose files are a build context: a change there would make BuildKit redo the install)


@dataclass(frozen=True)
class WheelInput:
    """A wheel the build installs instead of compiling, and where it came from."""

    origin: str  # "recipe": the recipe's `source: wheel`; "cache": an earlier compile's, from the wheel cache
    folder: Path  # given to BuildKit as the named context vllm-wheel
    wheel: str  # the wheel's path inside folder
    sha256: str
    key: str | None = None  # origin "cache": the cache key
    records: bool = False  # folder holds record/: the compile's commit and source-mod results
    compiled_for: str | None = None  # origin "cache": the build that compiled it, as "VARIANT-HASH12 at TIME"


@dataclass(frozen=True)
class Entry:
    """One wheel in the cache."""

    key: str
    folder: Path
    inputs: dict[str, Any]
    wheel: str  # path inside folder
    sha256: str
    size: int
    created: str
    compiled_for: str  # "VARIANT-HASH12 at TIME": the build that compiled it
    last_used: float

    @property
    def path(self) -> Path:
        return self.folder / self.wheel


def default_root() -> Path:
    return Path(os.environ.get("SPARKFORGE_WHEEL_CACHE") or cache_dir() / "wheels")


def claim(root: Path) -> None:
    """Make root (when need be) and mark it as a wheel cache, so that prune may later clean it."""
    root.mkdir(parents=True, exist_ok=True)
    marker = root / MARKER
    if not marker.exists():
        write_atomic(marker, b"This folder is a sparkforge wheel cache: `./build.py wheels list` shows it.\n")


def is_wheel_cache(root: Path) -> bool:
    """A folder sparkforge marked (or, older, that holds an entry or USED), an empty one or none; nothing else."""
    if not root.exists() or (root / MARKER).is_file() or (root / USED).is_dir():
        return True
    items = list(root.iterdir())
    return not items or any(read_entry(item) is not None for item in items if item.is_dir())


def _folders(root: Path) -> list[Path]:
    """The folders in root, sorted; none when root is not a folder."""
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def entries(root: Path) -> list[Entry]:
    """Every complete entry of the cache, newest first; half-written or foreign folders are skipped."""
    found = [read_entry(folder) for folder in _folders(root)]
    return sorted((e for e in found if e is not None), key=lambda e: e.created, reverse=True)


def scan(root: Path) -> tuple[list[Entry], list[tuple[str, str]]]:
    """The whole entries, newest first, and (folder name, why) of each folder with a damaged entry.json."""
    found, damaged = [], []
    for folder in _folders(root):
        if folder.name.startswith("."):
            continue
        entry = read_entry(folder)
        if entry is not None and entry.path.is_file():
            found.append(entry)
        elif (folder / ENTRY).exists() or entry is not None:
            damaged.append((folder.name, "its wheel is missing" if entry is not None else _why_damaged(folder)))
    return sorted(found, key=lambda e: e.created, reverse=True), damaged


def _why_damaged(folder: Path) -> str:
    try:
        data = parse_json(read_regular(folder / ENTRY))
    except OSError as exc:
        return f"{ENTRY} cannot be read ({exc.strerror or exc})"
    except NotRegularFile as exc:
        return f"{ENTRY} {exc.detail}"
    except JsonError as exc:
        return f"{ENTRY} cannot be read as JSON: {exc}"
    if not isinstance(data, dict):
        return f"{ENTRY} is not a JSON object"
    if data.get("format") != CACHE_FORMAT:
        return f"{ENTRY} is of another format ({str(data.get('format'))[:20]})"
    return f"{ENTRY} has missing or mistyped fields"


def read_entry(folder: Path) -> Entry | None:
    """The entry in folder, or None unless it is whole and well-formed (a shared folder may hold anything)."""
    try:
        data = parse_json(read_regular(folder / ENTRY))
        used_file = folder.parent / USED / folder.name
        used = (used_file if used_file.exists() else folder / ENTRY).stat().st_mtime
        entry = Entry(data["key"], folder, data["inputs"], data["wheel"], data["sha256"], data["size"],
                      data["created"], data["compiled_for"], used)
    except (OSError, ValueError, KeyError, TypeError, NotRegularFile):
        return None
    well_formed = (data.get("format") == CACHE_FORMAT and folder.name == entry.key and _HEX64.fullmatch(entry.key)
                   and _HEX64.fullmatch(str(entry.sha256)) and ENTRY_WHEEL_RE.fullmatch(str(entry.wheel))
                   and isinstance(entry.inputs, dict) and isinstance(entry.size, int) and _inputs_ok(entry.inputs)
                   and all(isinstance(x, str) and x.isprintable() for x in (entry.created, entry.compiled_for)))
    return entry if well_formed else None


def _inputs_ok(inputs: dict[str, Any]) -> bool:
    """The inputs fields a table shows have the types sparkforge writes."""
    vllm, mods = inputs.get("vllm", {}), inputs.get("source_mods", [])
    return (isinstance(vllm, dict) and isinstance(mods, list)
            and all(isinstance(m, dict) and isinstance(m.get("name"), str) for m in mods))


@dataclass(frozen=True)
class Lookup:
    """What the cache holds for a build: the wheel to install, or why the build compiles."""

    inputs: dict[str, Any] | None
    key: str | None
    wheel: WheelInput | None
    why_not: str  # when wheel is None: why the compile runs


def lookup(plan: Plan, root: Path, host: str | None = None) -> Lookup:
    """Find this build's wheel in the cache; the wheel is hash-checked before it is offered."""
    inputs, why = key_inputs(plan, base_identity(plan, host))
    if inputs is None:
        return Lookup(None, None, None, why)
    key = cache_key(inputs)
    entry = read_entry(root / key)
    if entry is None:
        return Lookup(inputs, key, None, _closest(inputs, root))
    if not _intact(entry):
        return Lookup(inputs, key, None, f"the cached wheel {key[:12]} no longer has its recorded sha256 (changed "
                                         "after it was stored); it is compiled again and replaced")
    mark_used(root, key)
    return Lookup(inputs, key, as_input(entry), "")


def as_input(entry: Entry) -> WheelInput:
    return WheelInput("cache", entry.folder, entry.wheel, entry.sha256, entry.key, records=True,
                      compiled_for=entry.compiled_for)


def mark_used(root: Path, key: str) -> None:
    """Note the entry's use, for `prune --older-than`; a cache this user cannot write is still read."""
    with contextlib.suppress(OSError):
        claim(root)
        (root / USED).mkdir(parents=True, exist_ok=True)
        (root / USED / key).touch()


def _closest(inputs: dict[str, Any], root: Path) -> str:
    same = [e for e in entries(root) if e.inputs.get("vllm") == inputs["vllm"]]
    if not same:
        return f"the wheel cache holds no wheel of vllm {inputs['vllm']['commit'][:12]}"
    best = min(same, key=lambda e: len(differences(inputs, e.inputs)))
    return f"the cached wheel {best.key[:12]} of this commit differs in " + "; ".join(differences(inputs, best.inputs))


def store(root: Path, inputs: dict[str, Any], exported: Path, compiled_for: str) -> Entry:
    """Move a compile's exported files into the cache as one entry, whole; an intact entry of the key stays."""
    key = cache_key(inputs)
    wheels_found = sorted((exported / "wheels").glob("vllm-*.whl"))
    if len(wheels_found) != 1 or not ENTRY_WHEEL_RE.fullmatch(f"wheels/{wheels_found[0].name}"):
        raise BuildError(f"the compile exported {[p.name for p in wheels_found]} to {exported}, not one vLLM wheel",
                         field="wheel cache")
    existing = read_entry(root / key)
    if existing is not None and _intact(existing):
        mark_used(root, key)
        return existing
    claim(root)
    staging = Path(tempfile.mkdtemp(prefix=f".{key[:12]}.", dir=root))
    try:
        for part in ("wheels", "record"):
            if (exported / part).is_dir():
                shutil.move(exported / part, staging / part)
        wheel = f"wheels/{wheels_found[0].name}"
        data = {"format": CACHE_FORMAT, "key": key, "inputs": inputs, "wheel": wheel,
                "sha256": download.sha256_of(staging / wheel), "size": (staging / wheel).stat().st_size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "compiled_for": compiled_for}
        (staging / ENTRY).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.chmod(staging, 0o755)
        if (root / key).exists():
            discard(root / key)  # a broken or changed entry of this key
        try:
            os.replace(staging, root / key)
        except OSError:  # another build stored the same key in the meantime
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        name_path(exc, root / key)  # a full disk names no file of its own
        raise
    entry = read_entry(root / key)
    if entry is None or not _intact(entry):
        raise BuildError(f"the entry {key[:12]} of the wheel cache {root} is not whole after it was stored (another "
                         "machine writing or pruning it?); build again", field="--wheel-cache")
    mark_used(root, key)
    return entry


def _intact(entry: Entry) -> bool:
    return entry.path.is_file() and download.sha256_of(entry.path) == entry.sha256


def discard(folder: Path) -> bool:
    """Rename a folder aside, then delete it: readers never see half of one. False if gone or not deleted whole."""
    trash = folder.parent / f".trash-{folder.name[:12]}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.replace(folder, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return not trash.exists()


LEFTOVER_HOURS = 24  # a compile of the image's own can take hours on a slow machine; a day is past any
_LEFTOVER_RE = re.compile(r"\A\.(export\.|trash-|[0-9a-f]{12}\.)")  # prepare_wheel's export, discard, store's staging


def refuse_foreign(root: Path) -> None:
    """Refuse to clean a folder that is not a wheel cache: prune removes folders there."""
    if not root.is_dir() and root.exists():
        raise ConfigError("is not a folder", path=root, field="--wheel-cache")
    if not is_wheel_cache(root):
        raise ConfigError(f"is not a wheel cache (no {MARKER}, no entry); prune removes only what sparkforge put in "
                          "one, so it touches nothing here", path=root, field="--wheel-cache")


def leftovers(root: Path) -> list[Path]:
    """Folders a killed build or prune left in the cache, untouched for LEFTOVER_HOURS (a younger one may be
    a running build's, here or on a machine that shares the cache)."""
    if not root.is_dir() or not is_wheel_cache(root):
        return []
    found = []
    for folder in _folders(root):
        with contextlib.suppress(OSError):  # gone meanwhile
            if _LEFTOVER_RE.match(folder.name) and not folder.is_symlink() \
                    and time.time() - folder.stat().st_mtime > LEFTOVER_HOURS * 3600:
                found.append(folder)
    return found


def folder_size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # gone meanwhile
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


def remove_leftovers(found: list[Path]) -> list[Path]:
    """Remove each folder; the ones that are gone now (a folder another user owns may stay)."""
    gone = []
    for folder in found:
        try:
            if discard(folder):
                gone.append(folder)
        except OSError as exc:
            raise BuildError(f"cannot remove {folder}: {exc.strerror or exc}", field="wheels prune") from None
    return gone


def prune(root: Path, *, older_than_days: float | None = None, key: str | None = None,
          dry_run: bool = False) -> list[Entry]:
    """Remove entries not used for older_than_days, or the one whose key starts with `key`, or (neither) all."""
    refuse_foreign(root)
    now = time.time()
    chosen = [e for e in entries(root)
              if (key is None or e.key.startswith(key))
              and (older_than_days is None or now - e.last_used > older_than_days * 86400)]
    if key is not None and len(chosen) != 1:
        raise ConfigError(f"{len(chosen)} wheels in {root} have a key starting with {key!r}; give one that names "
                          "exactly one (`wheels list`)", field="--key")
    if not dry_run:
        for entry in chosen:
            try:
                discard(entry.folder)
                (root / USED / entry.key).unlink(missing_ok=True)
            except OSError as exc:
                raise BuildError(f"cannot remove {entry.folder}: {exc.strerror or exc}", field="wheels prune") from None
    return chosen
