"""The command line: a thin typer layer whose verbs follow the pipeline stages.

Only this module reads flags and the environment. Every SparkforgeError becomes one line on
stderr and its exit code (2 for bad input), never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import __version__, views
from .config import list_variants, load_variant
from .builder import BuildOptions
from .errors import BuildError, SparkforgeError
from .pipeline import LoadedPlan, LockPolicy, load_plan
from .plan import PROJECT_ROOT, Layout, Plan
from .render import render_context

app = typer.Typer(
    help="Build reproducible vLLM images for DGX Spark (GB10) clusters from recipes and mods.\n\n"
    "Recipes live in images/<variant>.yaml, mods in mods/<name>/. Typical use:\n\n"
    "  python build.py list\n\n"
    "  python build.py show ng17e\n\n"
    "  python build.py render ng17e -o build/ng17e",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
def _console(stderr: bool = False) -> Console:
    # Tables stay readable in logs and pipes, where there is no terminal width to fit.
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else 200
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


out = _console()
err = _console(stderr=True)


class State:
    layout: Layout = Layout.default()


@app.callback()
def main(
    images: Optional[Path] = typer.Option(None, "--images", help="Folder of variant recipes (default: images/)."),
    mods: Optional[Path] = typer.Option(None, "--mods", help="Folder of mods (default: mods/)."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    if version:
        out.print(f"sparkforge {__version__}")
        raise typer.Exit()
    State.layout = Layout.default(PROJECT_ROOT, images_dir=images, mods_dir=mods)


def _load(variant: str, base: Optional[str] = None, *, locked: bool = False,
          policy: Optional[LockPolicy] = None) -> LoadedPlan:
    """The variant's plan as every command sees it (pipeline.load_plan); warnings go to stderr."""
    loaded = load_plan(State.layout, variant, base=base,
                       lock_policy=policy or (LockPolicy.LOCKED if locked else LockPolicy.AUTO))
    for warning in loaded.warnings:
        err.print(f"warning: {warning}", markup=False)
    return loaded


def _emit(lines) -> None:
    for line in lines:
        out.print(line)


def _plan(variant: str, base: Optional[str] = None, *, locked: bool = False,
          policy: Optional[LockPolicy] = None) -> Plan:
    return _load(variant, base, locked=locked, policy=policy).plan


BASE_HELP = "Swap the base image, as REPOSITORY:TAG[@sha256:DIGEST] (changes the tag)."


@app.command("list")
def list_cmd(names: bool = typer.Option(False, "--names", help="Print only the variant names.")) -> None:
    """List the variants with their parent, vLLM and mods."""
    if names:
        out.print("\n".join(list_variants(State.layout.images_dir)))
        return
    rows = []
    for name in list_variants(State.layout.images_dir):
        chain = load_variant(State.layout.images_dir, name).chain
        rows.append((name, chain[1] if len(chain) > 1 else "-", _plan(name)))
    out.print(views.variants_table(rows))


@app.command()
def show(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole resolved plan as JSON."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
) -> None:
    """Show the fully resolved plan of a variant, with its lock applied. Never touches Docker."""
    loaded = _load(variant, base)
    if as_json:
        sys.stdout.write(loaded.plan.to_json())
        return
    _emit(views.plan_lines(loaded))


@app.command()
def render(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder to write (default: build/VARIANT)."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
) -> None:
    """Write the Dockerfile and the build context of a variant. Never touches Docker."""
    plan = _plan(variant, base)
    ctx = render_context(plan, State.layout, output or PROJECT_ROOT / "build" / variant)
    out.print(f"rendered {plan.tag} to {ctx.path} ({len(ctx.files)} files)")




