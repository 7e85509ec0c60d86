"""The library entries of the checking verbs (check-mods, verify-repro, outdated, bump), for the CLI and tests."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Callable

from packaging.version import InvalidVersion, Version

from ..build.builder import BuildOptions, Step
from ..build.pipeline import context_dir, prepare_wheel, same_plan_lock, with_epoch, with_wheel, with_wheel_set
from ..build.render import render_context
from .. import inimage
from ..errors import ConfigError, DownloadError
from ..recipe import scaffold
from ..recipe.config import list_variants
from ..recipe.layout import PROJECT_ROOT, Layout
from ..recipe.plan import Mod, Plan
from ..recipe.remote import materialize
from ..recipe.sources import SourceUnavailable, release_versions
from .checkmods import MatrixCell, Row, RowState, check_env, check_variant, matrix, release_progress, source_of

if TYPE_CHECKING:  # imported where they run: their modules load only for their verbs
    from ..recipe.lockfile import Lock
    from .bump import Bump
    from .outdated import Report
    from .repro import ReproResult


@dataclass(frozen=True)
class ModsReport:
    """What check-mods found: a row per variant and mod, and (with a matrix) a cell per mod and release."""

    rows: tuple[Row, ...]
    mods: tuple[Mod, ...] = ()  # the vLLM mods of the matrix
    versions: tuple[str, ...] = ()
    cells: tuple[MatrixCell, ...] = ()

    def in_state(self, state: RowState) -> list[Row]:
        return [r for r in self.rows if r.state == state]

    def failed(self, strict: bool) -> bool:
        """A failed row, a release a mod declares where it does not apply, or with strict an unverified row."""
        done = (RowState.APPLIED, RowState.ALREADY, RowState.UNVERIFIED)
        return (bool(self.in_state(RowState.FAILED)) or any(c.declared and c.state not in done for c in self.cells)
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


def changed_files(since: str, folder: Path) -> list[Path]:
    """The files git sees changed since the commit `since` (committed, staged, in the work tree, or untracked)."""
    from ..inimage.proc import CommandError, run

    def git(*args: str) -> str:
        try:
            proc = run(["git", "-C", str(folder), *args], timeout=120, capture_output=True, text=True)
        except CommandError as exc:
            raise ConfigError(f"git: {exc}", field="--changed-since") from None
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or [f"no commit {since!r} in this clone"])[-1]
            raise ConfigError(f"git cannot compare with {since!r}: {tail.removeprefix('fatal: ')} (a shallow clone "
                              "needs its history: fetch-depth: 0)", field="--changed-since") from None
        return proc.stdout

    top = Path(git("rev-parse", "--show-toplevel").strip())
    # Read as a commit, never as an option of git's (`--output=FILE`); the diff then names the commit itself.
    commit = git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{since}^{{commit}}").strip()
    names = git("diff", "--name-only", "-z", commit, "--").split("\0")
    names += git("ls-files", "--others", "--exclude-standard", "-z").split("\0")
    return sorted({(top / n).resolve() for n in names if n})


def touched_variants(layout: Layout, plans: list[Plan], changed: list[Path]) -> list[tuple[str, str]]:
    """The variants a change touches (a recipe of its chain, its lock, a file of its mods), each with the first such
    file; a change of the package or the template touches every variant."""
    from ..recipe.lockfile import lock_path

    tool = [p for p in changed if p.is_relative_to(layout.inimage.parent) or p == layout.template.resolve()]
    out = []
    for plan in plans:
        mine = {(layout.images_dir / Path(f).name).resolve() for f in plan.recipe_files}
        mine.add(lock_path(layout.images_dir, plan.variant).resolve())
        folders = [Path(m.folder).resolve() for m in plan.mods]
        hit = next((p for p in changed if p in mine or any(p.is_relative_to(f) for f in folders)), None)
        if hit is not None or tool:
            out.append((plan.variant, str(hit or tool[0])))
    return out


def check_mods(plans: list[Plan], *, matrix_range: tuple[str, str | None] | None = None,
               say: Callable[[str], None] = lambda line: None, ca_cert: Path | None = None) -> ModsReport:
    """Apply each variant's mods to the real source they target; with a range, also try each vLLM mod alone
    against every vLLM release in it."""
    if matrix_range is not None:
        low, high = release_range(*matrix_range)
    with tempfile.TemporaryDirectory(prefix="sparkforge-check-") as work:
        rows: list[Row] = []
        for plan in plans:
            say(f"checking {plan.variant} ({len(plan.mods)} mods)")
            rows += check_variant(plan, Path(work), ca_cert=ca_cert) + check_env(plan, Path(work), ca_cert=ca_cert)
        if matrix_range is None:
            return ModsReport(tuple(rows))
        mods = {m.name: m for p in plans for m in p.mods if m.spec.component == "vllm"}
        versions = [v for v in release_versions("vllm") if Version(v) >= low and (high is None or Version(v) <= high)]
        cells = matrix(list(mods.values()), versions, Path(work),
                       progress=release_progress(say, "matrix: vllm", len(versions)), ca_cert=ca_cert)
    return ModsReport(tuple(rows), tuple(mods.values()), tuple(versions), tuple(cells))


DEFAULT_EPOCH = 1704067200  # 2024-01-01T00:00:00Z: verify-repro's epoch when neither a lock nor the option gives one


def repro_plan(plan: Plan, epoch: int | None = None) -> Plan:
    """The plan verify-repro builds: with --source-date-epoch, else the lock's, else DEFAULT_EPOCH."""
    return with_epoch(plan, epoch or plan.source_date_epoch or DEFAULT_EPOCH)


