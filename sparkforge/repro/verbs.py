"""The library entries of the checking verbs: check-mods, verify-repro and outdated.

Like build.pipeline (whose plan loading, wheel and context steps they reuse), the command line and the
tests call these.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from packaging.version import InvalidVersion, Version

from ..build.builder import BuildOptions, Step
from ..build.pipeline import context_dir, prepare_wheel, same_plan_lock, with_epoch, with_wheel
from ..build.render import render_context
from ..errors import ConfigError, DownloadError
from ..recipe import scaffold
from ..recipe.config import list_variants
from ..recipe.layout import PROJECT_ROOT, Layout
from ..recipe.plan import Mod, Plan
from ..recipe.sources import SourceUnavailable, release_versions
from .checkmods import MatrixCell, Row, RowState, check_env, check_variant, matrix, source_of

if TYPE_CHECKING:  # imported where they run: their modules load only for their verbs
    from .outdated import Report
    from .repro import ReproResult

# ------------------------------------------------------------------ check-mods


@dataclass(frozen=True)
class ModsReport:
    """What check-mods found: a row per variant and mod, and (with a matrix) a cell per mod and release."""

    rows: tuple[Row, ...]
    mods: tuple[Mod, ...] = ()  # the vLLM mods of the matrix
    versions: tuple[str, ...] = ()
    cells: tuple[MatrixCell, ...] = ()

    def in_state(self, state: RowState) -> list[Row]:
        return [r for r in self.rows if r.state == state]

    def cell(self, mod: str, version: str) -> MatrixCell:
        return next(c for c in self.cells if c.mod == mod and c.version == version)

    @property
    def matrix_failed(self) -> bool:
        """A release that a mod declares, where it does not apply (unverified cells aside)."""
        done = (RowState.APPLIED, RowState.ALREADY, RowState.UNVERIFIED)
        return any(c.declared and c.state not in done for c in self.cells)

    def failed(self, strict: bool) -> bool:
        return (bool(self.in_state(RowState.FAILED)) or self.matrix_failed
                or (strict and bool(self.in_state(RowState.UNVERIFIED))))


def release_version(value: str, flag: str) -> Version:
    """A release given on the command line; a bad one is bad input, named by its option."""
    try:
        return Version(value)
    except InvalidVersion:
        raise ConfigError(f"{value!r} is not a release version such as 0.17.0", field=flag) from None


def release_range(since: str, until: str | None) -> tuple[Version, Version | None]:
    """The --since/--until bounds as versions; a bad one, or an empty range, is bad input."""
    low = release_version(since, "--since")
    high = None if until is None else release_version(until, "--until")
    if high is not None and high < low:
        raise ConfigError(f"{until} is before --since {since}: no release to try", field="--until")
    return low, high


def variants_to_check(layout: Layout, names: list[str], all_variants: bool) -> list[str]:
    """The variants check-mods looks at: those named, or with --all every one."""
    if all_variants:
        names = list_variants(layout.images_dir)
    if not names:
        raise ConfigError("name at least one variant, or use --all", field="check-mods")
    return names


def check_mods(plans: list[Plan], workdir: Path | None = None, *,
               matrix_range: tuple[str, str | None] | None = None,
               say: Callable[[str], None] = lambda line: None, ca_cert: Path | None = None) -> ModsReport:
    """Apply each variant's mods to the real source they target; with a range, also try each vLLM
    mod alone against every vLLM release in it. Without a workdir, a scratch folder is used and removed.
    ca_cert is the CA bundle for patches named by URL."""
    if matrix_range is not None:
        low, high = release_range(*matrix_range)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="sparkforge-check-") as work:
            return check_mods(plans, Path(work), matrix_range=matrix_range, say=say, ca_cert=ca_cert)
    rows: list[Row] = []
    for plan in plans:
        say(f"checking {plan.variant} ({len(plan.mods)} mods)")
        rows += check_variant(plan, workdir, ca_cert=ca_cert)
        rows += check_env(plan, workdir, ca_cert=ca_cert)
    if matrix_range is None:
        return ModsReport(tuple(rows))
    mods = {m.name: m for p in plans for m in p.mods if m.spec.component == "vllm"}
    versions = [v for v in release_versions("vllm") if Version(v) >= low and (high is None or Version(v) <= high)]
    cells = matrix(list(mods.values()), versions, workdir, progress=lambda v: say(f"matrix: vllm {v}"),
                   ca_cert=ca_cert)
    return ModsReport(tuple(rows), tuple(mods.values()), tuple(versions), tuple(cells))


# ------------------------------------------------------------------ verify-repro and outdated

DEFAULT_EPOCH = 1704067200  # 2024-01-01T00:00:00Z: verify-repro's epoch when neither a lock nor the option gives one


def repro_plan(plan: Plan, epoch: int | None = None) -> Plan:
    """The plan verify-repro builds: with --source-date-epoch, else the lock's, else DEFAULT_EPOCH."""
    return with_epoch(plan, epoch or plan.source_date_epoch or DEFAULT_EPOCH)


