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
from packaging.version import Version
from rich.console import Console
from rich.table import Table

from . import __version__
from .config import list_variants, load_variant
from .errors import SparkforgeError
from .plan import PROJECT_ROOT, Layout, Plan, plan_variant
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


def _plan(variant: str, base: Optional[str] = None) -> Plan:
    return plan_variant(State.layout, variant, base=base)


BASE_HELP = "Swap the base image, as REPOSITORY:TAG[@sha256:DIGEST] (changes the tag)."


@app.command("list")
def list_cmd(names: bool = typer.Option(False, "--names", help="Print only the variant names.")) -> None:
    """List the variants with their parent, vLLM and mods."""
    if names:
        out.print("\n".join(list_variants(State.layout.images_dir)))
        return
    table = Table(box=None, pad_edge=False)
    for col in ("variant", "parent", "vllm", "mods", "unpinned"):
        table.add_column(col)
    for name in list_variants(State.layout.images_dir):
        recipe = load_variant(State.layout.images_dir, name)
        plan = _plan(name)
        vllm = plan.vllm.version + (f" ({plan.vllm.ref})" if plan.vllm.ref else " (pypi)")
        parent = recipe.chain[1] if len(recipe.chain) > 1 else "-"
        mods = ", ".join(m.name for m in plan.mods) or "-"
        table.add_row(name, parent, vllm, mods, str(len(plan.unpinned())))
    out.print(table)


@app.command()
def show(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole resolved plan as JSON."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
) -> None:
    """Show the fully resolved plan of a variant. Never touches Docker."""
    plan = _plan(variant, base)
    if as_json:
        sys.stdout.write(plan.to_json())
        return
    out.print(f"[bold]{plan.variant}[/bold]  {plan.description}")
    out.print(f"  chain       {' <- '.join(plan.chain)}")
    out.print(f"  tag         {plan.tag}  (moving: {plan.moving_tag})")
    out.print(f"  base        {plan.base.ref}")
    v = plan.vllm
    src = f"git {v.repo} {v.ref} @ {v.commit.value or 'UNPINNED'}" if v.source == "git" else "pypi release"
    out.print(f"  vllm        {v.version}  ({src}{'' if v.install_deps else ', --no-deps'})")
    for c in plan.components:
        if c.kind == "pip":
            out.print(f"  {c.name:<11} pip {c.requirement}")
        else:
            out.print(f"  {c.name:<11} git {c.repo} {c.ref} @ {c.commit.value or 'UNPINNED'} -> {c.dest}")
    b = plan.build
    out.print(f"  build       TORCH_CUDA_ARCH_LIST={b.torch_cuda_arch_list} MAX_JOBS={b.max_jobs} "
              f"NVCC_THREADS={b.nvcc_threads}")
    out.print(f"  protect     {', '.join(plan.protect) or '-'}")
    for k, val in plan.env:
        out.print(f"  env         {k}={val}")
    for i, m in enumerate(plan.mods, 1):
        out.print(f"  mod {i:<7} {m.name} ({m.spec.phase}, {m.spec.kind}) {m.digest[:19]}")
    for fld, reason in plan.unpinned():
        out.print(f"  [yellow]UNPINNED[/yellow]    {fld}: {reason}")


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


STATE_STYLE = {"applied": "green", "already": "cyan", "failed": "bold red", "unverified": "yellow"}


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

    from .checkmods import FAILED, UNVERIFIED, applies_ranges, check_variant, matrix
    from .sources import release_versions

    names = list(variants or [])
    if all_variants:
        names = list_variants(State.layout.images_dir)
    if not names:
        raise SparkforgeError("name at least one variant, or use --all", field="check-mods")
    plans = [_plan(n) for n in names]
    table = Table(box=None, pad_edge=False)
    for col in ("variant", "mod", "result", "checked against", "detail"):
        table.add_column(col)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparkforge-check-") as work:
        for plan in plans:
            err.print(f"checking {plan.variant} ({len(plan.mods)} mods)")
            for row in check_variant(plan, Path(work)):
                rows.append(row)
                table.add_row(row.variant, row.mod, f"[{STATE_STYLE[row.state]}]{row.state}[/]",
                              row.source, row.detail)
            if not plan.mods:
                table.add_row(plan.variant, "-", "no mods", "", "")
        out.print(table)
        failed = [r for r in rows if r.state == FAILED]
        unverified = [r for r in rows if r.state == UNVERIFIED]
        out.print(f"{len(rows)} checked: {len(rows) - len(failed) - len(unverified)} ok, "
                  f"{len(failed)} failed, {len(unverified)} unverified (source not reachable from here)")
        matrix_failed = False
        if show_matrix:
            mods = {m.name: m for p in plans for m in p.mods if m.spec.component == "vllm"}
            versions = [v for v in release_versions("vllm")
                        if Version(v) >= Version(since) and (until is None or Version(v) <= Version(until))]
            cells = matrix(list(mods.values()), versions, Path(work),
                           progress=lambda v: err.print(f"matrix: vllm {v}"))
            mt = Table(box=None, pad_edge=False, title="mods x vLLM releases (! = differs from the mod's targets)")
            mt.add_column("vllm")
            for name in mods:
                mt.add_column(name)
            for version in versions:
                marks = []
                for name in mods:
                    cell = next(c for c in cells if c.mod == name and c.version == version)
                    ok = cell.state in ("applied", "already")
                    mark = {True: "[green]applies[/]", False: "[red]fails[/]"}[ok]
                    if cell.state == UNVERIFIED:
                        mark = "[yellow]unverified[/]"
                    elif ok != cell.declared:
                        mark += "!"
                        matrix_failed |= cell.declared  # declared but does not apply
                    marks.append(mark)
                mt.add_row(version, *marks)
            out.print(mt)
            for name, mod in mods.items():
                runs = ", ".join(a if a == b else f"{a}..{b}" for a, b in applies_ranges(cells, name)) or "none"
                out.print(f"{name}: applies to vllm {runs}; declares {mod.spec.targets.versions}")
    if failed or matrix_failed or (strict and unverified):
        raise typer.Exit(1)


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
