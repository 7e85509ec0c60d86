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
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


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
def list_cmd() -> None:
    """List the variants with their parent, vLLM and mods."""
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


def run() -> None:
    """Entry point: run the app and turn sparkforge errors into one line and an exit code."""
    try:
        app(standalone_mode=False)
    except SparkforgeError as exc:
        err.print(f"error: {exc}", markup=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted", markup=False)
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
