"""The command line: a thin typer layer whose verbs follow the pipeline stages.

Only this module reads flags and the environment. Every SparkforgeError becomes one line on
stderr and its exit code (2 for bad input), never a traceback.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.segment import Segment

# typer's bundled click: its usage errors become one line like every other bad input.
from typer._click.exceptions import NoArgsIsHelpError, UsageError

from . import __version__, archlist, pipeline, views
from .config import list_variants
from .errors import ConfigError, SparkforgeError, visible
from .files import is_regular
from .pipeline import LoadedPlan, LockPolicy, load_plan
from .plan import PROJECT_ROOT, Layout, Plan
from .smoke import DEFAULT_SERVE_MODEL

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


class _SafeConsole(Console):
    """A console that shows every control character of what it prints as its escape (errors.visible):
    names, paths and messages come from recipes, mods, caches and downloads, and an escape sequence in
    one must not reach the terminal. Rich's own styles and cursor moves are not text, so they pass."""

    def render(self, renderable, options=None):
        for segment in super().render(renderable, options):
            if segment.control is None and segment.text and not segment.text.isprintable() and segment.text != "\n":
                segment = Segment(visible(segment.text), segment.style)
            yield segment


def _console(stderr: bool = False) -> Console:
    # Tables stay readable in logs and pipes, where there is no terminal width to fit.
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else 200
    return _SafeConsole(stderr=stderr, highlight=False, soft_wrap=True, width=width)


out = _console()
err = _console(stderr=True)


class State:
    layout: Layout = Layout.default()


