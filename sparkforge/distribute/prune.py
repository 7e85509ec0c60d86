"""`prune`: what sparkforge's builds left on the head that nothing names any more, found, then removed.

Five kinds, each only in what sparkforge made:
- candidates (`TAG-candidate`) in the repositories of the variants: a build's image before its smoke test,
  kept after a failed one, for a look inside;
- kept builds (`TAG.<12 hex>`, the image a build of the same plan made when the immutable tag named another)
  that no deploy record names, whose TAG no deploy record names either (after `build --move-tag` the build
  that was deployed as TAG is the one kept as TAG.<hex>);
- asked for, wheel-cache entries no variant's plan here would use (each git-source variant's key is computed
  as a build computes it; when one cannot be, no wheel is removed). Other machines sharing the cache may use
  them: `wheels prune --older-than` is the gentler way;
- asked for too, downloaded wheel sets no variant's lock here names (<cache>/wheel-sets/), with their downloads
  that no set that stays shares;
- asked for, BuildKit's cache records whose description names sparkforge (its steps and its pip and git cache
  mounts). BuildKit cannot tell which other records sparkforge's builds made, so those stay.

Never removed: an image a moving tag, a variant's current immutable tag or a deploy record names (by tag or by
the image ID learnt at a push), under any of its tags; a candidate whose build is running: the build lock of
the plan the candidate's tag names is taken without waiting, and held until prune is done, so that no build
of it starts meanwhile either (a dry run only looks, and creates no lock file).
"""

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

    @property
    def size(self) -> int:
        return sum(x.size for x in self.leftovers if not x.shared)


def named_by_records(repository: str, state_dir: Path | None) -> tuple[set[str], set[str]]:
    """The tags the head's deploy record of a repository names (deployed, rolled back to, pushed), and the image
    IDs it learnt for them at a push or save."""
    state = read_state(state_dir, repository)
    named = set(state["manifests"]) | set(state["deployed"].values()) | set(state["configs"])
    named |= {d["tag"] for deploys in state["deploys"].values() for d in deploys}
    return named, {c["head_id"] for c in state["configs"].values()}


def build_lock(tag: str) -> Path:
    """The build lock of the plan a candidate tag names (`REPO:VARIANT-HASH12-candidate`): build/contexts/
    VARIANT-HASH12.lock, which every build of that plan holds from render to tags (pipeline.same_plan_lock)."""
    name = (ImageRef.parse(tag).tag or "").removesuffix(CANDIDATE)
    return PROJECT_ROOT / "build" / "contexts" / f"{name}.lock"


def hold_if_idle(lock: Path, held: ExitStack, create: bool) -> bool:
    """Take the build lock without waiting, kept in `held`; False when a build holds it. Without `create` (a dry
    run) a lock file that is not there is not made: no build has it then."""
    try:
        fd = os.open(lock, (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_CLOEXEC, 0o666)
    except FileNotFoundError:
        return True
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def image_leftovers(plans: list[Plan], state_dir: Path | None, held: ExitStack,
                    dry_run: bool) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """The candidates and unnamed kept builds of the variants' repositories, and what looked like one but stays.
    The build lock of each candidate's plan is taken and kept in `held` (a build of it that is running keeps
    its candidate, and none can start before prune is done)."""
    found: list[Leftover] = []
    left: list[tuple[str, str]] = []
    for repository in sorted({ImageRef.parse(p.image).repository for p in plans}):
        tags = sorted(repository_tags(repository))
        if not tags:
            continue
        data = dockercli.inspect_images(*tags)
        ids = {t: str(d.get("Id")) for t, d in data.items() if d is not None}
        kept_names, learnt = named_by_records(repository, state_dir)
        current = {p.tag for p in plans} | {p.moving_tag for p in plans}
        protected = {ids[t] for t in tags if t in ids and (t in current or t in kept_names)} | learnt
        chosen: list[str] = []
        for tag in tags:
            name = ImageRef.parse(tag).tag or ""
            kind = "candidate" if name.endswith(CANDIDATE) else "kept build" if KEPT_RE.search(name) else None
            if kind is None or tag not in ids:
                continue
            if tag in kept_names:
                left.append((tag, "a deploy record names it"))
            elif ids[tag] in protected:
                left.append((tag, "its image is also a current or deployed build"))
            elif kind == "kept build" and KEPT_RE.sub("", tag) in kept_names:
                # after `build --move-tag` the build a deploy record names by TAG is the one kept as TAG.<hex>
                left.append((tag, f"a deploy record names {KEPT_RE.sub('', tag)}, whose earlier build it may be"))
            elif kind == "candidate" and not hold_if_idle(build_lock(tag), held, create=not dry_run):
                left.append((tag, "a build of it is running"))
            else:
                chosen.append(tag)
        for tag in chosen:
            others = [t for t in tags if t not in chosen and ids.get(t) == ids[tag]]
            first = next(t for t in chosen if ids[t] == ids[tag])
            found.append(Leftover("candidate" if tag.endswith(CANDIDATE) else "kept build", tag,
                                  int((data[tag] or {}).get("Size") or 0), shared=bool(others) or first != tag))
    return found, left


def wheel_leftovers(plans: list[Plan], root: Path) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """The wheel-cache entries no variant's plan would use; none when a git-source variant's key is unknown."""
    from ..build.wheelkey import base_identity, cache_key, key_inputs
    from ..build.wheels import entries

    found = entries(root)
    if not found:
        return [], []
    wanted = set()
    for plan in plans:
        if plan.vllm.source != "git":
            continue
        inputs, why = key_inputs(plan, base_identity(plan))
        if inputs is None:
            return [], [(f"the wheel cache {root}", f"variant {plan.variant}'s wheel key is unknown ({why}); every "
                                                   "wheel stays (`wheels prune` removes by age or key)")]
        wanted.add(cache_key(inputs))
    return ([Leftover("wheel", e.key, e.size) for e in found if e.key not in wanted],
            [(f"wheel {e.key[:12]}", "a variant's build uses it") for e in found if e.key in wanted])


def wheel_set_leftovers(named: set[Path], held: ExitStack,
                        dry_run: bool) -> tuple[list[Leftover], list[tuple[str, str]]]:
    """The downloaded wheel sets not among `named` (named_sets), each with the downloads no set that stays shares.
    A set whose fetch is running (its lock is held) stays; its lock is taken otherwise, and kept in `held`."""
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
    """The wheel-set folders the variants' locks name: each lock's own set for its own Python target, a lock the
    recipe has changed since included (locking again may well name that set once more)."""
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
    count = total = 0
    for line in done.stdout.splitlines():
        if line.strip():
            try:
                total += _bytes(str(json.loads(line).get("Size", "0B")))
            except (ValueError, AttributeError):
                raise BuildError(f"docker buildx du printed a line that is not a cache record: {line[:120]}",
                                 field="docker buildx du") from None
            count += 1
    return count, total


def _bytes(text: str) -> int:
    """A size as docker prints one (4.096kB, 1.2GB) in bytes."""
    m = re.fullmatch(r"([0-9.]+)\s*([kKMGT]?B)", text.strip())
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * UNITS[m.group(2)])


