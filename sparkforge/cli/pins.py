"""The verbs of pins and mods: lock, verify-repro, diff, outdated and `mod new`.

Registered after the cluster and wheels verbs, keeping the order of --help.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..build import pipeline
from ..build.pipeline import LockPolicy
from ..recipe.lock import MAX_EPOCH, MIN_EPOCH
from ..recipe.plan import PROJECT_ROOT
from ..repro import verbs
from . import views
from .app import BASE_HELP, CA_HELP, State, app, ca_bundle, emit, err, plan_of, progress_printer, say


@app.command()
def lock(
    variant: str = typer.Argument(..., help="The variant, e.g. ng17e."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    no_build: bool = typer.Option(False, "--no-build", help="Do not build: mark the installed packages unresolved "
                                  "(for a machine that cannot build this variant)."),
    image: Optional[str] = typer.Option(None, "--image", help="Take the installed packages from this image, built "
                                        "by sparkforge, instead of building."),
    epoch: Optional[int] = typer.Option(None, "--source-date-epoch", min=MIN_EPOCH, max=MAX_EPOCH,
                                        help="SOURCE_DATE_EPOCH of locked builds (default: the existing lock's, else "
                                        "today 00:00 UTC); 1980 to 2107, the years a wheel's zip can store."),
    network: str = typer.Option("host", "--network", help="Network of RUN steps: host, none or default."),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="CA bundle for a proxy (a BuildKit secret); also "
                                           "trusted when the base's registry and its token service are asked."),
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
    plan = plan_of(variant, base, policy=LockPolicy.IGNORE)
    opts = pipeline.build_options(network=network, ca_cert=ca_cert, log_dir=log_dir)
    path, result = pipeline.lock_variant(plan, State.layout, opts, epoch=epoch, no_build=no_build, image=image,
                                         say=lambda line: err.print(f"  {line}", markup=False),
                                         progress=progress_printer(variant))
    emit(views.lock_lines(variant, path, result))


@app.command("verify-repro")
def verify_repro_cmd(
    variant: str = typer.Argument(..., help="The variant, e.g. testvllm."),
    base: Optional[str] = typer.Option(None, "--base", help=BASE_HELP),
    builder_host: Optional[str] = typer.Option(None, "--builder-host", help="Docker engine to build on, e.g. "
                                               "unix:///run/ctd-docker.sock: a dockerd with the containerd image "
                                               "store (the default engine's classic store cannot do this)."),
    locked: bool = typer.Option(False, "--locked", help="Refuse when the recipe disagrees with its lock."),
    epoch: Optional[int] = typer.Option(None, "--source-date-epoch", min=MIN_EPOCH, max=MAX_EPOCH,
                                        help=f"Override the lock's SOURCE_DATE_EPOCH (default without a lock: "
                                        f"{verbs.DEFAULT_EPOCH})."),
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
    plan = verbs.repro_plan(plan_of(variant, base, locked=locked), epoch)
    opts = pipeline.build_options(network=network, ca_cert=ca_cert, docker_host=builder_host)
    say(f"verify-repro {plan.tag}: two --no-cache builds, SOURCE_DATE_EPOCH={plan.source_date_epoch}")
    result = verbs.verify_variant_repro(plan, State.layout, opts, keep=keep, progress=progress_printer(variant),
                                        say=lambda line: err.print(f"  {line}", markup=False))
    emit(views.repro_lines(result))
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
    from ..repro.diff import SECTIONS, diff, summary

    emit(views.diff_lines(diff(a, b, State.layout), SECTIONS, summary))


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
    report = verbs.outdated_variant(plan_of(variant), try_mods=mods, until=until,
                                    progress=lambda v: err.print(f"mods: vllm {v}", markup=False))
    emit(views.outdated_lines(report, tried_mods=mods))


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
    from ..recipe.remote import new_mod

    made = new_mod(State.layout.mods_dir, name, url=from_url, pr=pr, versions=versions, component=component,
                   phase=phase, ca_cert=ca_bundle(ca_cert))
    say(f"wrote {made.folder / 'mod.yaml'}: {made.url} (sha256 {made.sha256}), changes {', '.join(made.files)}")
    say(f"next: read the patch, then add {name} to a variant's mods and run `python build.py check-mods VARIANT`")
