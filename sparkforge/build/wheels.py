"""The vLLM wheel a build installs without compiling: a prebuilt wheel the recipe names, or the wheel
an earlier compile with the very same inputs left in the wheel cache.

A compile's wheel is decided by the vLLM commit, the source-phase mods, the compile's environment
(`build.env`), the arch list, the base (digest, or its content on the build engine when the recipe pins none), the
commits of the git components the compile sees, and the template's compile step. Those inputs, as
canonical JSON, are hashed into the cache key; an entry is used only when its key is this build's key,
and its wheel only when the wheel's sha256 still matches what the entry recorded. The cache is a plain
folder (entry = <key>/entry.json + the wheel + the compile's records), so machines can share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ..errors import BuildError, ConfigError, DownloadError
from ..files import NotRegularFile, is_regular, name_path, read_regular, write_atomic
from ..inimage.contract import JsonError, parse_json
from ..recipe import download
from ..recipe.layout import Layout
from ..recipe.plan import Plan, WheelFile
from ..recipe.sources import cache_dir
from . import dockercli

CONTEXT = "vllm-wheel"  # the named build context the Dockerfile reads a wheel from
ENTRY_WHEEL_RE = re.compile(r"\Awheels/vllm-[A-Za-z0-9._+-]+\.whl\Z")  # where an entry keeps its wheel
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")
CACHE_FORMAT = 1
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


# ------------------------------------------------------------------ source: wheel


def planned_wheel(plan: Plan) -> WheelInput:
    """Where the recipe's wheel lies once fetched, without fetching it (render, dry runs)."""
    w = plan.vllm.wheel
    assert w is not None
    path = download.cached(w.sha256, w.filename)
    return WheelInput("recipe", path.parent, path.name, w.sha256)


def recipe_wheel(plan: Plan, layout: Layout, *, ca_cert: Path | None = None) -> WheelInput:
    """The recipe's prebuilt wheel, fetched (or copied) into the cache and checked (checked_wheel)."""
    w = plan.vllm.wheel
    assert w is not None
    path = checked_wheel(plan, layout.images_dir / f"{plan.variant}.yaml", ca_cert=ca_cert)
    return WheelInput("recipe", path.parent, path.name, w.sha256)


def checked_wheel(plan: Plan, recipe: Path, *, ca_cert: Path | None = None) -> Path:
    """The recipe's wheel in the cache, checked as every command that uses it checks it: its sha256, a
    whole zip archive, and the version its METADATA gives against the recipe's (the file name's was
    checked with the plan). A wrong wheel is bad input (ConfigError, naming recipe and field); only a
    source that cannot be reached is a DownloadError."""
    w = plan.vllm.wheel
    assert w is not None
    if w.local and not (is_regular(w.local) and os.access(w.local, os.R_OK)):
        raise ConfigError(f"{w.path} is not a readable regular file in {recipe.parent}", path=recipe,
                          field="vllm.path")
    try:
        path = fetch_wheel(w, ca_cert)
    except download.HashMismatch as exc:
        raise ConfigError(f"the wheel has sha256 {exc.got}, not {exc.wanted}: pin the wheel you mean",
                          path=recipe, field="vllm.sha256") from None
    except download.DownloadFailed as exc:
        raise DownloadError(f"cannot fetch the wheel: {exc}", path=recipe, field="vllm.url") from None
    except ConfigError as exc:  # the path turned into a FIFO or a folder after the check above
        raise ConfigError(exc.detail, path=recipe, field="vllm.path") from None
    except OSError as exc:
        raise BuildError(f"cannot keep the wheel in the download cache {download.downloads_dir()}: "
                         f"{exc.strerror or exc}", path=recipe, field="vllm") from None
    broken = _zip_damage(path)
    if broken:
        raise ConfigError(f"{w.filename} is not a whole wheel: {broken}", path=recipe,
                          field="vllm.url" if w.url else "vllm.path")
    found = metadata_version(path)
    if found != Version(plan.vllm.version):
        raise ConfigError(f"{w.filename} holds vllm {found} (its METADATA), but the recipe says version "
                          f"{plan.vllm.version}", path=recipe, field="vllm.version")
    return path


def _zip_damage(path: Path) -> str | None:
    """Why a wheel is not a readable zip archive (every member's CRC is checked), or None."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as exc:
        return f"not a zip archive ({exc})"
    return f"{bad} fails its CRC check" if bad else None


def fetch_wheel(w: WheelFile, ca_cert: Path | None = None) -> Path:
    """The recipe's wheel in the cache, by hash: downloaded, or copied from its path (which the plan
    stage confined to the recipe folder). Raises download.HashMismatch, download.DownloadFailed, OSError."""
    if w.url:
        return download.fetch(w.url, w.sha256, w.filename, ca_cert=ca_cert)
    return download.take_local(Path(w.local or ""), w.sha256, w.filename)


def metadata_version(wheel: Path) -> Version | None:
    """The Version field of a wheel's METADATA, or None when it has none that parses."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            name = next((n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
            if name is None:
                return None
            headers = HeaderParser().parsestr(zf.read(name).decode("utf-8", errors="replace"))
        return Version(headers.get("Version", ""))
    except (zipfile.BadZipFile, InvalidVersion, OSError):
        return None