def find(plans: list[Plan], *, state_dir: Path | None, wheel_root: Path | None, build_cache: bool,
         held: ExitStack, dry_run: bool, named: set[Path] | None = None) -> Prune:
    """What prune would remove; `named`: the wheel sets the locks name (named_sets), looked at with wheel_root."""
    images, left = image_leftovers(plans, state_dir, held, dry_run)
    wheels, wheels_left = wheel_leftovers(plans, wheel_root) if wheel_root is not None else ([], [])
    if wheel_root is not None and named is not None:
        sets, sets_left = wheel_set_leftovers(named, held, dry_run)
        wheels, wheels_left = wheels + sets, wheels_left + sets_left
    count, size = cache_records() if build_cache else (0, 0)
    cache = [Leftover("build cache", f"{count} records", size)] if count else []
    return Prune(tuple(images + wheels + cache), tuple(left + wheels_left))


def remove(found: Prune, wheel_root: Path | None, say: Callable[[Leftover], None]) -> list[tuple[Leftover, str]]:
    """Remove each leftover, saying each once it is gone; one that cannot be removed (a container uses the image)
    is passed over and returned with why. Tags go with `docker image rm --no-prune` (the layers another image
    uses stay); wheels as `wheels prune --key` removes them; a wheel set with the downloads no set that stays
    shares; the cache with `docker builder prune --filter`."""
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
            continue
        except OSError as exc:  # a wheel set's file that cannot be removed (a read-only cache, another owner)
            failed.append((item, f"{exc.filename or item.name}: {exc.strerror or exc}"))
            continue
        say(item)
    return failed


def prune_head(layout: Layout, *, wheel_root: Path | None, build_cache: bool, dry_run: bool,
               state_dir: Path | None = None,
               say: Callable[[Leftover], None] = lambda item: None) -> tuple[Prune, list[tuple[Leftover, str]]]:
    """`prune`: find what sparkforge's builds left on the head that nothing names (this module's first lines say
    what), and remove it unless dry_run; what could not be removed comes back with why. Every recipe must load:
    a variant whose tags are unknown could lose a build it still names. wheel_root None: no wheel is looked at."""
    loaded, errors = list_plans(layout)
    if errors:
        raise ConfigError(f"prune needs every recipe to load, to know which tags they name: {errors[0].detail}",
                          path=errors[0].path, field=errors[0].field)
    plans = [x.plan for x in loaded]
    with ExitStack() as held:
        found = find(plans, state_dir=state_dir, wheel_root=wheel_root, build_cache=build_cache, held=held,
                     dry_run=dry_run, named=named_sets(layout, loaded) if wheel_root is not None else None)
        failed = [] if dry_run else remove(found, wheel_root, say)
    return found, failed
