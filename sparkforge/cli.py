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
from .errors import BuildError, SparkforgeError
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


def _smoke_table(results) -> Table:
    table = Table(box=None, pad_edge=False)
    for col in ("tier", "check", "result", "detail"):
        table.add_column(col)
    style = {"ok": "green", "failed": "bold red", "skipped": "yellow"}
    for res in results:
        if res.skipped:
            table.add_row(res.tier, "(whole tier)", "[yellow]skipped[/]", res.skipped)
        for c in res.checks:
            name = c.name if len(c.name) <= 100 else c.name[:97] + "..."
            table.add_row(res.tier, name, f"[{style[c.state]}]{c.state}[/]", c.detail)
    return table


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
) -> None:
    """Render, build with BuildKit, smoke-test, then tag a variant.

    The image gets its immutable tag (from the plan) and its moving tag (the variant name) only
    after the static smoke tier passes. When a build or smoke test fails, every existing tag
    stays where it was.
    """
    from .builder import BuildOptions, build_image, image_ids, keep_candidate, promote
    from .smoke import run_static

    plan = _plan(variant, base)
    ctx = render_context(plan, State.layout, PROJECT_ROOT / "build" / "contexts" / f"{variant}-{plan.plan_hash[:12]}")
    out.print(f"building {plan.tag} from {ctx.path}")
    opts = BuildOptions(network=None if network == "default" else network, ca_cert=ca_cert, no_cache=no_cache,
                        max_jobs=max_jobs, nvcc_threads=nvcc_threads, log_dir=log_dir)
    try:
        result = build_image(plan, ctx, opts, progress=_progress_printer(variant))
    except SparkforgeError as exc:
        exc.detail += "; " + _kept(plan, image_ids(plan.moving_tag)[plan.moving_tag])
        raise
    ran = len(result.ran)
    out.print(f"built {result.image_id[:19]} in {result.seconds:.1f}s: {ran} steps ran, "
              f"{len(result.steps) - ran} cached; log: {result.log_path}")
    now = image_ids(plan.tag, plan.moving_tag, result.candidate)
    if smoke and now[plan.tag] == result.image_id:
        out.print(f"static smoke tier already passed for {result.image_id[:19]} (it carries {plan.tag})")
    elif smoke:
        static = run_static(result.image_id)
        out.print(_smoke_table([static]))
        if not static.ok:
            raise BuildError(f"static smoke tier failed; image left as {keep_candidate(result)}; "
                             f"{_kept(plan, now[plan.moving_tag])}", field=plan.variant)
    for ref in promote(result, now):
        out.print(f"tagged {ref}")


def _kept(plan: Plan, before: str | None) -> str:
    if before:
        return f"{plan.moving_tag} still points to {before[:19]}"
    return f"{plan.moving_tag} was not created"


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
    out.print(_smoke_table(results))
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
    out.print(f"[bold]{image}[/bold]  variant {record['variant']} ({' <- '.join(record['chain'])})")
    out.print(f"  tag          {record['tag']}")
    out.print(f"  built        {record['built_at']} by sparkforge {record['tool_version']}")
    base = record["base"]
    out.print(f"  base         {base['repository']}:{base['tag']} @ {base['digest']['value'] or 'UNPINNED'}")
    v = record["vllm"]
    out.print(f"  vllm         {v['version']} ({v['source']}) commit {v['commit']['value'] or v.get('built_commit') or '-'}"
              f"; installed {record['installed'].get('vllm')}")
    for c in record["components"]:
        pin = (c["version"]["value"] or "UNPINNED") if c["kind"] == "pip" else (c["commit"]["value"] or "UNPINNED")
        out.print(f"  {c['name']:<12} {c['kind']} {c.get('package') or c.get('repo')} {pin}; "
                  f"installed {record['installed'].get((c.get('package') or c['name']).split('[')[0])}")
    out.print(f"  arch list    {record['build']['torch_cuda_arch_list']}")
    for m in record["mods"]:
        out.print(f"  mod          {m['name']} ({m['phase']}) {m['digest'][:19]} -> {m['result']}")
    for name, version in sorted(record["protected"].items()):
        out.print(f"  protected    {name} {version}")
    for u in record["unpinned"]:
        out.print(f"  [yellow]UNPINNED[/]     {u['field']}: {u['reason']}")
    for key in sorted(labels):
        out.print(f"  label        {key}={labels[key]}")


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
