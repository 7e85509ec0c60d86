"""The verbs of the build stage: list, show, render, check-mods, build, test, make-model and inspect."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated

import typer

from ..build import pipeline
from ..build.wheels import default_root
from ..errors import BuildError, ConfigError
from ..recipe import archlist
from ..recipe.config import list_variants
from ..repro import verbs
from . import views
from .app import (DEFAULT_LOG_DIR, Base, CaCert, LogDir, Network, NetworkOption, State, Variant, WheelCache, app,
                  ca_bundle, command_line, emit, load, out, plan_of, progress_printer, say, tell, warned, write)


class Tier(str, enum.Enum):
    """A smoke tier of `test`."""

    static = "static"
    gpu = "gpu"
    serve = "serve"


@app.command("list")
def list_cmd(names: Annotated[bool, typer.Option("--names", help="Print only the variant names.")] = False) -> None:
    """List the variants with their parent, vLLM and mods."""
    if names:
        for name in list_variants(State.layout.images_dir):
            say(name)
        return
    loaded, broken = pipeline.list_plans(State.layout)
    out.print(views.variants_table([warned(one).plan for one in loaded]))
    if broken:
        for exc in broken:
            tell(f"error: {exc.render(command_line)}")
        raise typer.Exit(2)


@app.command()
def show(
    variant: Variant,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole resolved plan as JSON.")] = False,
    base: Base = None,
) -> None:
    """Show the fully resolved plan of a variant, with its lock applied. Never touches Docker."""
    loaded = load(variant, base)
    if as_json:
        write(loaded.plan.to_json())
        return
    emit(views.plan_lines(loaded))
    for warning in archlist.plan_warnings(loaded.plan):
        tell(f"warning: {loaded.plan.recipe_files[0]}: {warning}")


@app.command()
def render(
    variant: Variant,
    output: Annotated[Path | None, typer.Option("-o", "--output", metavar="DIR",
                                                   help="Folder to write (default: build/VARIANT).")] = None,
    base: Base = None,
    ca_cert: CaCert = None,
) -> None:
    """Write the Dockerfile and the build context of a variant. Never touches Docker.

    A patch that a mod names by URL is downloaded once into the cache (checked against its sha256) and put into the
    context like a local patch.
    """
    plan = plan_of(variant, base)
    ctx = pipeline.render_variant(plan, State.layout, output, ca_cert=ca_bundle(ca_cert))
    say(f"rendered {plan.tag} to {ctx.path} ({len(ctx.files)} files)")


@app.command("check-mods")
def check_mods(
    variants: Annotated[list[str] | None, typer.Argument(metavar="VARIANTS", help="Variants to check.",
                                                            show_default=False)] = None,
    all_variants: Annotated[bool, typer.Option("--all", help="Check every variant in images/.")] = False,
    show_matrix: Annotated[bool, typer.Option("--matrix", help="Also try each vLLM mod against a range of releases.")]
    = False,
    since: Annotated[str, typer.Option("--since", metavar="VERSION", help="First vLLM release of --matrix.")]
    = "0.15.0",
    until: Annotated[str | None, typer.Option("--until", metavar="VERSION", help="Last vLLM release of --matrix "
                                                 "(default: the newest).")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail also when a source could not be fetched.")] = False,
    changed_since: Annotated[str | None, typer.Option(
        "--changed-since", metavar="COMMIT", help="Check the variants that the changes since this git commit touch: "
        "their recipes (or what they extend), locks or mods; a change of sparkforge itself touches all. For CI: "
        "the commit a push or pull request starts from.")] = None,
    ca_cert: CaCert = None,
) -> None:
    """Prove that each mod applies to the real source it targets.

    For each variant, fetch the pinned source of every component its mods edit (vLLM releases from PyPI, cached; git
    where a commit is reachable), apply its mods in order to a scratch copy, run each mod's checks, and apply again to
    show each is detected as applied. A patch named by URL is fetched once into the cache; when it cannot be, its mod
    is unverified. Exits 1 when a mod fails (with --strict, also when a source or a patch could not be fetched).
    """
    verbs.release_range(since, until)  # bad bounds are refused with or without --matrix
    ca_bundle(ca_cert)
    if changed_since is not None and (variants or all_variants):
        raise ConfigError("--changed-since chooses the variants itself: name none, and leave out --all",
                          field="--changed-since")
    names = verbs.variants_to_check(State.layout, list(variants or []), all_variants or changed_since is not None)
    plans = [plan_of(n) for n in names]
    if changed_since is not None and changed_since.strip("0") == "":
        tell(f"--changed-since {changed_since}: no commit to compare with (a new branch); checking every variant")
    elif changed_since is not None:
        touched = dict(verbs.touched_variants(State.layout, plans,
                                              verbs.changed_files(changed_since, State.layout.images_dir)))
        for name, why in touched.items():
            tell(f"{name}: touched by {why}")
        plans = [p for p in plans if p.variant in touched]
        if not plans:
            say(f"no variant is touched by the changes since {changed_since}; nothing to check")
            return
    report = verbs.check_mods(plans, matrix_range=(since, until) if show_matrix else None, say=tell, ca_cert=ca_cert)
    emit([views.check_table(report.rows, plans), views.check_summary(report)])
    if show_matrix:
        emit(views.check_matrix(report))
    if report.failed(strict):
        raise typer.Exit(1)


@app.command()
def build(
    variant: Variant,
    base: Base = None,
    network: NetworkOption = Network.host,
    ca_cert: CaCert = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Rebuild every step.")] = False,
    max_jobs: Annotated[int | None, typer.Option("--max-jobs", metavar="N", min=1, help="Override MAX_JOBS of the "
                                                    "compile.")] = None,
    nvcc_threads: Annotated[int | None, typer.Option("--nvcc-threads", metavar="N", min=1, help="Override "
                                                        "NVCC_THREADS.")] = None,
    no_smoke: Annotated[bool, typer.Option("--no-smoke", help="Tag without running the static smoke tier first.")]
    = False,
    log_dir: LogDir = DEFAULT_LOG_DIR,
    locked: Annotated[bool, typer.Option(
        "--locked", help="Build with the lock (VARIANT.lock.json, beside the recipe) and refuse when the recipe "
        "disagrees with it or there is none. Without it a lock that agrees is used, and one that does not is ignored "
        "with a warning.")] = False,
    dry: Annotated[bool, typer.Option("--dry-run", help="Print the tags and the exact `docker buildx build` command; "
                                      "write nothing and do not touch Docker.")] = False,
    wheel_cache: WheelCache = None,
    no_wheel_cache: Annotated[bool, typer.Option(
        "--no-wheel-cache", help="Compile vLLM inside the image build, and store nothing in the wheel cache "
        "(--no-cache alone still installs a cached wheel).")] = False,
    move_tag: Annotated[bool, typer.Option(
        "--move-tag", help="When the plan's immutable tag already names another image, move it (and the moving tag) "
        "to this build; the old image keeps a tag of its own, TAG.<its 12-hex ID>.")] = False,
) -> None:
    """Render, build with BuildKit, smoke-test, then tag a variant.

    The image gets its immutable tag (from the plan) and its moving tag (the variant name) only after the static smoke
    tier passes; when a build or smoke test fails, every tag stays where it was. The immutable tag never moves
    silently: when it already names another image (the same plan gave other bytes), this build is kept as
    TAG.<12-hex ID> and no tag moves, unless --move-tag is given.

    A git-source variant installs the vLLM wheel from the wheel cache when an earlier compile with the same inputs
    (commit, source-phase mods, build.env, arch list, base) left it there, else compiles and stores it there
    (`./build.py wheels list` shows it).
    """
    plan = plan_of(variant, base, pipeline.LockPolicy.LOCKED if locked else pipeline.LockPolicy.AUTO)
    opts = pipeline.build_options(network=network.value, ca_cert=ca_cert, no_cache=no_cache, max_jobs=max_jobs,
                                  nvcc_threads=nvcc_threads, log_dir=log_dir)
    if dry:
        emit(views.dry_run_lines(pipeline.dry_run(plan, opts, wheel_cache=not no_wheel_cache)))
        return
    say(f"building {plan.tag} from {pipeline.context_dir(plan)}")
    done = pipeline.build_variant(plan, State.layout, opts, smoke=not no_smoke, progress=progress_printer(variant),
                                  wheel_cache=None if no_wheel_cache else (wheel_cache or default_root()),
                                  on_smoke=lambda static: out.print(views.smoke_table([static])), say=say,
                                  move_tag=move_tag)
    emit(views.build_lines(plan, done))


@app.command("test")
def test_cmd(
    variant: Variant,
    tier: Annotated[list[Tier], typer.Option("--tier", metavar="TIER", show_default=False, help="static, gpu or "
                                             "serve; repeat for several (default: static).")]
    = [Tier.static],  # noqa: B006 typer copies it
    image: Annotated[str | None, typer.Option("--image", metavar="IMAGE", help="Test this image instead of the "
                                                 "variant's tag.")] = None,
    base: Base = None,
    model: Annotated[str | None, typer.Option(
        "--model", metavar="MODEL", help="The serve tier's model: a folder (mounted read-only) or a Hugging Face name. "
        "Default: a tiny random-weight model made offline (see make-model).")] = None,
) -> None:
    """Run smoke tiers inside a built image.

    static: versions, mods, protected packages, kernels. gpu: one CUDA op on the device. serve: the image's own `vllm
    serve`, asked for an exact number of greedy tokens on /v1/completions and /v1/chat/completions, with its load time
    and time to first token. An image built for the CPU (device: cpu) runs the serve tier without a GPU; elsewhere
    without a GPU the GPU tiers skip, saying why.

    Example: ./build.py test ng17e --tier static --tier serve --model /models/Qwen3-0.6B
    """
    plan = plan_of(variant, base)
    results = pipeline.test_variant(plan, [t.value for t in tier], image=image, model=model)
    out.print(views.smoke_table(results))
    if Tier.static in tier:
        from ..build.inspect import read_record

        kernels = read_record(image or plan.tag)[0].kernels
        if kernels:
            out.print(views.kernels_table(kernels))
    served = next((r for r in results if r.tier == "serve" and not r.ok), None)
    if served is not None:  # a server that did not start or answer: why, and its log's last lines, in one line
        why = "; ".join(f"{c.name}: {c.detail}" for c in served.checks if c.state == "failed")
        raise BuildError(f"the serve tier failed: {why}", field=plan.variant)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command("make-model")
def make_model_cmd(
    folder: Annotated[Path, typer.Argument(metavar="DIR", show_default=False, help="The folder to write (must not "
                                           "exist, or hold this very model).")],
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**32 - 1, help="The seed of the random weights.")] = 0,
) -> None:
    """Make a tiny random-weight model and its tokenizer, offline: a Llama of 2 layers (head_dim 64), a byte-level BPE
    of 512 tokens and a chat template, in Hugging Face's layout. The same seed gives the same bytes on every machine.
    Its words mean nothing; it is for checking that an image serves (`test --tier serve --model DIR`, `launch --model
    DIR`) without downloading weights.

    Example: ./build.py make-model /srv/models/sparkforge-tiny
    """
    from ..inimage.tinymodel import make_model

    try:
        made = make_model(folder, seed)
    except FileExistsError as exc:  # a folder the user named that holds something else: bad input
        raise ConfigError(str(exc.strerror), path=folder, field="DIR") from None
    say(f"made {made} (seed {seed}): serve it with `vllm serve {made}`, or pass --model {made}")


@app.command()
def inspect(image: Annotated[str, typer.Argument(metavar="IMAGE", help="An image reference, e.g. "
                                                 "sparkforge/vllm:ng17e.")],
            as_json: Annotated[bool, typer.Option("--json", help="Print the build record as JSON.")] = False) -> None:
    """Print what is inside an image: its build record and labels."""
    from ..build.inspect import read_record

    record, labels = read_record(image)
    if as_json:
        write(json.dumps({"record": record.to_dict(), "labels": labels}, indent=2, sort_keys=True) + "\n")
        return
    emit(views.record_lines(image, record, labels))
    if record.kernels:
        out.print(views.kernels_table(record.kernels))
