"""One library entry per verb of the build stage (list, show, render, build, test, lock); the checking verbs
(check-mods, verify-repro, outdated) are in repro.verbs. Every verb starts from `load_plan`, so all of them
resolve a variant to the same plan, and so to the same tag."""

from __future__ import annotations

import enum
import os
import shutil
import tempfile
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

from ..errors import BuildError, ConfigError, Hint
from ..files import locked
from ..recipe.config import list_variants
from ..recipe.lock import apply_lock, check_lock, compare, keep_pins, make_lock, pinned_plan
from ..recipe.lockfile import BuiltFrom, Lock, LockedWheels, existing_lock, lock_path, read_lock, write_lock
from ..recipe.layout import PROJECT_ROOT, Layout
from ..recipe.plan import Plan, rehash
from ..recipe.planner import plan_variant
from ..recipe.resolve import resolve_pins, today_epoch
from ..recipe.wheelset import Unresolvable, resolve_wheel_set
from ..serve import cache_dir, model_of
from . import dockercli, prebuilt, wheelfetch, wheels
from .builder import (BASE_LABEL, BuildOptions, BuildResult, Step, build_image, buildx_command, candidate_tag,
                      current_image, drop_candidate, export_stage, promote)
from .render import Context, render_context
from .smoke import TIERS, TierResult, run_static, run_tier
from .wheels import WheelInput


class LockPolicy(str, enum.Enum):
    """How a verb treats the lock beside a recipe (images/VARIANT.lock.json)."""

    AUTO = "auto"  # use it when it agrees with the recipe; otherwise ignore it, with a warning
    LOCKED = "locked"  # require it, and refuse a recipe changed after locking
    IGNORE = "ignore"  # the recipe alone (what `lock` starts from)


@dataclass(frozen=True)
class LoadedPlan:
    """A variant's plan as every verb sees it, with the lock it came from and what to tell the user."""

    plan: Plan
    lock: Path | None  # the lock file applied, or None
    warnings: tuple[str, ...] = ()  # e.g. a lock that was not used because the recipe changed
    unresolved: tuple[tuple[str, str], ...] = ()  # (field, why) the applied lock leaves open


def load_plan(layout: Layout, variant: str, *, base: str | None = None, platform: str | None = None,
              lock_policy: LockPolicy = LockPolicy.AUTO) -> LoadedPlan:
    """The one way from a variant name to its plan: recipe chain, `--base` and `--platform`, then the lock."""
    plan = plan_variant(layout, variant, base=base, platform=platform)
    path = lock_path(layout.images_dir, variant)
    if lock_policy is LockPolicy.LOCKED and not path.exists():
        raise ConfigError("no lock file", path=path, field="--locked", hint=Hint("write one with", ("lock", variant)))
    if lock_policy is LockPolicy.IGNORE or not path.exists():
        return LoadedPlan(plan, None)
    lock = read_lock(path)
    # What the plan has from the command line rather than the recipe: a difference there is the option's.
    given = {"base.": "--base"} if base is not None else {}
    if platform is not None:
        given["platform"] = "--platform"
    if lock_policy is LockPolicy.LOCKED:
        check_lock(plan, lock, path, given)
    elif stale := compare(plan, lock):
        first = stale[0]
        said = next((option for prefix, option in given.items() if first.field.startswith(prefix)), "recipe")
        again = "lock again with the same option" if said != "recipe" else "lock again"
        return LoadedPlan(plan, None, (f"{path.name} not used: {first.field}: {said} says {first.recipe}, lock "
                                       f"says {first.lock} ({again} to use a lock)",))
    return LoadedPlan(apply_lock(plan, lock), path, (), tuple(lock.unresolved()))


def with_epoch(plan: Plan, epoch: int) -> Plan:
    """The plan built with SOURCE_DATE_EPOCH=epoch (part of its identity, so of its tag)."""
    return plan if plan.source_date_epoch == epoch else rehash(replace(plan, source_date_epoch=epoch))


