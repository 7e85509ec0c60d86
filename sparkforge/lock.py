"""Lock stage: pin everything a recipe leaves open, in images/<variant>.lock.json.

A lock holds the base image digest (asked from its registry), the vLLM and component pins,
every Python package a real build of the variant installed, each mod's content hash, and the
SOURCE_DATE_EPOCH of builds. A field that cannot be resolved from where `lock` runs is written
as {"unresolved": "<why>"}, never invented. A locked build (`build --locked`) first checks that
the recipe still says what the lock was made from, then builds with the lock's pins.

The lock is JSON, not YAML: it is written by this tool, and a `.yaml` file in images/ would be
taken for a variant.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Union

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import Field, StringConstraints, ValidationError

from .config import (
    AbsPath,
    Commit,
    Digest,
    GitRef,
    GitUrl,
    ImageTag,
    Name,
    OsPackage,
    Package,
    PipVersion,
    Repository,
    Strict,
    Text,
    read_text,
)
from .errors import ConfigError, SparkforgeError
from .plan import BaseImage, Component, Pin, Plan, rehash

LOCK_SUFFIX = ".lock.json"
LOCK_FORMAT = 1
MIN_EPOCH = 315532800  # 1980-01-01: zip (and so wheels) cannot store earlier times


def lock_path(images_dir: Path, variant: str) -> Path:
    return images_dir / f"{variant}{LOCK_SUFFIX}"


# ------------------------------------------------------------------ lock data


@dataclass(frozen=True)
class Pinned:
    """A value the lock pins, or the reason it could not be resolved."""

    value: str | None
    unresolved: str | None = None

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
    commit: Pinned | None  # None for a pypi source
    install_deps: bool


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
        return out

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "sparkforge_lock": LOCK_FORMAT,
            "variant": self.variant,
            "source_date_epoch": self.source_date_epoch,
            "base": {"repository": self.base.repository, "tag": self.base.tag, "digest": self.base.digest.to_json()},
            "vllm": _drop_none({"source": self.vllm.source, "version": self.vllm.version, "ref": self.vllm.ref,
                                "commit": self.vllm.commit.to_json() if self.vllm.commit else None,
                                "install_deps": self.vllm.install_deps}),
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
        return json.dumps(data, indent=2) + "\n"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


# ------------------------------------------------------------------ reading: strict schema


class _Unresolved(Strict):
    unresolved: Text


class _Base(Strict):
    repository: Repository
    tag: ImageTag
    digest: Union[Digest, _Unresolved]


class _Vllm(Strict):
    source: Literal["git", "pypi"]
    version: PipVersion
    ref: Optional[GitRef] = None
    commit: Union[Commit, _Unresolved, None] = None
    install_deps: bool


class _Component(Strict):
    kind: Literal["pip", "git"]
    package: Optional[Package] = None
    version: Union[PipVersion, _Unresolved, None] = None
    repo: Optional[GitUrl] = None
    ref: Optional[GitRef] = None
    commit: Union[Commit, _Unresolved, None] = None
    dest: Optional[AbsPath] = None


class _Mod(Strict):
    name: Name
    digest: Digest


class _BuiltFrom(Strict):
    image_id: Digest
    plan_hash: Text


class _LockFile(Strict):
    sparkforge_lock: Literal[1]
    variant: Name
    source_date_epoch: int = Field(ge=MIN_EPOCH)
    base: _Base
    vllm: _Vllm
    components: dict[Name, _Component]
    mods: list[_Mod]
    protect: list[Package]
    os_packages: list[OsPackage]
    packages: Union[dict[Package, InstalledVersion], _Unresolved]
    built_from: Optional[_BuiltFrom] = None


# Installed versions are recorded as found; a Debian build can carry one pip cannot parse.
InstalledVersion = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9.+!_~:-]*$")]

_BRANCHES = re.compile(r"^(str|_Unresolved|dict\[.*\]|function-.*|none|int|bool|\[key\])$")


def _pin(raw: Any) -> Pinned | None:
    if raw is None:
        return None
    if isinstance(raw, _Unresolved):
        return Pinned(None, raw.unresolved)
    return Pinned(raw)


def read_lock(path: Path) -> Lock:
    """Read and check a lock file; any fault is one line naming the file and the field."""
    text = read_text(path, missing="no lock file: run `python build.py lock VARIANT` first")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        line = f"line {exc.lineno}, column {exc.colno}: " if hasattr(exc, "lineno") else ""
        raise ConfigError(f"malformed lock file: {line}{getattr(exc, 'msg', exc)}", path=path) from None
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
        raise ConfigError(f"{msg} (write the lock again with `python build.py lock`)", path=path,
                          field=loc or None) from None
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
                        data.vllm.install_deps),
        components=tuple(LockedComponent(name, c.kind, c.package, _pin(c.version), c.repo, c.ref, _pin(c.commit),
                                         c.dest) for name, c in sorted(data.components.items())),
        mods=tuple((m.name, m.digest) for m in data.mods),
        protect=tuple(data.protect),
        os_packages=tuple(data.os_packages),
        packages=packages,
        packages_unresolved=unresolved,
        built_from=BuiltFrom(data.built_from.image_id, data.built_from.plan_hash) if data.built_from else None,
    )


def write_lock(path: Path, lock: Lock) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(lock.to_json(), encoding="utf-8")
    tmp.replace(path)


# ------------------------------------------------------------------ recipe versus lock


@dataclass(frozen=True)
class Mismatch:
    field: str
    recipe: str
    lock: str


def _plan_pin(pin: Pin) -> Pinned:
    return Pinned(pin.value, pin.unknown)


def _fields(plan: Plan | None, lock: Lock | None) -> list[tuple[str, Any]]:
    """(field, value) in a fixed order; a Pinned value is a pin that the lock may fill in."""
    out: list[tuple[str, Any]] = []
    if plan is not None:
        b, v = plan.base, plan.vllm
        out += [("variant", plan.variant), ("base.repository", b.repository), ("base.tag", b.tag),
                ("base.digest", _plan_pin(b.digest)), ("vllm.source", v.source), ("vllm.version", v.version),
                ("vllm.ref", v.ref), ("vllm.commit", _plan_pin(v.commit) if v.source == "git" else None),
                ("vllm.install_deps", v.install_deps),
                ("components", [c.name for c in plan.components])]
        for c in plan.components:
            out += [(f"components.{c.name}.kind", c.kind), (f"components.{c.name}.package", c.package),
                    (f"components.{c.name}.version", _plan_pin(c.version) if c.kind == "pip" else None),
                    (f"components.{c.name}.repo", c.repo), (f"components.{c.name}.ref", c.ref),
                    (f"components.{c.name}.commit", _plan_pin(c.commit) if c.kind == "git" else None),
                    (f"components.{c.name}.dest", c.dest)]
        out += [("mods", [m.name for m in plan.mods])]
        out += [(f"mods.{m.name}.digest", m.digest) for m in plan.mods]
        out += [("protect", list(plan.protect)), ("os_packages", list(plan.os_packages))]
    if lock is not None:
        b, v = lock.base, lock.vllm
        out += [("variant", lock.variant), ("base.repository", b.repository), ("base.tag", b.tag),
                ("base.digest", b.digest), ("vllm.source", v.source), ("vllm.version", v.version),
                ("vllm.ref", v.ref), ("vllm.commit", v.commit), ("vllm.install_deps", v.install_deps),
                ("components", [c.name for c in lock.components])]
        for c in lock.components:
            out += [(f"components.{c.name}.kind", c.kind), (f"components.{c.name}.package", c.package),
                    (f"components.{c.name}.version", c.version), (f"components.{c.name}.repo", c.repo),
                    (f"components.{c.name}.ref", c.ref), (f"components.{c.name}.commit", c.commit),
                    (f"components.{c.name}.dest", c.dest)]
        out += [("mods", [n for n, _ in lock.mods])]
        out += [(f"mods.{n}.digest", d) for n, d in lock.mods]
        out += [("protect", list(lock.protect)), ("os_packages", list(lock.os_packages))]
    return out


def _show(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, Pinned):
        return value.value if value.value is not None else f"unknown ({value.unresolved})"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    return str(value)


def compare(plan: Plan, lock: Lock) -> list[Mismatch]:
    """Where the recipe (as planned now) and the lock disagree, in a fixed order.

    A value the recipe pins must be the lock's; a value the recipe leaves unknown is the lock's
    to fill in (or to mark unresolved).
    """
    recipe = dict(_fields(plan, None))
    locked = dict(_fields(None, lock))
    out = []
    for name in dict.fromkeys([f for f, _ in _fields(plan, None)] + [f for f, _ in _fields(None, lock)]):
        if name.startswith("components.") and name.count(".") == 2:
            comp = name.split(".")[1]
            if comp not in recipe["components"] or comp not in locked["components"]:
                continue  # reported once, by the field "components"
        if name.startswith("mods.") and name.split(".")[1] not in set(recipe["mods"]) & set(locked["mods"]):
            continue  # reported by the field "mods"
        a, b = recipe.get(name), locked.get(name)
        if isinstance(a, Pinned) and a.value is None:
            continue  # the recipe leaves it open: the lock fills it in
        if isinstance(a, Pinned) or isinstance(b, Pinned):
            same = (a.value if isinstance(a, Pinned) else a) == (b.value if isinstance(b, Pinned) else b)
        else:
            same = a == b
        if not same:
            out.append(Mismatch(name, _show(a), _show(b)))
    return out


def check_lock(plan: Plan, lock: Lock, path: Path) -> None:
    """Refuse, naming the first field, when the recipe was changed after it was locked."""
    diffs = compare(plan, lock)
    if diffs:
        first = diffs[0]
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise ConfigError(f"recipe says {first.recipe}, lock says {first.lock}{more}; the recipe changed after it "
                          f"was locked: run `python build.py lock {plan.variant}` again", path=path, field=first.field)


def apply_lock(plan: Plan, lock: Lock) -> Plan:
    """The plan with the lock's pins: base digest, commits and versions the recipe leaves open,
    every installed package as a pip constraint, and the SOURCE_DATE_EPOCH."""
    base = plan.base
    if base.digest.value is None and lock.base.digest.value:
        base = BaseImage(base.repository, base.tag, Pin(lock.base.digest.value))
    vllm = plan.vllm
    if vllm.source == "git" and vllm.commit.value is None and lock.vllm.commit and lock.vllm.commit.value:
        vllm = replace(vllm, commit=Pin(lock.vllm.commit.value))
    locked = {c.name: c for c in lock.components}
    components = []
    for c in plan.components:
        lc = locked.get(c.name)
        if lc and c.kind == "pip" and c.version.value is None and lc.version and lc.version.value:
            c = replace(c, version=Pin(lc.version.value))
        if lc and c.kind == "git" and c.commit.value is None and lc.commit and lc.commit.value:
            c = replace(c, commit=Pin(lc.commit.value))
        components.append(c)
    return rehash(replace(plan, base=base, vllm=vllm, components=tuple(components),
                          pins=constraints(lock.packages), source_date_epoch=lock.source_date_epoch))


def constraints(packages: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The installed packages that can be pip constraints: PEP 440 versions only (a Debian-built
    distribution can carry a version pip cannot parse; pip would never install it anyway)."""
    out = []
    for name, version in packages:
        try:
            Version(version)
        except InvalidVersion:
            continue
        out.append((name, version))
    return tuple(out)


