"""The verbs of the build stage: list, show, render, check-mods, build, test and inspect.

Registered first on the one typer app (cli.app), so that --help lists them first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..build import pipeline
from ..build.smoke import DEFAULT_SERVE_MODEL
from ..recipe import archlist
from ..recipe.config import list_variants
from ..recipe.plan import PROJECT_ROOT
from ..repro import verbs
from . import views
from .app import (
    BASE_HELP,
    CA_HELP,
    WHEEL_CACHE_HELP,
    State,
    app,
    ca_bundle,
    emit,
    err,
    load,
    out,
    plan_of,
    progress_printer,
    say,
    warned,
    write,
)


@app.command("list")
def list_cmd(names: bool = typer.Option(False, "--names", help="Print only the variant names.")) -> None:
    """List the variants with their parent, vLLM and mods."""
    if names:
        for name in list_variants(State.layout.images_dir):
            say(name)
        return
    out.print(views.variants_table([warned(loaded).plan for loaded in pipeline.list_plans(State.layout)]))


@app.command()
def show(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole resolved plan as JSON."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
) -> None:
    """Show the fully resolved plan of a variant, with its lock applied. Never touches Docker."""
    loaded = load(variant, base)
    if as_json:
        write(loaded.plan.to_json())
        return
    emit(views.plan_lines(loaded))
    for warning in archlist.plan_warnings(loaded.plan):
        err.print(f"warning: {loaded.plan.recipe_files[0]}: {warning}", markup=False)


@app.command()
def render(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder to write (default: build/VARIANT)."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help=CA_HELP),
) -> None:
    """Write the Dockerfile and the build context of a variant. Never touches Docker.

    A patch that a mod names by URL is downloaded once into the cache (checked against its
    sha256) and put into the context like a local patch.
    """
    plan = plan_of(variant, base)
    ctx = pipeline.render_variant(plan, State.layout, output, ca_cert=ca_bundle(ca_cert))
    say(f"rendered {plan.tag} to {ctx.path} ({len(ctx.files)} files)")


@app.command("check-mods")
def check_mods(
    variants: list[str] = typer.Argument(None, help="Variants to check (default with --all: every variant)."),
    all_variants: bool = typer.Option(False, "--all", help="Check every variant in images/."),
    show_matrix: bool = typer.Option(False, "--matrix", help="Also try each vLLM mod against a range of releases."),
    since: str = typer.Option("0.15.0", help="First vLLM release of --matrix."),
    until: Optional[str] = typer.Option(None, help="Last vLLM release of --matrix (default: the newest)."),
    strict: bool = typer.Option(False, "--strict", help="Fail also when a source could not be fetched."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help=CA_HELP),
) -> None:
    """Prove that each mod applies to the real source it targets.

    For each variant, fetch the pinned source of every component its mods edit (vLLM releases
    from PyPI, cached; git where a commit is reachable), apply the variant's mods in order to a
    scratch copy, run each mod's checks, and apply again to show it is detected as already
    applied. A patch named by URL is fetched once into the cache, like a source; when it cannot be
    fetched its mod is unverified. Exits 1 when a mod fails (with --strict, also when a source or
    a patch could not be fetched).
    """
    verbs.release_range(since, until)  # bad bounds are refused with or without --matrix
    ca_bundle(ca_cert)
    plans = [plan_of(n) for n in verbs.variants_to_check(State.layout, list(variants or []), all_variants)]
    report = verbs.check_mods(plans, matrix_range=(since, until) if show_matrix else None,
                              say=lambda line: err.print(line, markup=False), ca_cert=ca_cert)
    out.print(views.check_table(report.rows, plans))
    out.print(views.check_summary(report))
    if show_matrix:
        emit(views.check_matrix(report))
    if report.failed(strict):
        raise typer.Exit(1)


@app.command()
def build(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    network: str = typer.Option("host", "--network", help="Network of RUN steps: host, none or default."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help=CA_HELP),
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
    wheel_cache: Optional[Path] = typer.Option(None, "--wheel-cache", envvar="SPARKFORGE_WHEEL_CACHE",
                                               help=WHEEL_CACHE_HELP),
    no_wheel_cache: bool = typer.Option(False, "--no-wheel-cache",
                                        help="Compile vLLM inside the image build, and store nothing in the wheel "
                                        "cache (--no-cache alone still installs a cached wheel)."),
) -> None:
    """Render, build with BuildKit, smoke-test, then tag a variant.

    The image gets its immutable tag (from the plan) and its moving tag (the variant name) only
    after the static smoke tier passes. When a build or smoke test fails, every existing tag
    stays where it was.

    A git-source variant installs the vLLM wheel from the wheel cache when an earlier compile
    with the same inputs (commit, source-phase mods, build.env, arch list, base) left it there,
    and otherwise compiles and stores its wheel there. `python build.py wheels list` shows it.
    """
    from ..build.wheels import default_root

    plan = plan_of(variant, base, locked=locked)
    opts = pipeline.build_options(network=network, ca_cert=ca_cert, no_cache=no_cache, max_jobs=max_jobs,
                                  nvcc_threads=nvcc_threads, log_dir=log_dir)
    if dry:
        emit(views.dry_run_lines(pipeline.dry_run(plan, opts, wheel_cache=not no_wheel_cache)))
        return
    say(f"building {plan.tag} from {pipeline.context_dir(plan)}")
    done = pipeline.build_variant(plan, State.layout, opts, smoke=smoke, progress=progress_printer(variant),
                                  wheel_cache=None if no_wheel_cache else (wheel_cache or default_root()),
                                  on_smoke=lambda static: out.print(views.smoke_table([static])), say=say)
    emit(views.build_lines(plan, done))


@app.command("test")
def test_cmd(
    variant: str = typer.Argument(..., help="The variant whose built image to test."),
    tier: list[str] = typer.Option(["static"], "--tier", help="static, gpu or serve; repeat for several."),
    image: Optional[str] = typer.Option(None, "--image", help="Test this image instead of the variant's tag."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    model: str = typer.Option(DEFAULT_SERVE_MODEL, "--model", help="Small model for the serve tier."),
) -> None:
    """Run smoke tiers inside a built image. GPU tiers skip, with the reason, where there is no GPU."""
    plan = plan_of(variant, base)
    results = pipeline.test_variant(plan, tier, image=image, model=model)
    out.print(views.smoke_table(results))
    if "static" in tier:
        from ..build.inspect import read_record

        kernels = read_record(image or plan.tag)[0].kernels
        if kernels:
            out.print(views.kernels_table(kernels))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command()
def inspect(image: str = typer.Argument(..., help="An image reference, e.g. sparkforge/vllm:ng17e."),
            as_json: bool = typer.Option(False, "--json", help="Print the build record as JSON.")) -> None:
    """Print what is inside an image: its build record and labels."""
    from ..build.inspect import read_record

    record, labels = read_record(image)
    if as_json:
        write(json.dumps({"record": record.to_dict(), "labels": labels}, indent=2, sort_keys=True) + "\n")
        return
    emit(views.record_lines(image, record, labels))
    if record.kernels:
        out.print(views.kernels_table(record.kernels))