def context_dir(plan: Plan) -> Path:
    """Where a build of the plan renders its context: one folder per plan, reused by rebuilds."""
    return PROJECT_ROOT / "build" / "contexts" / f"{plan.variant}-{plan.plan_hash[:12]}"


SAME_PLAN_WAIT = 6 * 3600  # seconds a build waits for another of the same plan: longer than a cold GB10 compile


def same_plan_lock(plan: Plan, say: Callable[[str], None] = lambda line: None) -> AbstractContextManager[None]:
    """Held from render to tags: a second build of one plan waits for the first, then finds its cache."""
    ctx = context_dir(plan)
    lock = ctx.parent / f"{ctx.name}.lock"
    return locked(lock, timeout=SAME_PLAN_WAIT, what=f"builds {plan.tag}",
                  on_wait=lambda: say(f"waiting for another build of {plan.tag} to finish (lock {lock})"))


def list_plans(layout: Layout) -> tuple[list[LoadedPlan], list[ConfigError]]:
    """Every variant's plan, as `show` sees it, and an error for each recipe that does not load."""
    plans, errors = [], []
    for name in list_variants(layout.images_dir):
        try:
            plans.append(load_plan(layout, name))
        except ConfigError as exc:
            errors.append(exc)
    return plans, errors


def render_variant(plan: Plan, layout: Layout, output: Path | None = None, *,
                   ca_cert: Path | None = None) -> Context:
    """`render`: write the context to output (default build/VARIANT), refusing an unwritable one up front."""
    out_dir = (output or PROJECT_ROOT / "build" / plan.variant).absolute()
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError("is a file, not a folder: choose a new or empty folder", path=existing, field="--output")
    # The context is staged beside out_dir and swapped in, so it is the folder above that is written.
    above = next(p for p in out_dir.parents if p.exists())
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError("cannot write here (permission denied): choose another folder", path=above,
                          field="--output")
    return render_context(plan, layout, out_dir, ca_cert=ca_cert)


NETWORKS = ("host", "none", "default")


def build_options(*, network: str = "host", ca_cert: Path | None = None, **options: Any) -> BuildOptions:
    """BuildOptions from the command line's words: `--network default` is BuildKit's own network."""
    if network not in NETWORKS:
        raise ConfigError(f"unknown network {network!r}; choose {', '.join(NETWORKS)}", field="--network")
    if ca_cert is not None and not ca_cert.is_file():
        raise ConfigError("CA bundle not found", path=ca_cert, field="--ca-cert")
    return BuildOptions(network=None if network == "default" else network, ca_cert=ca_cert, **options)


@dataclass(frozen=True)
class DryRun:
    """What `build` would do, computed without writing a file or asking Docker."""

    tag: str
    moving_tag: str
    command: tuple[str, ...]
    context: Path
    note: str = ""  # what the command does not show


def dry_run(plan: Plan, opts: BuildOptions, wheel_cache: bool = True) -> DryRun:
    """The command of a build; for a git source, the compiling one (the wheel cache is looked at by the build)."""
    ctx = Context(context_dir(plan), ())
    notes = []
    if plan.vllm.source == "wheel":
        opts = with_wheel(opts, prebuilt.planned_wheel(plan))
    elif plan.vllm.source == "git" and wheel_cache:
        notes.append("a build first looks in the wheel cache, whose key needs the engine (not asked here); this is "
                     "the command of --no-wheel-cache, which compiles inside the image build")
    if plan.wheel_set:
        opts = with_wheel_set(plan, opts, fetch=False)
        notes.append("a build first downloads the wheel set into the wheel-set folder (what is not there yet)")
    if plan.base.digest.value is None:
        notes.append(f"the base has no digest: a build also gives --label {BASE_LABEL}=BASE, the base as the engine "
                     "holds it then (not asked here)")
    command = tuple(buildx_command(plan, ctx, opts, tag=candidate_tag(plan)))
    return DryRun(plan.tag, plan.moving_tag, command, ctx.path, "; ".join(notes))


