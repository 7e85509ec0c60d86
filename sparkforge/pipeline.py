"""One library entry per verb: the command line, the benchmarks and the tests call these.

Every verb starts from `load_plan`, so `show`, `build`, `test`, `push`, `deploy` and `status`
always resolve a variant to the same plan, and so to the same tag: the recipe chain, the base a
`--base` swaps in, then the lock beside the recipe when it agrees with the recipe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from packaging.version import InvalidVersion, Version

from .builder import BuildOptions, BuildResult, Step, build_image, buildx_command, image_ids, keep_candidate, promote
from .checkmods import ALREADY, APPLIED, FAILED, UNVERIFIED, MatrixCell, Row, check_variant, matrix
from .errors import BuildError, ConfigError
from .lock import (
    BuiltFrom,
    Lock,
    apply_lock,
    check_lock,
    compare,
    existing_epoch,
    lock_path,
    make_lock,
    pinned_plan,
    read_lock,
    write_lock,
)
from .plan import PROJECT_ROOT, Layout, Mod, Plan, plan_variant, rehash
from .render import Context, render_context
from .resolve import resolve_pins, today_epoch
from .smoke import TierResult, run_static
from .sources import release_versions


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


def load_plan(layout: Layout, variant: str, *, base: str | None = None,
              lock_policy: LockPolicy = LockPolicy.AUTO) -> LoadedPlan:
    """The one way from a variant name to its plan: recipe chain, `--base`, then the lock.

    Raises ConfigError when the recipe is bad, or (LOCKED) when there is no lock or the recipe
    changed after it was locked.
    """
    plan = plan_variant(layout, variant, base=base)
    path = lock_path(layout.images_dir, variant)
    if lock_policy is LockPolicy.IGNORE:
        return LoadedPlan(plan, None)
    if not path.exists():
        if lock_policy is LockPolicy.LOCKED:
            raise ConfigError(f"no lock file: run `python build.py lock {variant}` first", path=path,
                              field="--locked")
        return LoadedPlan(plan, None)
    lock = read_lock(path)
    if lock_policy is LockPolicy.LOCKED:
        check_lock(plan, lock, path)
    else:
        stale = compare(plan, lock)
        if stale:
            first = stale[0]
            return LoadedPlan(plan, None, (f"{path.name} not used: {first.field}: recipe says {first.recipe}, lock "
                                           f"says {first.lock} (lock again, or pass --locked to refuse)",))
    return LoadedPlan(apply_lock(plan, lock), path, (), tuple(lock.unresolved()))


def with_epoch(plan: Plan, epoch: int) -> Plan:
    """The plan built with SOURCE_DATE_EPOCH=epoch (part of its identity, so of its tag)."""
    return plan if plan.source_date_epoch == epoch else rehash(replace(plan, source_date_epoch=epoch))


def context_dir(plan: Plan) -> Path:
    """Where a build of the plan renders its context: one folder per plan, reused by rebuilds."""
    return PROJECT_ROOT / "build" / "contexts" / f"{plan.variant}-{plan.plan_hash[:12]}"


@dataclass(frozen=True)
class DryRun:
    """What `build` would do, computed without writing a file or asking Docker."""

    tag: str
    moving_tag: str
    command: tuple[str, ...]
    context: Path


def dry_run(plan: Plan, opts: BuildOptions) -> DryRun:
    ctx = Context(context_dir(plan), ())
    return DryRun(plan.tag, plan.moving_tag, tuple(buildx_command(plan, ctx, opts)), ctx.path)


@dataclass(frozen=True)
class BuildOutcome:
    """A build that finished: the image, its smoke tier (None when skipped) and what was tagged."""

    result: BuildResult
    static: TierResult | None
    smoke_already_passed: bool
    tagged: tuple[str, ...]


def kept_message(plan: Plan, before: str | None) -> str:
    """Where the moving tag still points after a failure."""
    if before:
        return f"{plan.moving_tag} still points to {before[:19]}"
    return f"{plan.moving_tag} was not created"


def build_variant(plan: Plan, layout: Layout, opts: BuildOptions, *, smoke: bool = True,
                  progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                  on_smoke: Callable[[TierResult], None] = lambda result: None) -> BuildOutcome:
    """Render, build, run the static smoke tier, then tag: the immutable tag and the moving tag
    move only after the tier passes. A failure raises BuildError saying where the tags still are;
    an image that fails its smoke test keeps only a candidate tag."""
    ctx = render_context(plan, layout, context_dir(plan))
    try:
        result = build_image(plan, ctx, opts, progress=progress)
    except BuildError as exc:
        exc.detail += "; " + kept_message(plan, image_ids(plan.moving_tag)[plan.moving_tag])
        raise
    now = image_ids(plan.tag, plan.moving_tag, result.candidate)
    static = None
    already = smoke and now[plan.tag] == result.image_id
    if smoke and not already:
        static = run_static(result.image_id)
        on_smoke(static)
        if not static.ok:
            raise BuildError(f"static smoke tier failed; image left as {keep_candidate(result)}; "
                             f"{kept_message(plan, now[plan.moving_tag])}", field=plan.variant)
    return BuildOutcome(result, static, already, tuple(promote(result, now)))


# ------------------------------------------------------------------ lock


def image_id_of(ref: str) -> str:
    """The image ID of a reference, or the reference itself when it is an ID or unknown."""
    return ref if ref.startswith("sha256:") else (image_ids(ref)[ref] or ref)


def lock_variant(plan: Plan, layout: Layout, opts: BuildOptions, *, epoch: int | None = None,
                 no_build: bool = False, image: str | None = None,
                 say: Callable[[str], None] = lambda line: None,
                 progress: Callable[[Step, float], None] = lambda step, elapsed: None) -> tuple[Path, Lock]:
    """Resolve what the recipe leaves open and write images/VARIANT.lock.json.

    `plan` is the recipe's plan without a lock (LockPolicy.IGNORE). The installed packages come
    from a real build of the pinned plan, or from `image`; with `no_build` they are marked
    unresolved. Nothing is written until everything that can be resolved was.
    """
    from .inspect import read_record

    if no_build and image:
        raise ConfigError("--no-build and --image exclude each other", field="--image")
    path = lock_path(layout.images_dir, plan.variant)
    sde = epoch or existing_epoch(path) or today_epoch()
    pins = resolve_pins(plan, say=say)
    packages = built_from = unresolved = None
    if no_build:
        unresolved = (f"not taken from a real build (lock --no-build): this needs a build of {plan.variant} on its "
                      f"real base, e.g. on a GB10 machine that reaches its registry and GitHub; run `python build.py "
                      f"lock {plan.variant}` there")
    else:
        if image is None:
            to_build = pinned_plan(plan, pins, sde)
            say(f"building {to_build.tag} to see what it installs")
            ctx = render_context(to_build, layout, context_dir(to_build))
            image = build_image(to_build, ctx, replace(opts, source_date_epoch=sde), progress=progress).image_id
        record, _ = read_record(image)
        if "packages" not in record:
            raise ConfigError(f"the build record of {image} lists no packages (built by an older sparkforge); "
                              "build it again", field="--image")
        packages = record["packages"]
        built_from = BuiltFrom(image_id_of(image), record["plan_hash"])
    lock = make_lock(plan, pins, sde, packages=packages, packages_unresolved=unresolved, built_from=built_from)
    write_lock(path, lock)
    return path, lock


# ------------------------------------------------------------------ check-mods


@dataclass(frozen=True)
class ModsReport:
    """What check-mods found: a row per variant and mod, and (with a matrix) a cell per mod and release."""

    rows: tuple[Row, ...]
    mods: tuple[Mod, ...] = ()  # the vLLM mods of the matrix
    versions: tuple[str, ...] = ()
    cells: tuple[MatrixCell, ...] = ()

    def in_state(self, state: str) -> list[Row]:
        return [r for r in self.rows if r.state == state]

    def cell(self, mod: str, version: str) -> MatrixCell:
        return next(c for c in self.cells if c.mod == mod and c.version == version)

    @property
    def matrix_failed(self) -> bool:
        """A release that a mod declares, where it does not apply (unverified cells aside)."""
        return any(c.declared and c.state not in (APPLIED, ALREADY, UNVERIFIED) for c in self.cells)

    def failed(self, strict: bool) -> bool:
        return bool(self.in_state(FAILED)) or self.matrix_failed or (strict and bool(self.in_state(UNVERIFIED)))


def release_range(since: str, until: str | None) -> tuple[Version, Version | None]:
    """The --since/--until bounds as versions; a bad one is bad input, named by its option."""
    bounds = []
    for flag, value in (("--since", since), ("--until", until)):
        try:
            bounds.append(None if value is None else Version(value))
        except InvalidVersion:
            raise ConfigError(f"{value!r} is not a release version such as 0.17.0", field=flag) from None
    return bounds[0], bounds[1]


def check_mods(plans: list[Plan], workdir: Path, *, matrix_range: tuple[str, str | None] | None = None,
               say: Callable[[str], None] = lambda line: None) -> ModsReport:
    """Apply each variant's mods to the real source they target; with a range, also try each vLLM
    mod alone against every vLLM release in it."""
    if matrix_range is not None:
        low, high = release_range(*matrix_range)
    rows: list[Row] = []
    for plan in plans:
        say(f"checking {plan.variant} ({len(plan.mods)} mods)")
        rows += check_variant(plan, workdir)
    if matrix_range is None:
        return ModsReport(tuple(rows))
    mods = {m.name: m for p in plans for m in p.mods if m.spec.component == "vllm"}
    versions = [v for v in release_versions("vllm") if Version(v) >= low and (high is None or Version(v) <= high)]
    cells = matrix(list(mods.values()), versions, workdir, progress=lambda v: say(f"matrix: vllm {v}"))
    return ModsReport(tuple(rows), tuple(mods.values()), tuple(versions), tuple(cells))