# ------------------------------------------------------------------ the wheel cache: keys


def base_identity(plan: Plan, host: str | None = None) -> str | None:
    """The base's digest, or (unpinned) what its content is on the build engine; None when neither is known.

    Not the image ID: that is the config digest on the classic image store and a manifest digest on the
    containerd store, so one base would give two keys. What both stores report alike is the ordered
    layer diff IDs and the image's settings that a compile sees (environment, user, working folder,
    entry point, platform); their digest names the base's content on any engine."""
    if plan.base.digest.value:
        return plan.base.digest.value
    data = dockercli.inspect_images(plan.base.ref, host=host)[plan.base.ref]
    return None if data is None else "content " + _content_digest(data)


def _content_digest(data: dict[str, Any]) -> str:
    config = data.get("Config") or {}
    seen = {
        "layers": list((data.get("RootFS") or {}).get("Layers") or []),
        "platform": [data.get("Os") or "", data.get("Architecture") or "", data.get("Variant") or ""],
        **{key: config.get(key) or None for key in ("Env", "User", "WorkingDir", "Entrypoint", "Cmd", "Shell")},
    }
    return "sha256:" + hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()


def engine_arch(host: str | None = None) -> str:
    """The build engine's CPU architecture: a base digest may name a multi-arch index, whose wheels differ by it."""
    return dockercli.run(["version", "--format", "{{.Server.Os}}/{{.Server.Arch}}"], host=host,
                         what="docker version").stdout.strip()


def key_inputs(plan: Plan, base: str | None, arch: str) -> tuple[dict[str, Any] | None, str]:
    """What decides the compiled wheel's content, or None and why the cache cannot be used.

    Everything the compile stages read: the source and its source-phase mods, the compile's
    environment and arch list, the base and the OS packages and protected builds added to it, the
    git components copied in, the template and the tools that run in those stages (tooling_digest),
    the engine's architecture, and SOURCE_DATE_EPOCH (it sets the times inside the wheel)."""
    v = plan.vllm
    if v.source != "git":
        return None, "the variant compiles no vLLM"
    if v.commit.value is None:
        return None, "vllm.commit is not pinned (lock the variant)"
    gits = [c for c in plan.components if c.kind == "git"]
    loose = next((c for c in gits if c.commit.value is None), None)
    if loose:
        return None, f"components.{loose.name}.commit is not pinned (lock the variant)"
    if base is None:
        return None, f"the base {plan.base.ref} has no digest and is not on this engine"
    return {
        "format": CACHE_FORMAT,
        "vllm": {"repo": v.repo, "commit": v.commit.value, "version": v.version},
        "source_mods": [{"name": m.name, "digest": m.digest} for m in plan.mods_in("source")],
        "build_env": dict(plan.build.env),
        "torch_cuda_arch_list": plan.build.torch_cuda_arch_list,
        "base": base,
        "os_packages": list(plan.os_packages),
        "protect": list(plan.protect),
        "git_components": {c.name: c.commit.value for c in gits},
        "tooling": plan.tooling_digest,
        "platform": arch,
        "source_date_epoch": plan.source_date_epoch,
    }, ""


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The inputs in which another entry differs from this build, as `field (there: X, here: Y)`."""
    out = []
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            out.append(f"{name} (cached: {_short(theirs.get(name))}, this build: {_short(mine.get(name))})")
    return out


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ the wheel cache: entries


def claim(root: Path) -> None:
    """Make root (when need be) and mark it as a wheel cache, so that prune may later clean it."""
    root.mkdir(parents=True, exist_ok=True)
    marker = root / MARKER
    if not marker.exists():
        write_atomic(marker, b"This folder is a sparkforge wheel cache: `./build.py wheels list` shows it.\n")


def is_wheel_cache(root: Path) -> bool:
    """True for a folder sparkforge marked as a wheel cache (or one of an older sparkforge: it holds an entry or
    its last-use folder), and for a folder that is empty or not there; never for anything else."""
    if not root.exists():
        return True
    if (root / MARKER).is_file() or (root / USED).is_dir():
        return True
    items = list(root.iterdir())
    return not items or any(read_entry(item) is not None for item in items if item.is_dir())


def entries(root: Path) -> list[Entry]:
    """Every complete entry of the cache, newest first; half-written or foreign folders are skipped."""
    found = []
    for folder in sorted(root.glob("*/")) if root.is_dir() else ():
        entry = read_entry(folder)
        if entry is not None:
            found.append(entry)
    return sorted(found, key=lambda e: e.created, reverse=True)


def scan(root: Path) -> tuple[list[Entry], list[tuple[str, str]]]:
    """The whole entries of the cache, newest first, and the damaged ones: (folder name, why) of each folder
    that has an entry.json but is not one whole, well-formed entry (bad JSON, wrong types, a missing wheel)."""
    found, damaged = [], []
    for folder in sorted(root.glob("*/")) if root.is_dir() else ():
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
    """The entry in folder, or None when it is not one whole, well-formed entry of this format.

    A shared folder may hold anything: every field that later reaches a Dockerfile line or a table
    is checked here (a wheel path inside the entry with a plain file name, 64-hex hashes, one line)."""
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
    if plan.vllm.source != "git":
        return Lookup(None, None, None, "the variant compiles no vLLM")
    inputs, why = key_inputs(plan, base_identity(plan, host), engine_arch(host))
    if inputs is None:
        return Lookup(None, None, None, why)
    key = cache_key(inputs)
    entry = read_entry(root / key)
    if entry is None:
        return Lookup(inputs, key, None, _closest(inputs, root))
    if not entry.path.is_file() or download.sha256_of(entry.path) != entry.sha256:
        return Lookup(inputs, key, None, f"the cached wheel {key[:12]} no longer has its recorded sha256 (changed "
                                         "after it was stored); it is compiled again and replaced")
    mark_used(root, key)
    return Lookup(inputs, key, as_input(entry), "")


def as_input(entry: Entry) -> WheelInput:
    return WheelInput("cache", entry.folder, entry.wheel, entry.sha256, entry.key, records=True,
                      compiled_for=entry.compiled_for)


def mark_used(root: Path, key: str) -> None:
    """Note the entry's use, for `prune --older-than`; a cache this user cannot write is still read."""
    try:
        claim(root)
        (root / USED).mkdir(parents=True, exist_ok=True)
        (root / USED / key).touch()
    except OSError:
        pass