@app.command("check-mods")
def check_mods(
    variants: list[str] = typer.Argument(None, help="Variants to check (default with --all: every variant)."),
    all_variants: bool = typer.Option(False, "--all", help="Check every variant in images/."),
    show_matrix: bool = typer.Option(False, "--matrix", help="Also try each vLLM mod against a range of releases."),
    since: str = typer.Option("0.15.0", help="First vLLM release of --matrix."),
    until: Optional[str] = typer.Option(None, help="Last vLLM release of --matrix (default: the newest)."),
    strict: bool = typer.Option(False, "--strict", help="Fail also when a source could not be fetched."),
) -> None:
    """Prove that each mod applies to the real source it targets.

    For each variant, fetch the pinned source of every component its mods edit (vLLM releases
    from PyPI, cached; git where a commit is reachable), apply the variant's mods in order to a
    scratch copy, run each mod's checks, and apply again to show it is detected as already
    applied. Exits 1 when a mod fails (with --strict, also when a source could not be fetched).
    """
    import tempfile

    from .checkmods import FAILED, UNVERIFIED, applies_ranges
    from .pipeline import check_mods as run_checks

    names = list(variants or [])
    if all_variants:
        names = list_variants(State.layout.images_dir)
    if not names:
        raise SparkforgeError("name at least one variant, or use --all", field="check-mods")
    plans = [_plan(n) for n in names]
    with tempfile.TemporaryDirectory(prefix="sparkforge-check-") as work:
        report = run_checks(plans, Path(work), matrix_range=(since, until) if show_matrix else None,
                            say=lambda line: err.print(line, markup=False))
    out.print(views.check_table(report.rows, plans))
    failed, unverified = report.in_state(FAILED), report.in_state(UNVERIFIED)
    out.print(f"{len(report.rows)} checked: {len(report.rows) - len(failed) - len(unverified)} ok, "
              f"{len(failed)} failed, {len(unverified)} unverified (source not reachable from here)")
    if show_matrix:
        names = [m.name for m in report.mods]
        out.print(views.matrix_table(report.cells, names, report.versions,
                                     "mods x vLLM releases (! = differs from the mod's targets)"))
        _emit(views.applies_lines(names, lambda n: applies_ranges(list(report.cells), n),
                                  {m.name: m.spec.targets.versions for m in report.mods}))
    if report.failed(strict):
        raise typer.Exit(1)


def _progress_printer(label: str):
    """Show each BuildKit step as it starts: live on a terminal, one line per step in logs."""
    from .builder import Step

    def show(step: Step, elapsed: float) -> None:
        if step.name.startswith("internal"):
            return
        mins, secs = divmod(int(elapsed), 60)
        err.print(f"  {label} {mins:02d}:{secs:02d} [{step.name}] {step.command[:100]}", markup=False)

    return show


@app.command()
def build(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    network: str = typer.Option("host", "--network", help="Network of RUN steps: host, none or default."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="CA bundle for a proxy; given to BuildKit as a "
                                           "secret, never stored in a layer. Give a full bundle (system + yours)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Rebuild every step."),
    max_jobs: Optional[int] = typer.Option(None, "--max-jobs", min=1, help="Override MAX_JOBS of the compile."),
    nvcc_threads: Optional[int] = typer.Option(None, "--nvcc-threads", min=1, help="Override NVCC_THREADS."),
    smoke: bool = typer.Option(True, "--smoke/--no-smoke", help="Run the static smoke tier before tagging."),
    log_dir: Path = typer.Option(PROJECT_ROOT / "build" / "logs", "--log-dir", help="Where build logs go."),
    locked: bool = typer.Option(False, "--locked", help="Build with the lock (images/VARIANT.lock.json) and refuse "
                                "when the recipe disagrees with it or there is none. Without it a lock that agrees "
                                "is used, and one that does not is ignored with a warning."),
    dry: bool = typer.Option(False, "--dry-run", help="Print the tags and the exact `docker buildx build` command; "
                             "write nothing and do not touch Docker."),
) -> None:
    """Render, build with BuildKit, smoke-test, then tag a variant.

    The image gets its immutable tag (from the plan) and its moving tag (the variant name) only
    after the static smoke tier passes. When a build or smoke test fails, every existing tag
    stays where it was.
    """
    import shlex

    from .pipeline import build_variant, context_dir, dry_run

    plan = _plan(variant, base, locked=locked)
    opts = BuildOptions(network=None if network == "default" else network, ca_cert=ca_cert, no_cache=no_cache,
                        max_jobs=max_jobs, nvcc_threads=nvcc_threads, log_dir=log_dir)
    if dry:
        d = dry_run(plan, opts)
        out.print(f"tag         {d.tag}\nmoving tag  {d.moving_tag}\ncontext     {d.context} (not written)",
                  markup=False)
        out.print(shlex.join(d.command), markup=False, soft_wrap=True)
        return
    out.print(f"building {plan.tag} from {context_dir(plan)}")
    done = build_variant(plan, State.layout, opts, smoke=smoke, progress=_progress_printer(variant),
                         on_smoke=lambda static: out.print(views.smoke_table([static])))
    result = done.result
    ran = len(result.ran)
    out.print(f"built {result.image_id[:19]} in {result.seconds:.1f}s: {ran} steps ran, "
              f"{len(result.steps) - ran} cached; log: {result.log_path}")
    if done.smoke_already_passed:
        out.print(f"static smoke tier already passed for {result.image_id[:19]} (it carries {plan.tag})")
    for ref in done.tagged:
        out.print(f"tagged {ref}")


