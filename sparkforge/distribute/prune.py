"""`prune`: what sparkforge's builds left on the head that nothing names any more, found, then removed: candidates
(`TAG-candidate`) and kept builds (`TAG.<12 hex>`) no deploy record names; asked for, wheel-cache entries no plan
would use, wheel sets no lock names, and BuildKit's cache records that name sparkforge. Never removed: an image a
moving tag, a current immutable tag or a deploy record names (by tag or learnt image ID); a candidate whose build is
running (its build lock is taken without waiting and held until prune is done)."""

from __future__ import annotations

import fcntl
import json
import os
import re
from contextlib import ExitStack
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..build import dockercli
from ..build.pipeline import LoadedPlan, list_plans
from ..errors import BuildError, ConfigError, SparkforgeError
from ..imageref import ImageRef
from ..recipe.layout import PROJECT_ROOT, Layout
from ..recipe.lockfile import lock_path, read_lock
from ..recipe.plan import Plan
from .images import read_state, repository_tags

CANDIDATE = "-candidate"
KEPT_RE = re.compile(r"\.[0-9a-f]{12}$")
CACHE_FILTER = "description~=sparkforge"
UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


@dataclass(frozen=True)
class Leftover:
    kind: str  # "candidate", "kept build", "wheel", "wheel set" or "build cache"
    name: str  # the image reference, the wheel key, the set's folder, or how many cache records
    size: int  # bytes as the engine or the disk reports them
    shared: bool = False  # a tag whose image another tag that stays also names: removing it frees nothing


@dataclass(frozen=True)
class Prune:
    """What prune would remove, and what it leaves that looked like a leftover, with why."""

    leftovers: tuple[Leftover, ...]
    left: tuple[tuple[str, str], ...]  # (name, why it stays)