def _print_version(value: bool) -> None:
    # Eager, so that it answers before typer asks for a command.
    if value:
        _say(f"sparkforge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    images: Optional[Path] = typer.Option(None, "--images", help="Folder of variant recipes (default: images/)."),
    mods: Optional[Path] = typer.Option(None, "--mods", help="Folder of mods (default: mods/)."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    for option, folder in (("--images", images), ("--mods", mods)):
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ConfigError("is not a folder", path=folder, field=option)
    State.layout = Layout.default(PROJECT_ROOT, images_dir=images, mods_dir=mods)


def _load(variant: str, base: Optional[str] = None, *, locked: bool = False,
          policy: Optional[LockPolicy] = None) -> LoadedPlan:
    """The variant's plan as every command sees it (pipeline.load_plan); warnings go to stderr."""
    return _warned(load_plan(State.layout, variant, base=base,
                             lock_policy=policy or (LockPolicy.LOCKED if locked else LockPolicy.AUTO)))


def _warned(loaded: LoadedPlan) -> LoadedPlan:
    for warning in loaded.warnings:
        err.print(f"warning: {warning}", markup=False)
    return loaded


def _emit(lines) -> None:
    for line in lines:
        out.print(line)


def _say(text: str) -> None:
    """One line of plain text: paths and names in it are never read as Rich markup."""
    out.print(text, markup=False)


def _plan(variant: str, base: Optional[str] = None, *, locked: bool = False,
          policy: Optional[LockPolicy] = None) -> Plan:
    return _load(variant, base, locked=locked, policy=policy).plan


BASE_HELP = "Swap the base image, as REPOSITORY:TAG[@sha256:DIGEST] (changes the tag)."
WHEEL_CACHE_HELP = ("Folder of the wheel cache: compiled vLLM wheels by their inputs; a shared folder serves several "
                    "machines (default: $SPARKFORGE_WHEEL_CACHE, else ~/.cache/sparkforge/wheels).")
CA_HELP = ("CA bundle for a proxy or a private server: used to download patches and wheels named by URL, and given to "
           "BuildKit as a secret for its own downloads, never stored in a layer. Give a full bundle (system + yours).")


def _ca_bundle(path: Optional[Path]) -> Optional[Path]:
    if path is not None and not is_regular(path):
        raise ConfigError("CA bundle not found" if not path.exists() else "is not a regular file", path=path,
                          field="--ca-cert")
    return path


@app.command("list")
def list_cmd(names: bool = typer.Option(False, "--names", help="Print only the variant names.")) -> None:
    """List the variants with their parent, vLLM and mods."""
    if names:
        _say("\n".join(list_variants(State.layout.images_dir)))
        return
    out.print(views.variants_table([_warned(loaded).plan for loaded in pipeline.list_plans(State.layout)]))


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
    plan = _plan(variant, base)
    ctx = pipeline.render_variant(plan, State.layout, output, ca_cert=_ca_bundle(ca_cert))
    _say(f"rendered {plan.tag} to {ctx.path} ({len(ctx.files)} files)")


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
    pipeline.release_range(since, until)  # bad bounds are refused with or without --matrix
    _ca_bundle(ca_cert)
    plans = [_plan(n) for n in pipeline.variants_to_check(State.layout, list(variants or []), all_variants)]
    report = pipeline.check_mods(plans, matrix_range=(since, until) if show_matrix else None,
                                 say=lambda line: err.print(line, markup=False), ca_cert=ca_cert)
    out.print(views.check_table(report.rows, plans))
    out.print(views.check_summary(report))
    if show_matrix:
        _emit(views.check_matrix(report))
    if report.failed(strict):
        raise typer.Exit(1)


def _progress_printer(label: str):
    """Show each BuildKit step as it starts: live on a terminal, one line per step in logs."""
    from .builder import Step

    def show(step: Step, elapsed: float) -> None:
        if step.name.startswith(("internal", "context ")):
            return
        mins, secs = divmod(int(elapsed), 60)
        err.print(f"  {label} {mins:02d}:{secs:02d} [{step.name}] {step.command[:100]}", markup=False)

    return show


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
    from .wheels import default_root

    plan = _plan(variant, base, locked=locked)
    opts = pipeline.build_options(network=network, ca_cert=ca_cert, no_cache=no_cache, max_jobs=max_jobs,
                                  nvcc_threads=nvcc_threads, log_dir=log_dir)
    if dry:
        _emit(views.dry_run_lines(pipeline.dry_run(plan, opts, wheel_cache=not no_wheel_cache)))
        return
    _say(f"building {plan.tag} from {pipeline.context_dir(plan)}")
    done = pipeline.build_variant(plan, State.layout, opts, smoke=smoke, progress=_progress_printer(variant),
                                  wheel_cache=None if no_wheel_cache else (wheel_cache or default_root()),
                                  on_smoke=lambda static: out.print(views.smoke_table([static])), say=_say)
    _emit(views.build_lines(plan, done))


@app.command("test")
def test_cmd(
    variant: str = typer.Argument(..., help="The variant whose built image to test."),
    tier: list[str] = typer.Option(["static"], "--tier", help="static, gpu or serve; repeat for several."),
    image: Optional[str] = typer.Option(None, "--image", help="Test this image instead of the variant's tag."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    model: str = typer.Option(DEFAULT_SERVE_MODEL, "--model", help="Small model for the serve tier."),
) -> None:
    """Run smoke tiers inside a built image. GPU tiers skip, with the reason, where there is no GPU."""
    plan = _plan(variant, base)
    results = pipeline.test_variant(plan, tier, image=image, model=model)
    out.print(views.smoke_table(results))
    if "static" in tier:
        from .inspect import read_record

        kernels = read_record(image or plan.tag)[0].kernels
        if kernels:
            out.print(views.kernels_table(kernels))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command()
def inspect(image: str = typer.Argument(..., help="An image reference, e.g. sparkforge/vllm:ng17e."),
            as_json: bool = typer.Option(False, "--json", help="Print the build record as JSON.")) -> None:
    """Print what is inside an image: its build record and labels."""
    from .inspect import read_record

    record, labels = read_record(image)
    if as_json:
        sys.stdout.write(json.dumps({"record": record.to_dict(), "labels": labels}, indent=2, sort_keys=True) + "\n")
        return
    _emit(views.record_lines(image, record, labels))
    if record.kernels:
        out.print(views.kernels_table(record.kernels))


# ---------------------------------------------------------------- distribute: push, deploy, status (cli_cluster.py)

from . import cli_cluster  # noqa: F401, I001 - registers its verbs here, keeping the order of --help
from . import cli_wheels  # noqa: F401, I001 - the `wheels` group


# ---------------------------------------------------------------- locks and reproducibility: lock, verify-repro,
# diff, outdated


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
    plan = _plan(variant, base, policy=LockPolicy.IGNORE)
    opts = pipeline.build_options(network=network, ca_cert=ca_cert, log_dir=log_dir)
    path, result = pipeline.lock_variant(plan, State.layout, opts, epoch=epoch, no_build=no_build, image=image,
                                         say=lambda line: err.print(f"  {line}", markup=False),
                                         progress=_progress_printer(variant))
    _emit(views.lock_lines(variant, path, result))


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
                                        f"{pipeline.DEFAULT_EPOCH})."),
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
    plan = pipeline.repro_plan(_plan(variant, base, locked=locked), epoch)
    opts = pipeline.build_options(network=network, ca_cert=ca_cert, docker_host=builder_host)
    _say(f"verify-repro {plan.tag}: two --no-cache builds, SOURCE_DATE_EPOCH={plan.source_date_epoch}")
    result = pipeline.verify_variant_repro(plan, State.layout, opts, keep=keep, progress=_progress_printer(variant),
                                           say=lambda line: err.print(f"  {line}", markup=False))
    _emit(views.repro_lines(result))
    if not result.identical:
        raise typer.Exit(1)


@app.command("diff")
def diff_cmd(
    a: str = typer.Argument(..., help="A variant, a lock file (*.lock.json) or a built image."),
    b: str = typer.Argument(..., help="The same kinds as A."),
) -> None:
    """Show what changed from A to B, in every field of the plan, section by section.

    The image, base, OS packages, vLLM, components, protect, build, env, mods, tooling and the
    installed Python packages. A variant gives its plan as `show` does, with its lock's packages
    when the lock agrees with the recipe; a lock file gives what it pins; an image gives its
    build record. What one side does not record is noted, never reported as the same.

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
    report = pipeline.outdated_variant(_plan(variant), try_mods=mods, until=until,
                                       progress=lambda v: err.print(f"mods: vllm {v}", markup=False))
    _emit(views.outdated_lines(report, tried_mods=mods))


# ---------------------------------------------------------------- mod new

mod_app = typer.Typer(help="Write a new mod folder.", no_args_is_help=True)
app.add_typer(mod_app, name="mod")


@mod_app.command("new")
def mod_new(
    name: str = typer.Argument(..., help="The mod's name, and its folder mods/NAME (lowercase letters, digits, '-')."),
    from_url: Optional[str] = typer.Option(None, "--from-url", help="https URL of a unified diff, e.g. "
                                           "https://github.com/OWNER/REPO/commit/SHA.diff."),
    pr: Optional[str] = typer.Option(None, "--pr", help="A GitHub pull request, OWNER/REPO#NUMBER; its diff is "
                                     "https://github.com/OWNER/REPO/pull/NUMBER.diff."),
    versions: str = typer.Option(..., "--versions", help="The releases of the component the patch is for, as a "
                                 "PEP 440 range, e.g. '>=0.17.0,<0.19'."),
    component: str = typer.Option("vllm", "--component", help="What the patch edits: vllm, or a component of "
                                  "the recipe."),
    phase: str = typer.Option("install", "--phase", help="install: the installed package; source: the vLLM "
                              "tree before its compile (variants that build vLLM from git)."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help=CA_HELP),
) -> None:
    """Write mods/NAME/mod.yaml for an upstream patch, pinned by the sha256 of what is downloaded now.

    The diff is downloaded once into the cache and checked: a unified diff whose files stay inside
    the component's tree. The mod names the URL (or the pull request) and its sha256, and gets one
    verify check: a line the patch adds. Nothing is written when any of this fails. Read the
    patch, fill in the description, then add the mod to a variant and run check-mods: a patch
    that is already in the variant's release is reported `already`.

    Examples:

      python build.py mod new colpali-template --pr vllm-project/vllm#12345 --versions '>=0.17.0,<0.18.1'

      python build.py mod new fix-x --from-url https://github.com/vllm-project/vllm/commit/SHA.diff --versions '==0.17.0'
    """
    from .remote import new_mod

    made = new_mod(State.layout.mods_dir, name, url=from_url, pr=pr, versions=versions, component=component,
                   phase=phase, ca_cert=_ca_bundle(ca_cert))
    _say(f"wrote {made.folder / 'mod.yaml'}: {made.url} (sha256 {made.sha256}), changes {', '.join(made.files)}")
    _say(f"next: read the patch, then add {name} to a variant's mods and run `python build.py check-mods VARIANT`")


def run() -> None:
    """Entry point: a usage error or a sparkforge error becomes one line on stderr and its exit code."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        _say(exc.format_message())
        code = 2
    except UsageError as exc:
        command = f"{exc.ctx.info_name}: " if exc.ctx is not None and exc.ctx.parent is not None else ""
        err.print(f"error: {command}{' '.join(exc.format_message().split())}", markup=False)
        code = exc.exit_code
    except SparkforgeError as exc:
        err.print(f"error: {exc}", markup=False)
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        err.print("interrupted", markup=False)
        code = 130
    except OSError as exc:  # the world (disk full, read-only, permissions) or a path the user gave that cannot be one
        err.print(f"error: {os_error_line(exc)}", markup=False)
        code = 2 if exc.errno in INPUT_ERRNOS else 1
    except RecursionError:
        err.print("error: input nested too deeply to read", markup=False)
        code = 2
    sys.exit(code if isinstance(code, int) else 0)


# Errors of a path as given, not of the world: a name too long, a file where a folder must be, ...
INPUT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP})


def os_error_line(exc: OSError) -> str:
    """An OSError as one line naming the path(s) it is about: `cache/x: No space left on device`."""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    reason = exc.strerror or str(exc) or type(exc).__name__
    if paths:
        return visible(f"{' -> '.join(_short_path(p) for p in paths)}: {reason}", keep_newlines=False)
    return visible(reason, keep_newlines=False)


def _short_path(path: str) -> str:
    """A path as typed, cut in the middle when it is absurdly long (a 300-character name)."""
    return path if len(path) <= 160 else f"{path[:100]}...{path[-50:]}"