def verify_variant_repro(plan: Plan, layout: Layout, opts: BuildOptions, *, keep: Path | None = None,
                         progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                         say: Callable[[str], None] = lambda line: None) -> ReproResult:
    """Two --no-cache builds of a plan from repro_plan, compared; the tarballs and logs are kept in `keep`."""
    from .repro import verify_repro

    with same_plan_lock(plan, say):
        wheel, _ = prepare_wheel(plan, layout, opts, None, say)  # a git source compiles: that is what is compared
        ctx = render_context(plan, layout, context_dir(plan), wheel, ca_cert=opts.ca_cert)
        opts = with_wheel_set(plan, with_wheel(opts, wheel), say)
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


def new_local_mod(layout: Layout, plan: Plan, name: str, *, component: str = "vllm", phase: str = "install",
                  versions: str | None = None, ca_cert: Path | None = None) -> scaffold.WorkTree:
    """`mod new NAME --variant V`: mods/NAME/mod.yaml and a git work tree of the source it patches, as built."""
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
        raise ConfigError("an image mod adds files: write a `files` mod (see docs/mods.md)", field="--component")
    # The mods the build applies to this source before the new one, in the build's order: a source-phase mod
    # comes after the variant's source-phase mods; an install-phase one after those and the install-phase ones.
    before = sorted((m for m in plan.mods if m.spec.component == component and (phase == "install" or
                     m.spec.phase == "source")), key=lambda m: m.spec.phase != "source")

    def earlier(root: Path) -> str:
        for mod in before:
            spec, folder = materialize(mod, ca_cert)
            result = inimage.apply_mod(spec, folder, root)
            if result.state == inimage.ModState.FAILED:
                raise ConfigError(f"mod {mod.name}, which {plan.variant} applies before this one, does not apply "
                                  f"to {ref.label}: {result.detail}; fix it first (check-mods {plan.variant})",
                                  field="--variant")
        return ", ".join(m.name for m in before)

    return scaffold.new_local_mod(layout.mods_dir, name, variant=plan.variant, component=component, phase=phase,
                                  versions=versions, tree=tree, source=ref.label, earlier=earlier)


def save_local_mod(layout: Layout, name: str) -> tuple[scaffold.WorkTree, scaffold.SavedPatch]:
    """`mod save NAME`: the patch from the work tree `mod new` made, written into the mod."""
    work = scaffold.read_work_tree(name)
    return work, scaffold.save_patch(layout.mods_dir, work)


@dataclass(frozen=True)
class BumpResult:
    bump: Bump
    written: bool  # False: --dry-run
    lock_path: Path | None = None
    lock: Lock | None = None


def bump_variant(plan: Plan, layout: Layout, opts: BuildOptions, *, to: str | None, latest: bool, name: str | None,
                 dry_run: bool, lock: bool, command: str, say: Callable[[str], None] = lambda line: None) -> BumpResult:
    """`bump`: a new variant for a newer vLLM release, written unless dry_run; with lock, `lock --no-build` of it."""
    from ..build.pipeline import lock_variant
    from ..recipe.planner import plan_variant
    from .bump import prepare, write

    bump = prepare(plan, layout, to=to, latest=latest, name=name, command=command, say=say)
    if dry_run:
        return BumpResult(bump, written=False)
    write(bump)
    if not lock:
        return BumpResult(bump, written=True)
    say(f"lock --no-build {bump.recipe.stem}")
    path, locked = lock_variant(plan_variant(layout, bump.recipe.stem), layout, opts, no_build=True, say=say)
    return BumpResult(bump, written=True, lock_path=path, lock=locked)