def hold_if_idle(lock: Path, held: ExitStack, create: bool) -> bool:
    """Take a lock without waiting, kept in `held`; False when another holds it. Without `create` none is made."""
    try:
        fd = os.open(lock, (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_CLOEXEC, 0o666)
    except FileNotFoundError:  # only without `create` (a dry run): nobody holds a lock file that is not there
        return True
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def image_leftovers(plans: list[Plan], state_dir: Path | None, held: ExitStack,
                    dry_run: bool) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """The candidates and unnamed kept builds of the variants, and what looked like one but stays (with why)."""
    found: list[Leftover] = []
    left: list[tuple[str, str]] = []
    for repository in sorted({ImageRef.parse(p.image).repository for p in plans}):
        tags = sorted(repository_tags(repository))
        if not tags:
            continue
        data = dockercli.inspect_images(*tags)
        ids = {t: str(d.get("Id")) for t, d in data.items() if d is not None}
        state = read_state(state_dir, repository)  # the tags it names: deployed, rolled back to, pushed
        kept_names = set(state["manifests"]) | set(state["deployed"].values()) | set(state["configs"])
        kept_names |= {d["tag"] for deploys in state["deploys"].values() for d in deploys}
        learnt = {c["head_id"] for c in state["configs"].values()}  # image IDs learnt at a push or save
        current = {p.tag for p in plans} | {p.moving_tag for p in plans}
        protected = {ids[t] for t in tags if t in ids and (t in current or t in kept_names)} | learnt
        chosen: dict[str, str] = {}  # tag -> kind
        for tag in tags:
            name = ImageRef.parse(tag).tag or ""
            kind = "candidate" if name.endswith(CANDIDATE) else "kept build" if KEPT_RE.search(name) else None
            if kind is None or tag not in ids:
                continue
            lock = PROJECT_ROOT / "build" / "contexts" / f"{name.removesuffix(CANDIDATE)}.lock"  # same_plan_lock's
            if tag in kept_names:
                left.append((tag, "a deploy record names it"))
            elif ids[tag] in protected:
                left.append((tag, "its image is also a current or deployed build"))
            elif kind == "kept build" and KEPT_RE.sub("", tag) in kept_names:
                # after `build --move-tag` the build a deploy record names by TAG is the one kept as TAG.<hex>
                left.append((tag, f"a deploy record names {KEPT_RE.sub('', tag)}, whose earlier build it may be"))
            elif kind == "candidate" and not hold_if_idle(lock, held, create=not dry_run):
                left.append((tag, "a build of it is running"))
            else:
                chosen[tag] = kind
        for tag, kind in chosen.items():
            twins = [t for t in tags if ids.get(t) == ids[tag]]  # in order, this one among them
            shared = twins[0] != tag or any(t not in chosen for t in twins)  # another name stays, or goes first
            found.append(Leftover(kind, tag, int((data[tag] or {}).get("Size") or 0), shared))
    return found, left


def wheel_leftovers(plans: list[Plan], root: Path) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """The wheel-cache entries no variant's plan would use; none when a git-source variant's key is unknown."""
    from ..build.wheelkey import base_identity, cache_key, key_inputs
    from ..build.wheels import entries

    found = entries(root)
    if not found:
        return [], []
    wanted = set()
    for plan in (p for p in plans if p.vllm.source == "git"):
        inputs, why = key_inputs(plan, base_identity(plan))
        if inputs is None:
            return [], [(f"the wheel cache {root}", f"variant {plan.variant}'s wheel key is unknown ({why}); every "
                                                   "wheel stays (`wheels prune` removes by age or key)")]
        wanted.add(cache_key(inputs))
    return ([Leftover("wheel", e.key, e.size) for e in found if e.key not in wanted],
            [(f"wheel {e.key[:12]}", "a variant's build uses it") for e in found if e.key in wanted])


def wheel_set_leftovers(named: set[Path], held: ExitStack,
                        dry_run: bool) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """The downloaded wheel sets not among `named`, with the downloads only they use; one being fetched stays."""
    from ..build.wheelfetch import freed, stored_sets, unshared

    left: list[tuple[str, str]] = []
    going: list[Path] = []
    for folder in stored_sets():
        if folder in named:
            left.append((f"wheel set {folder.name[:12]}", "a variant's lock names it"))
        elif not hold_if_idle(folder.with_name(f"{folder.name}.lock"), held, create=not dry_run):
            left.append((f"wheel set {folder.name[:12]}", "it is being downloaded"))
        else:
            going.append(folder)
    kept = [s for s in stored_sets() if s not in going]
    return [Leftover("wheel set", str(f), freed(unshared(f, kept))) for f in going], left


def named_sets(layout: Layout, loaded: list[LoadedPlan]) -> set[Path]:
    """The wheel-set folders the variants' locks name, also of a lock the recipe has changed since."""
    from ..build.wheelfetch import folder_of, set_folder

    named = {set_folder(x.plan) for x in loaded if x.plan.wheel_set and x.plan.python is not None}
    for x in loaded:
        path = lock_path(layout.images_dir, x.plan.variant)
        wheels = read_lock(path).wheels if path.exists() else None
        if wheels is not None and wheels.packages:
            named.add(folder_of(wheels.python, wheels.platform, wheels.pins))
    return named


def cache_records() -> tuple[int, int]:
    """How many of BuildKit's cache records name sparkforge, and their bytes."""
    done = dockercli.run(["buildx", "du", "--filter", CACHE_FILTER, "--format", "json"], what="docker buildx du")
    records = [line for line in done.stdout.splitlines() if line.strip()]
    total = 0
    for line in records:
        try:  # a size as docker prints one: 4.096kB, 1.2GB
            m = re.fullmatch(r"([0-9.]+)\s*([kKMGT]?B)", str(json.loads(line).get("Size", "0B")).strip())
            if not m:
                raise ValueError(line)
            total += int(float(m.group(1)) * UNITS[m.group(2)])
        except (ValueError, AttributeError):
            raise BuildError(f"docker buildx du printed a line that is not a cache record: {line[:120]}",
                             field="docker buildx du") from None
    return len(records), total


def remove(found: Prune, wheel_root: Path | None, say: Callable[[Leftover], None]) -> list[tuple[Leftover, str]]:
    """Remove each leftover, saying each once it is gone; one that cannot be removed comes back with why."""
    from ..build.wheelfetch import remove_set, stored_sets
    from ..build.wheels import prune as prune_wheels

    going = {item.name for item in found.leftovers if item.kind == "wheel set"}
    failed: list[tuple[Leftover, str]] = []
    for item in found.leftovers:
        try:
            if item.kind in ("candidate", "kept build"):
                dockercli.run(["image", "rm", "--no-prune", item.name], what=f"docker image rm {item.name}")
            elif item.kind == "wheel" and wheel_root is not None:
                prune_wheels(wheel_root, key=item.name)
            elif item.kind == "wheel set":
                remove_set(Path(item.name), [s for s in stored_sets() if str(s) not in going])
            else:
                dockercli.run(["builder", "prune", "--force", "--filter", CACHE_FILTER], what="docker builder prune",
                              timeout=dockercli.LONG)
        except SparkforgeError as exc:
            failed.append((item, exc.detail))
        except OSError as exc:  # a wheel set's file that cannot be removed (a read-only cache, another owner)
            failed.append((item, f"{exc.filename or item.name}: {exc.strerror or exc}"))
        else:
            say(item)
    return failed


def prune_head(layout: Layout, *, wheel_root: Path | None, build_cache: bool, dry_run: bool,
               state_dir: Path | None = None,
               say: Callable[[Leftover], None] = lambda item: None) -> tuple[Prune, list[tuple[Leftover, str]]]:
    """`prune`: find the leftovers and remove them unless dry_run; what could not be removed comes back with why.
    Every recipe must load: a variant whose tags are unknown could lose a build it still names."""
    loaded, errors = list_plans(layout)
    if errors:
        raise ConfigError(f"prune needs every recipe to load, to know which tags they name: {errors[0].detail}",
                          path=errors[0].path, field=errors[0].field)
    plans = [x.plan for x in loaded]
    with ExitStack() as held:
        items, left = image_leftovers(plans, state_dir, held, dry_run)
        if wheel_root is not None:
            wheels, wheels_left = wheel_leftovers(plans, wheel_root)
            sets, sets_left = wheel_set_leftovers(named_sets(layout, loaded), held, dry_run)
            items, left = items + wheels + sets, left + wheels_left + sets_left
        count, size = cache_records() if build_cache else (0, 0)
        cache = [Leftover("build cache", f"{count} records", size)] if count else []
        found = Prune(tuple(items + cache), tuple(left))
        failed = [] if dry_run else remove(found, wheel_root, say)
    return found, failed