def with_wheel(opts: BuildOptions, wheel: WheelInput | None) -> BuildOptions:
    """The options of a build that installs `wheel`: its folder is the named build context vllm-wheel."""
    return replace(opts, contexts=((wheels.CONTEXT, str(wheel.folder)),)) if wheel else opts


def with_wheel_set(plan: Plan, opts: BuildOptions, say: Callable[[str], None] = lambda line: None, *,
                   fetch: bool = True) -> BuildOptions:
    """The options of a build that installs the plan's wheel set (fetched first unless a dry run says not)."""
    if not plan.wheel_set:
        return opts
    folder = wheelfetch.fetch(plan, ca_cert=opts.ca_cert, say=say) if fetch else wheelfetch.set_folder(plan)
    return replace(opts, contexts=(*opts.contexts, (wheelfetch.CONTEXT, str(folder))))


@dataclass(frozen=True)
class WheelNote:
    """Which vLLM wheel a build installed: compiled, from the wheel cache, or the recipe's; and why."""

    origin: str  # "compiled", "cache", "recipe", "release" (pypi) or "base" (the base image's own)
    sha256: str | None = None
    key: str | None = None  # the wheel cache key, where the source is git and the key could be made
    why_compiled: str = ""  # origin "compiled": why the cache did not give the wheel
    stored: bool = False  # origin "compiled": the wheel went into the cache


@dataclass(frozen=True)
class BuildOutcome:
    """A build that finished: the image, its smoke tier (None when skipped) and what was tagged."""

    result: BuildResult
    static: TierResult | None
    smoke_already_passed: bool
    tagged: tuple[str, ...]
    wheel: WheelNote = WheelNote("release")
    replaced: str | None = None  # the one line when the immutable tag named another image (builder.promote)


def prepare_wheel(plan: Plan, layout: Layout, opts: BuildOptions, wheel_cache: Path | None,
                  say: Callable[[str], None] = lambda line: None,
                  progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                  ) -> tuple[WheelInput | None, WheelNote]:
    """The vLLM wheel the image build installs (None: it compiles, or installs a release), made ready first; on
    a wheel cache miss the compile runs now and stores it, so a hit and a miss give the same Dockerfile."""
    if plan.vllm.source == "wheel":
        wheel = prebuilt.recipe_wheel(plan, layout, ca_cert=opts.ca_cert)
        say(f"vLLM wheel: {wheel.wheel}, sha256 {wheel.sha256[:12]} (checked)")
        return wheel, WheelNote("recipe", wheel.sha256)
    if plan.vllm.source != "git":
        return None, WheelNote("base" if plan.vllm.source == "base" else "release")
    if wheel_cache is None:
        return None, WheelNote("compiled", why_compiled="the wheel cache is off")
    found = wheels.lookup(plan, wheel_cache, opts.docker_host)
    if found.wheel and found.key:  # a hit always has its key
        say(f"vLLM wheel: from the wheel cache ({found.key[:12]}, compiled for {found.wheel.compiled_for}); "
            "no compile")
        return found.wheel, WheelNote("cache", found.wheel.sha256, found.key)
    if found.inputs is None:
        say(f"vLLM wheel: the image build will compile it, without the wheel cache: {found.why_not}")
        return None, WheelNote("compiled", why_compiled=found.why_not)
    say(f"vLLM wheel: compiling, because {found.why_not}")
    ctx = render_context(plan, layout, context_dir(plan), ca_cert=opts.ca_cert)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        wheels.claim(wheel_cache)
        export = Path(tempfile.mkdtemp(prefix=".export.", dir=wheel_cache))
    except OSError as exc:
        raise BuildError(f"cannot write the wheel cache: {exc.strerror or exc} (build with --no-wheel-cache, or give "
                         "a writable --wheel-cache)", path=wheel_cache, field="--wheel-cache") from None
    try:
        compiled = export_stage(plan, ctx, opts, "wheel-export", export, progress)
        entry = wheels.store(wheel_cache, found.inputs, export, f"{plan.variant}-{plan.plan_hash[:12]} at {stamp}")
    except OSError as exc:
        raise BuildError(f"cannot store the compiled wheel in the wheel cache: {exc.strerror or exc}",
                         path=wheel_cache, field="--wheel-cache") from None
    finally:
        shutil.rmtree(export, ignore_errors=True)
    say(f"vLLM wheel: compiled and stored in the wheel cache ({entry.key[:12]}, sha256 {entry.sha256[:12]}) in "
        f"{compiled.seconds:.1f}s; compile log: {compiled.log_path}")
    return wheels.as_input(entry), WheelNote("compiled", entry.sha256, entry.key, why_compiled=found.why_not,
                                             stored=True)