def _closest(inputs: dict[str, Any], root: Path) -> str:
    same = [e for e in entries(root) if e.inputs.get("vllm") == inputs["vllm"]]
    if not same:
        return f"the wheel cache holds no wheel of vllm {inputs['vllm']['commit'][:12]}"
    best = min(same, key=lambda e: len(differences(inputs, e.inputs)))
    return f"the cached wheel {best.key[:12]} of this commit differs in " + "; ".join(differences(inputs, best.inputs))


def store(root: Path, inputs: dict[str, Any], exported: Path, compiled_for: str) -> Entry:
    """Move a compile's exported files (wheels/vllm-*.whl, record/) into the cache as one entry, whole.

    An entry already there for the key is kept when it is whole and its wheel still has its recorded
    hash (another build made it from the same inputs); otherwise it is moved aside and replaced."""
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
            _discard(root / key)  # a broken or changed entry of this key
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


def _discard(folder: Path) -> bool:
    """Take an entry out of the cache at once (a rename), then delete it: readers never see half of one.
    False when it was gone already (another machine pruning the shared folder) or could not be deleted whole."""
    trash = folder.parent / f".trash-{folder.name[:12]}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.replace(folder, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return not trash.exists()


LEFTOVER_HOURS = 24  # a compile of the image's own can take hours on a slow machine; a day is past any
_LEFTOVER_RE = re.compile(r"\A\.(export\.|trash-|[0-9a-f]{12}\.)")  # prepare_wheel's export, _discard, store's staging


def refuse_foreign(root: Path) -> None:
    """Refuse to clean a folder that is not a wheel cache: prune removes folders there."""
    if not root.is_dir() and root.exists():
        raise ConfigError("is not a folder", path=root, field="--wheel-cache")
    if not is_wheel_cache(root):
        raise ConfigError(f"is not a wheel cache (no {MARKER}, no entry); prune removes only what sparkforge put in "
                          "one, so it touches nothing here", path=root, field="--wheel-cache")


def leftovers(root: Path, *, older_than_hours: float = LEFTOVER_HOURS) -> list[Path]:
    """Folders a killed build or prune left in the cache (an export, a staging folder, a renamed entry), untouched
    for older_than_hours: younger ones may belong to a build that is still running, here or on a machine that
    shares the cache."""
    now = time.time()
    found: list[Path] = []
    if not is_wheel_cache(root):
        return found
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            if _LEFTOVER_RE.match(folder.name) and folder.is_dir() and not folder.is_symlink() \
                    and now - folder.stat().st_mtime > older_than_hours * 3600:
                found.append(folder)
        except OSError:
            continue
    return found


def folder_size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:
            continue
    return total


def remove_leftovers(found: list[Path]) -> list[Path]:
    """Remove each folder; the ones that are gone now (a folder another user owns may stay)."""
    gone = []
    for folder in found:
        try:
            if _discard(folder):
                gone.append(folder)
        except OSError as exc:
            raise BuildError(f"cannot remove {folder}: {exc.strerror or exc}", field="wheels prune") from None
    return gone


def prune(root: Path, *, older_than_days: float | None = None, key: str | None = None,
          dry_run: bool = False) -> list[Entry]:
    """Remove entries not used for older_than_days, or the one entry whose key starts with `key`, or (neither)
    all; each is renamed out of the cache before it is deleted."""
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
                _discard(entry.folder)
                (root / USED / entry.key).unlink(missing_ok=True)
            except OSError as exc:
                raise BuildError(f"cannot remove {entry.folder}: {exc.strerror or exc}", field="wheels prune") from None
    return chosen