@app.command("test")
def test_cmd(
    variant: str = typer.Argument(..., help="The variant whose built image to test."),
    tier: list[str] = typer.Option(["static"], "--tier", help="static, gpu or serve; repeat for several."),
    image: Optional[str] = typer.Option(None, "--image", help="Test this image instead of the variant's tag."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    model: str = typer.Option("Qwen/Qwen3-0.6B", "--model", help="Small model for the serve tier."),
) -> None:
    """Run smoke tiers inside a built image. GPU tiers skip, with the reason, where there is no GPU."""
    from .builder import current_image
    from .smoke import TIERS, run_tier

    for t in tier:
        if t not in TIERS:
            raise SparkforgeError(f"unknown tier {t!r}; choose from {', '.join(TIERS)}", field="--tier")
    plan = _plan(variant, base)
    ref = image or plan.tag
    if current_image(ref) is None:
        raise BuildError(f"image {ref} not found; build it first with `python build.py build {variant}`",
                         field="--image" if image else variant)
    results = [run_tier(t, ref, model) for t in tier]
    out.print(views.smoke_table(results))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command()
def inspect(image: str = typer.Argument(..., help="An image reference, e.g. sparkforge/vllm:ng17e."),
            as_json: bool = typer.Option(False, "--json", help="Print the build record as JSON.")) -> None:
    """Print what is inside an image: its build record and labels."""
    from .inspect import read_record

    record, labels = read_record(image)
    if as_json:
        sys.stdout.write(json.dumps({"record": record, "labels": labels}, indent=2, sort_keys=True) + "\n")
        return
    _emit(views.record_lines(image, record, labels))


# ---------------------------------------------------------------- distribute: push, deploy, status (cli_cluster.py)

from . import cli_cluster  # noqa: F401, I001 - registers its verbs here, keeping the order of --help


# ---------------------------------------------------------------- locks and reproducibility: lock, verify-repro,
# diff, outdated

DEFAULT_EPOCH = 1704067200  # 2024-01-01T00:00:00Z: verify-repro's epoch when neither a lock nor the option gives one


@app.command()
def lock(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    no_build: bool = typer.Option(False, "--no-build", help="Do not build: mark the installed packages unresolved "
                                  "(for a machine that cannot build this variant)."),
    image: Optional[str] = typer.Option(None, "--image", help="Take the installed packages from this image, built "
                                        "by sparkforge, instead of building."),
    epoch: Optional[int] = typer.Option(None, "--source-date-epoch", min=315532800, help="SOURCE_DATE_EPOCH of locked "
                                        "builds (default: the existing lock's, else today 00:00 UTC)."),
    network: str = typer.Option("host", "--network", help="Network of RUN steps: host, none or default."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="CA bundle for a proxy (a BuildKit secret)."),
    log_dir: Path = typer.Option(PROJECT_ROOT / "build" / "logs", "--log-dir", help="Where build logs go."),
) -> None:
    """Resolve a variant's open pins and write images/VARIANT.lock.json beside its recipe.

    The lock holds the base image digest (asked from its registry over the Registry v2 API), the
    vLLM and component commits and versions (git remotes are asked for commits the recipe leaves
    open), every Python package a real build installed, each mod's content hash and the
    SOURCE_DATE_EPOCH of builds. What cannot be resolved from here is written as
    {"unresolved": "<why>"}, never invented. Builds then use the lock; `build --locked` refuses a
    recipe changed after locking.

    Examples:

      python build.py lock ng17e

      python build.py lock ng17e --no-build      (no GB10 or NGC access here)

      python build.py --images tests/variants lock testvllm --base 127.0.0.1:5000/sparkforge/base-local:bookworm
    """
    from .pipeline import lock_variant

    plan = _plan(variant, base, policy=LockPolicy.IGNORE)
    opts = BuildOptions(network=None if network == "default" else network, ca_cert=ca_cert, log_dir=log_dir)
    path, result = lock_variant(plan, State.layout, opts, epoch=epoch, no_build=no_build, image=image,
                                say=lambda line: err.print(f"  {line}", markup=False),
                                progress=_progress_printer(variant))
    out.print(f"locked {variant} -> {path}")
    out.print(f"  base      {result.base.repository}:{result.base.tag} @ {result.base.digest.show()}")
    out.print(f"  packages  {len(result.packages)} installed" if result.packages_unresolved is None
              else "  packages  unresolved")
    out.print(f"  mods      {', '.join(f'{n} {d[:19]}' for n, d in result.mods) or '-'}")
    out.print(f"  epoch     SOURCE_DATE_EPOCH={result.source_date_epoch}")
    for fld, reason in result.unresolved():
        out.print(f"  [yellow]UNRESOLVED[/] {escape(fld)}: {escape(reason)}")


@app.command("verify-repro")
def verify_repro_cmd(
    variant: str = typer.Argument(..., help="The variant, e.g. testvllm."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    builder_host: Optional[str] = typer.Option(None, "--builder-host", help="Docker engine to build on, e.g. "
                                               "unix:///run/ctd-docker.sock: a dockerd with the containerd image "
                                               "store (the default engine's classic store cannot do this)."),
    locked: bool = typer.Option(False, "--locked", help="Refuse when the recipe disagrees with its lock."),
    epoch: Optional[int] = typer.Option(None, "--source-date-epoch", min=315532800,
                                        help=f"Override the lock's SOURCE_DATE_EPOCH (default without a lock: "
                                        f"{DEFAULT_EPOCH})."),
    network: str = typer.Option("host", "--network", help="Network of RUN steps: host, none or default."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="CA bundle for a proxy (a BuildKit secret)."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep both image tarballs and build logs in this folder."),
) -> None:
    """Build a variant twice from scratch and check that both images are identical, bit for bit.

    Both builds run with --no-cache (fresh cache mounts too), SOURCE_DATE_EPOCH and
    rewrite-timestamp, exported to tarballs whose manifest, config and layer digests are compared.
    When they differ, the layers and the files in them that differ are named (exit 1). An engine
    that cannot export reproducibly is refused in one line (exit 2), never reported as a difference.

    Example:

      python build.py --images tests/variants verify-repro testvllm --base sparkforge/base-local:bookworm \\
        --builder-host unix:///tmp/ctd/docker.sock --ca-cert /etc/ssl/certs/ca-certificates.crt
    """
    import shutil
    import tempfile

    from .repro import verify_repro

    from .pipeline import context_dir, with_epoch

    plan = _plan(variant, base, locked=locked)
    sde = epoch or plan.source_date_epoch or DEFAULT_EPOCH
    plan = with_epoch(plan, sde)
    ctx = render_context(plan, State.layout, context_dir(plan))
    workdir = keep or Path(tempfile.mkdtemp(prefix=f"repro-{variant}-", dir=PROJECT_ROOT / "build"))
    out.print(f"verify-repro {plan.tag}: two --no-cache builds, SOURCE_DATE_EPOCH={sde}")
    opts = BuildOptions(network=None if network == "default" else network, ca_cert=ca_cert, source_date_epoch=sde,
                        docker_host=builder_host)
    try:
        result = verify_repro(plan, ctx, opts, workdir, progress=_progress_printer(variant),
                              say=lambda line: err.print(f"  {line}", markup=False))
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    _emit(views.repro_lines(result))
    if not result.identical:
        raise typer.Exit(1)


@app.command("diff")
def diff_cmd(
    a: str = typer.Argument(..., help="A variant, a lock file (*.lock.json) or a built image."),
    b: str = typer.Argument(..., help="The same kinds as A."),
) -> None:
    """Show what changed from A to B: the base, vLLM, the components, the mods and the Python packages.

    A variant gives its plan, with its lock's packages when the lock agrees with the recipe; a
    lock file gives what it pins; an image gives its build record.

    Examples:

      python build.py diff ng17 ng17e

      python build.py diff images/ng17.lock.json images/ng17e.lock.json

      python build.py diff sparkforge/vllm:ng17e-261c666b5a67 sparkforge/vllm:ng17e
    """
    from .diff import SECTIONS, diff, summary

    _emit(views.diff_lines(diff(a, b, State.layout), SECTIONS, summary))


@app.command()
def outdated(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17."),
    mods: bool = typer.Option(True, "--mods/--no-mods", help="Try the variant's vLLM mods on each newer vLLM release "
                              "(as check-mods --matrix; sources are downloaded once and cached)."),
    until: Optional[str] = typer.Option(None, "--until", help="Last vLLM release to try the mods on."),
) -> None:
    """Show which pinned components have newer releases on PyPI, and which mods apply to them.

    Checks vLLM, every pip component, and git components that PyPI also publishes
    (transformers). For each newer vLLM release, each vLLM mod of the variant is applied to the
    real source in a scratch copy, as `check-mods --matrix` does.

    Examples:

      python build.py outdated ng17

      python build.py outdated ng17e --no-mods
    """
    import tempfile


    from .outdated import outdated as find_outdated

    plan = _plan(variant)
    with tempfile.TemporaryDirectory(prefix="sparkforge-outdated-") as work:
        report = find_outdated(plan, Path(work), try_mods=mods, until=until,
                               progress=lambda v: err.print(f"mods: vllm {v}", markup=False))
    out.print(views.outdated_table(report.components))
    if not report.cells:
        if mods and report.mods and report.components[0].newer:
            out.print("no newer vLLM release to try the mods on")
        return
    versions = list(dict.fromkeys(c.version for c in report.cells))
    out.print(views.matrix_table(report.cells, list(report.mods), versions,
                                 "vLLM mods on the newer releases (! = differs from the mod's targets)"))
    _emit(views.applies_lines(report.mods, report.applies_to, prefix="applies to newer vllm"))


def run() -> None:
    """Entry point: typer handles usage errors (exit 2); sparkforge errors become one line."""
    try:
        app()
    except SparkforgeError as exc:
        err.print(f"error: {exc}", markup=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        sys.exit(130)