def kept_message(plan: Plan, before: str | None) -> str:
    """Where the moving tag still points after a failure."""
    return f"{plan.moving_tag} still points to {before[:19]}" if before else f"{plan.moving_tag} was not created"


def build_variant(plan: Plan, layout: Layout, opts: BuildOptions, *, smoke: bool = True,
                  wheel_cache: Path | None = None,
                  progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                  on_smoke: Callable[[TierResult], None] = lambda result: None,
                  say: Callable[[str], None] = lambda line: None, move_tag: bool = False) -> BuildOutcome:
    """Render, build, run the static smoke tier, then tag (builder.promote): no tag moves before the tier passes,
    and nothing is written before the engine answers. A failure says where the tags still are."""
    dockercli.require_engine(opts.docker_host)
    with same_plan_lock(plan, say):
        try:
            wheel, note = prepare_wheel(plan, layout, opts, wheel_cache, say, progress)
            ctx = render_context(plan, layout, context_dir(plan), wheel, ca_cert=opts.ca_cert)
            result = build_image(plan, ctx, with_wheel_set(plan, with_wheel(opts, wheel), say), progress=progress,
                                 also=(plan.tag, plan.moving_tag))
        except BuildError as exc:
            exc.detail += "; " + kept_message(plan, current_image(plan.moving_tag))
            raise
        now = result.tags
        static = None
        already = smoke and now[plan.tag] == result.image_id
        if smoke and not already:
            static = run_static(result.image_id)
            on_smoke(static)
            if not static.ok:
                first = next(c for c in static.checks if c.state == "failed")
                dockercli.run(["tag", result.image_id, result.candidate])  # kept to be looked into; no other tag moves
                raise BuildError(f"static smoke tier failed ({first.name}: {first.detail}); image left as "
                                 f"{result.candidate}; {kept_message(plan, now[plan.moving_tag])}",
                                 field=plan.variant)
        tagged, replaced = promote(result, now, move=move_tag)
        return BuildOutcome(result, static, already, tagged, note, replaced)


def test_variant(plan: Plan, tiers: list[str], *, image: str | None = None,
                 model: str | None = None) -> list[TierResult]:
    """Run smoke tiers in the variant's image (or `image`); serve loads `model` (None: the tiny offline one)."""
    if unknown := [t for t in tiers if t not in TIERS]:
        raise ConfigError(f"unknown tier {unknown[0]!r}; choose from {', '.join(TIERS)}", field="--tier")
    ref = image or plan.tag
    if current_image(ref) is None:
        if image:  # an --image that names nothing is bad input (exit 2)
            raise ConfigError(f"image {image} not found in the local engine", field="--image")
        raise BuildError(f"image {ref} not found", field=plan.variant,
                         hint=Hint("build it first with", ("build", plan.variant)))
    served = None
    if "serve" in tiers:
        try:
            served = model_of(model, cache_dir())
        except FileNotFoundError as exc:
            raise ConfigError(str(exc.strerror), path=model, field="--model") from None
    return [run_tier(t, ref, served, cpu=plan.on_cpu) for t in tiers]