# ------------------------------------------------------------------ resolving: registry and git


class Unreachable(Exception):
    """A fact cannot be asked from here; the message says why."""


MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


def split_repository(repository: str) -> tuple[str, str]:
    """(registry host, repository name on it), with Docker Hub's defaults."""
    first, sep, rest = repository.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest
    return "registry-1.docker.io", repository if sep else f"library/{repository}"


def _loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _bearer_token(challenge: str, timeout: float) -> str:
    """An anonymous token for the scope a registry's 401 asks for (the Docker token flow)."""
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    realm = params.pop("realm", None)
    if not realm or not challenge.lower().startswith("bearer"):
        raise Unreachable(f"the registry asks for authentication this tool does not do ({challenge[:60]})")
    url = realm + "?" + urllib.parse.urlencode({k: v for k, v in params.items() if k in ("service", "scope")})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreachable(f"cannot get a token from {realm}: {getattr(exc, 'reason', exc)}") from None
    token = body.get("token") or body.get("access_token")
    if not token:
        raise Unreachable(f"{realm} gave no token")
    return token


def registry_digest(repository: str, tag: str, *, timeout: float = 15) -> str:
    """The digest a registry gives for repository:tag (a multi-arch index when there is one),
    over the Registry v2 API: plain HTTP for loopback registries, HTTPS with the token flow otherwise."""
    host, name = split_repository(repository)
    scheme = "http" if _loopback(host) else "https"
    url = f"{scheme}://{host}/v2/{name}/manifests/{tag}"
    headers = {"Accept": ", ".join(MANIFEST_TYPES)}
    for attempt in (1, 2):
        req = urllib.request.Request(url, headers=headers, method="HEAD")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                digest = resp.headers.get("Docker-Content-Digest")
            if not digest:  # not every registry sends it on HEAD: hash the manifest itself
                import hashlib

                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
                    digest = "sha256:" + hashlib.sha256(resp.read()).hexdigest()
            if not re.match(r"^sha256:[0-9a-f]{64}$", digest):
                raise Unreachable(f"{host} answered an unexpected digest {digest[:80]!r}")
            return digest
        except urllib.error.HTTPError as exc:
            if exc.code == 401 and attempt == 1:
                challenge = exc.headers.get("WWW-Authenticate", "")
                headers["Authorization"] = f"Bearer {_bearer_token(challenge, timeout)}"
                continue
            if exc.code == 404:
                raise Unreachable(f"{host} has no {name}:{tag}") from None
            raise Unreachable(f"{host} answered HTTP {exc.code} for {name}:{tag}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable(f"cannot reach {host}: {getattr(exc, 'reason', exc)}") from None
    raise Unreachable(f"{host} refused the token it issued for {name}:{tag}")


def git_commit(repo: str, ref: str, *, timeout: float = 30) -> str:
    """The commit a branch or tag names on a git remote (a tag is peeled to its commit)."""
    if re.fullmatch(r"[0-9a-f]{7,39}", ref):
        raise Unreachable(f"{ref} is a short commit, which a remote cannot expand; write the full commit")
    try:
        proc = subprocess.run(["git", "ls-remote", repo, ref, f"{ref}^{{}}"], capture_output=True, text=True,
                              timeout=timeout, env={"GIT_TERMINAL_PROMPT": "0", "PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unreachable(f"git ls-remote {repo}: {exc}") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise Unreachable(f"cannot ask {repo} for {ref}: {tail.removeprefix('fatal: ')}")
    refs = dict(reversed(line.split("\t", 1)) for line in proc.stdout.splitlines() if "\t" in line)
    for name in (f"refs/tags/{ref}^{{}}", f"refs/tags/{ref}", f"refs/heads/{ref}", ref):
        if name in refs:
            return refs[name]
    raise Unreachable(f"{repo} has no branch or tag {ref}")


# ------------------------------------------------------------------ resolving a lock


def today_epoch(now: float | None = None) -> int:
    """Midnight UTC of the day the lock is made: nothing in a locked image claims to be newer."""
    t = int(time.time() if now is None else now)
    return t - t % 86400


def resolve_pins(plan: Plan, say: Callable[[str], None] = lambda _: None) -> dict[str, Pinned]:
    """Ask the registry for the base digest and the git remotes for the commits the recipe leaves open."""
    pins: dict[str, Pinned] = {}
    b = plan.base
    if b.digest.value:
        pins["base.digest"] = Pinned(b.digest.value)
    else:
        try:
            pins["base.digest"] = Pinned(registry_digest(b.repository, b.tag))
            say(f"base {b.repository}:{b.tag} is {pins['base.digest'].value}")
        except Unreachable as exc:
            pins["base.digest"] = Pinned(None, f"{exc}; lock again where the registry answers")
            say(f"base {b.repository}:{b.tag}: unresolved: {exc}")
    gits = [("vllm.commit", plan.vllm.repo, plan.vllm.ref, plan.vllm.commit)] if plan.vllm.source == "git" else []
    gits += [(f"components.{c.name}.commit", c.repo, c.ref, c.commit) for c in plan.components if c.kind == "git"]
    for name, repo, ref, pin in gits:
        if pin.value:
            pins[name] = Pinned(pin.value)
            continue
        try:
            pins[name] = Pinned(git_commit(str(repo), str(ref)))
        except Unreachable as exc:
            pins[name] = Pinned(None, f"{exc} (recipe: {pin.unknown})")
        say(f"{name}: {pins[name].show()}")
    return pins


def pinned_plan(plan: Plan, pins: dict[str, Pinned], source_date_epoch: int) -> Plan:
    """The plan to build for a lock: resolved digest and commits, the epoch; no package pins yet."""
    lock = make_lock(plan, pins, source_date_epoch, packages=None, packages_unresolved="not built yet")
    return apply_lock(plan, lock)


def make_lock(plan: Plan, pins: dict[str, Pinned], source_date_epoch: int, *,
              packages: dict[str, str] | None, packages_unresolved: str | None,
              built_from: BuiltFrom | None = None) -> Lock:
    """A Lock from the plan, the resolved pins and (from a real build) the installed packages."""
    installed = {canonicalize_name(k): v for k, v in (packages or {}).items()}
    comps = []
    for c in plan.components:
        if c.kind == "pip":
            if c.version.value:
                version = Pinned(c.version.value)
            elif packages is not None:
                got = installed.get(canonicalize_name(str(c.package).split("[")[0]))
                version = Pinned(got) if got else Pinned(None, f"the build did not install {c.package}")
            else:
                version = Pinned(None, f"{packages_unresolved} (recipe: {c.version.unknown})")
            comps.append(LockedComponent(c.name, "pip", c.package, version, None, None, None, None))
        else:
            comps.append(LockedComponent(c.name, "git", None, None, c.repo, c.ref,
                                         pins.get(f"components.{c.name}.commit", _plan_pin(c.commit)), c.dest))
    v = plan.vllm
    return Lock(
        variant=plan.variant,
        source_date_epoch=source_date_epoch,
        base=LockedBase(plan.base.repository, plan.base.tag, pins.get("base.digest", _plan_pin(plan.base.digest))),
        vllm=LockedVllm(v.source, v.version, v.ref,
                        pins.get("vllm.commit", _plan_pin(v.commit)) if v.source == "git" else None, v.install_deps),
        components=tuple(comps),
        mods=tuple((m.name, m.digest) for m in plan.mods),
        protect=plan.protect,
        os_packages=plan.os_packages,
        packages=tuple(sorted(installed.items())),
        packages_unresolved=None if packages is not None else packages_unresolved,
        built_from=built_from,
    )


def existing_epoch(path: Path) -> int | None:
    """The SOURCE_DATE_EPOCH of an existing lock, kept when locking again; None if there is none."""
    if not path.exists():
        return None
    try:
        return read_lock(path).source_date_epoch
    except SparkforgeError:
        return None