def verify_variant_repro(plan: Plan, layout: Layout, opts: BuildOptions, *, keep: Path | None = None,
                         progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                         say: Callable[[str], None] = lambda line: None) -> ReproResult:
    """Two --no-cache builds of a plan from repro_plan, compared; the tarballs and logs are kept in
    `keep`, else removed."""
    from .repro import verify_repro

    with same_plan_lock(plan, say):
        wheel, _ = prepare_wheel(plan, layout, opts, None, say)  # a git source compiles: that is what is compared
        ctx = render_context(plan, layout, context_dir(plan), wheel, ca_cert=opts.ca_cert)
        opts = with_wheel(opts, wheel)
        (PROJECT_ROOT / "build").mkdir(exist_ok=True)
        workdir = keep or Path(tempfile.mkdtemp(prefix=f"repro-{plan.variant}-", dir=PROJECT_ROOT / "build"))
        try:
            return verify_repro(plan, ctx, replace(opts, source_date_epoch=plan.source_date_epoch), workdir,
                                progress=progress, say=say)
        finally:
            if keep is None:
                shutil.rmtree(workdir, ignore_errors=True)


def outdated_variant(plan: Plan, *, try_mods: bool = True, until: str | None = None,
                     progress: Callable[[str], None] = lambda version: None) -> Report:
    """`outdated`: newer releases of each pinned component, and where the vLLM mods apply to them."""
    from .outdated import outdated

    if until is not None:
        release_version(until, "--until")
    with tempfile.TemporaryDirectory(prefix="sparkforge-outdated-") as work:
        return outdated(plan, Path(work), try_mods=try_mods, until=until, progress=progress)


# ------------------------------------------------------------------ a local mod: mod new --variant, mod save


def new_local_mod(layout: Layout, plan: Plan, name: str, *, component: str = "vllm", phase: str = "install",
                  versions: str | None = None, ca_cert: Path | None = None) -> scaffold.WorkTree:
    """`mod new NAME --variant V`: mods/NAME/mod.yaml and a git work tree of the pristine source the variant's
    mods of `component` are applied to (the tree check-mods fetches, from the source cache)."""
    known = {"vllm": plan.vllm.version} | {c.name: c.version.value for c in plan.components if c.kind == "pip"}
    if component not in known and component not in {c.name for c in plan.components}:
        raise ConfigError(f"{plan.variant} has no component {component!r} (it has vllm"
                          f"{''.join(f', {c.name}' for c in plan.components)})", field="--component")
    if phase == "source" and (component != "vllm" or plan.vllm.source != "git"):
        raise ConfigError(f"a source-phase mod patches the vLLM source before its compile, and {plan.variant} "
                          "compiles none (vllm.source is not git)", field="--phase")
    pinned = known.get(component)
    if versions is None and not pinned:
        raise ConfigError(f"{component} has no version pinned in {plan.variant}: give the releases the mod is for",
                          field="--versions")
    versions = versions or f"=={pinned}"
    scaffold.check_new(layout.mods_dir, name, versions)
    ref = source_of(plan, component, ca_cert)
    try:
        tree = ref.fetch()
    except SourceUnavailable as exc:
        raise DownloadError(f"cannot fetch {ref.label}, the source the mod patches: {exc}", field=plan.variant) from None
    if tree is None:
        raise ConfigError("an image mod adds files: write a `files` mod (see README, Mods)", field="--component")
    return scaffold.new_local_mod(layout.mods_dir, name, variant=plan.variant, component=component, phase=phase,
                                  versions=versions, tree=tree, source=ref.label)


def save_local_mod(layout: Layout, name: str) -> tuple[scaffold.WorkTree, scaffold.SavedPatch]:
    """`mod save NAME`: the patch from the work tree `mod new` made, written into the mod."""
    work = scaffold.read_work_tree(name)
    return work, scaffold.save_patch(layout.mods_dir, work)