# ------------------------------------------------------------------ lock


def lock_variant(plan: Plan, layout: Layout, opts: BuildOptions, *, epoch: int | None = None,
                 no_build: bool = False, image: str | None = None,
                 say: Callable[[str], None] = lambda line: None,
                 progress: Callable[[Step, float], None] = lambda step, elapsed: None) -> tuple[Path, Lock]:
    """Resolve what the recipe's plan (without a lock) leaves open and write images/VARIANT.lock.json; the
    installed packages come from a real build of the pinned plan, or `image`, or (no_build) stay unresolved."""
    from .inspect import read_record

    if no_build and image:
        raise ConfigError("--no-build and --image exclude each other", field="--image")
    path = lock_path(layout.images_dir, plan.variant)
    before = existing_lock(path)
    if before is None and path.exists():
        say(f"{path.name} does not read as a lock: none of its pins, nor its epoch, is kept")
    sde = epoch or (before.source_date_epoch if before else None) or today_epoch()
    pins = resolve_pins(plan, say=say, ca_cert=opts.ca_cert)
    wheels = lock_wheels(plan, opts.ca_cert, say)
    if before is not None:
        keep_pins(path, before, make_lock(plan, pins, sde, packages=None, packages_unresolved="", wheels=wheels))
    packages = built_from = unresolved = None
    if no_build:
        unresolved = (f"not taken from a real build (lock --no-build): this needs a build of {plan.variant} on its "
                      f"real base, e.g. on a GB10 machine that reaches its registry and GitHub; run `python build.py "
                      f"lock {plan.variant}` there")
    else:
        if image is None:
            to_build = pinned_plan(plan, pins, sde, wheels)
            say(f"building {to_build.tag} to see what it installs")
            with same_plan_lock(to_build, say):
                wheel, _ = prepare_wheel(to_build, layout, opts, None, say)
                ctx = render_context(to_build, layout, context_dir(to_build), wheel, ca_cert=opts.ca_cert)
                built = build_image(to_build, ctx, with_wheel_set(to_build, with_wheel(
                    replace(opts, source_date_epoch=sde), wheel), say), progress=progress)
                image = built.image_id
                try:
                    record, _ = read_record(image)
                finally:  # only its record was wanted: no second image stays (its layers stay in the cache)
                    if built.candidate and current_image(built.candidate) == image:
                        drop_candidate(built)
        else:
            record, _ = read_record(image)
        if record.packages is None:
            raise ConfigError(f"the build record of {image} lists no packages (built by an older sparkforge); "
                              "build it again", field="--image")
        packages = record.packages
        image_id = image if image.startswith("sha256:") else current_image(image) or image
        built_from = BuiltFrom(image_id=image_id, plan_hash=record.plan_hash)
    lock = make_lock(plan, pins, sde, packages=packages, packages_unresolved=unresolved, built_from=built_from,
                     wheels=wheels)
    write_lock(path, lock)
    return path, lock


def lock_wheels(plan: Plan, ca_cert: Path | None = None,
                say: Callable[[str], None] = lambda line: None) -> LockedWheels | None:
    """The wheel set of a recipe with `python:` (else None), resolved with uv, or the reason it cannot be."""
    if plan.python is None:
        return None
    try:
        found = resolve_wheel_set(plan, ca_cert=ca_cert)
    except Unresolvable as exc:
        say(f"wheels for {plan.python.platform}: unresolved: {exc}")
        return LockedWheels.of(plan.python, None, (), f"{exc}; lock again where the index answers")
    say(f"wheels for Python {plan.python.version} on {plan.python.platform}: {len(found.packages)} wheels, "
        f"{found.download / 1e9:.2f} GB to download ({found.resolver})")
    return LockedWheels.of(found.python, found.resolver, found.packages)
