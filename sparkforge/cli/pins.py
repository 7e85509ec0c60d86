"""The verbs of pins: lock, verify-repro, diff, outdated and bump."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from ..build import pipeline
from ..build.pipeline import LockPolicy
from ..recipe.lockfile import MAX_EPOCH, MIN_EPOCH
from ..repro import verbs
from . import views
from .app import (DEFAULT_LOG_DIR, Base, CaCert, LogDir, Network, NetworkOption, State, Variant, app, ca_bundle, emit,
                  plan_of, progress_printer, say, tell, tell_step, write)


@app.command()
def lock(
    variant: Variant,
    base: Base = None,
    no_build: Annotated[bool, typer.Option("--no-build", help="Do not build: mark the installed packages unresolved "
                                           "(for a machine that cannot build this variant).")] = False,
    image: Annotated[str | None, typer.Option("--image", metavar="IMAGE", help="Take the installed packages from "
                                                 "this image, built by sparkforge, instead of building.")] = None,
    epoch: Annotated[int | None, typer.Option(
        "--source-date-epoch", metavar="SECONDS", min=MIN_EPOCH, max=MAX_EPOCH, help="SOURCE_DATE_EPOCH of the builds "
        "(default: the lock's, else today 00:00 UTC); 1980 to 2107, the years a wheel's zip can store.")] = None,
    network: NetworkOption = Network.host,
    ca_cert: CaCert = None,
    log_dir: LogDir = DEFAULT_LOG_DIR,
) -> None:
    """Resolve a variant's open pins and write images/VARIANT.lock.json beside its recipe.

    The lock holds the base image digest (from its registry's v2 API), the vLLM and component commits and versions
    (git remotes are asked for commits the recipe leaves open), every Python package a real build installed, each mod's
    content hash and the builds' SOURCE_DATE_EPOCH. What cannot be resolved from here is written as {"unresolved":
    "<why>"}, never invented; but a pin an earlier lock made is not dropped when its registry, git remote or index does
    not answer now: lock exits 1 and leaves the file as it was. Builds then use the lock; `build --locked` refuses a
    recipe changed after locking.

    Examples:
      ./build.py lock ng17e
      ./build.py lock ng17e --no-build      (no GB10 or NGC access here)
      ./build.py --images tests/variants lock testvllm --base 127.0.0.1:5000/sparkforge/base-local:bookworm
    """
    plan = plan_of(variant, base, policy=LockPolicy.IGNORE)
    opts = pipeline.build_options(network=network.value, ca_cert=ca_bundle(ca_cert), log_dir=log_dir)
    path, result = pipeline.lock_variant(plan, State.layout, opts, epoch=epoch, no_build=no_build, image=image,
                                         say=tell_step, progress=progress_printer(variant))
    emit(views.lock_lines(variant, path, result))


@app.command("verify-repro")
def verify_repro_cmd(
    variant: Variant,
    base: Base = None,
    builder_host: Annotated[str | None, typer.Option(
        "--builder-host", metavar="ENDPOINT", help="Docker engine to build on (default: the one docker uses), e.g. "
        "unix:///run/x.sock; its image store must export reproducibly (a containerd store does).")] = None,
    locked: Annotated[bool, typer.Option("--locked", help="Refuse when the recipe disagrees with its lock.")] = False,
    epoch: Annotated[int | None, typer.Option(
        "--source-date-epoch", metavar="SECONDS", min=MIN_EPOCH, max=MAX_EPOCH, help="Override the lock's "
        f"SOURCE_DATE_EPOCH (default without a lock: {verbs.DEFAULT_EPOCH}).")] = None,
    network: NetworkOption = Network.host,
    ca_cert: CaCert = None,
    keep: Annotated[Path | None, typer.Option("--keep", metavar="DIR", help="Keep both image tarballs and build "
                                                 "logs in this folder.")] = None,
) -> None:
    """Build a variant twice from scratch and check that both images are identical, bit for bit.

    Both builds run with --no-cache (fresh cache mounts too), SOURCE_DATE_EPOCH and rewrite-timestamp, exported to
    tarballs whose manifest, config and layer digests are compared; where they differ, the layers and files that
    differ are named (exit 1). An engine that cannot export reproducibly is refused in one line (exit 2), never
    reported as a difference.

    Example:
      ./build.py --images tests/variants verify-repro testvllm --base sparkforge/base-local:bookworm \\
        --builder-host unix:///tmp/ctd/docker.sock --ca-cert /etc/ssl/certs/ca-certificates.crt
    """
    plan = verbs.repro_plan(plan_of(variant, base, LockPolicy.LOCKED if locked else LockPolicy.AUTO), epoch)
    opts = pipeline.build_options(network=network.value, ca_cert=ca_bundle(ca_cert), docker_host=builder_host)
    say(f"verify-repro {plan.tag}: two --no-cache builds, SOURCE_DATE_EPOCH={plan.source_date_epoch}")
    result = verbs.verify_variant_repro(plan, State.layout, opts, keep=keep, progress=progress_printer(variant),
                                        say=tell_step)
    emit(views.repro_lines(result))
    if not result.identical:
        raise typer.Exit(1)


@app.command("diff")
def diff_cmd(
    a: Annotated[str, typer.Argument(metavar="A", help="A variant, a lock file (*.lock.json) or a built image.")],
    b: Annotated[str, typer.Argument(metavar="B", help="The same kinds as A.")],
) -> None:
    """Show what changed from A to B, in every field of the plan, section by section.

    The image, base, OS packages, vLLM, components, protect, build, env, mods, tooling and the installed Python
    packages. A variant gives its plan as `show` does (with its lock's packages when the lock agrees), a lock file what
    it pins, an image its build record. What one side does not record is noted, never reported as the same.

    Examples:
      ./build.py diff ng17 ng17e
      ./build.py diff images/ng17.lock.json images/ng17e.lock.json
      ./build.py diff sparkforge/vllm:ng17e-261c666b5a67 sparkforge/vllm:ng17e
    """
    from ..repro.diff import SECTIONS, diff, summary

    emit(views.diff_lines(diff(a, b, State.layout), SECTIONS, summary))


@app.command()
def outdated(
    variant: Variant,
    mods: Annotated[bool, typer.Option("--mods/--no-mods", help="Try the variant's vLLM mods on each newer vLLM "
                                       "release (as check-mods --matrix; sources are downloaded once and cached).")]
    = True,
    until: Annotated[str | None, typer.Option("--until", metavar="VERSION", help="Last vLLM release to try the mods "
                                                 "on.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON: each component's pin and newer "
                                          "releases, and where each mod applies.")] = False,
) -> None:
    """Show which pinned components have newer releases on PyPI, and which mods apply to them.

    Checks vLLM, every pip component, and git components PyPI also publishes (transformers). Each vLLM mod of the
    variant is applied to each newer vLLM release's real source in a scratch copy, as `check-mods --matrix` does.

    Examples:
      ./build.py outdated ng17
      ./build.py outdated ng17e --no-mods
    """
    report = verbs.outdated_variant(plan_of(variant), try_mods=mods, until=until, progress=tell)
    if as_json:
        write(json.dumps({
            "variant": report.plan.variant,
            "components": [{"component": c.component, "project": c.project, "pinned": c.pinned, "newer": list(c.newer),
                            "newest": c.newest, "checked": c.checked, "note": c.note} for c in report.components],
            "mods": {m: [list(run) for run in report.applies_to(m)] for m in report.mods} if report.cells else {},
        }, indent=2) + "\n")
        return
    emit(views.outdated_lines(report, tried_mods=mods))


@app.command()
def bump(
    variant: Variant,
    to: Annotated[str | None, typer.Option("--to", metavar="VERSION", help="The vLLM release to bump to.")] = None,
    latest: Annotated[bool, typer.Option("--latest", help="Bump to the newest vLLM release on PyPI.")] = False,
    name: Annotated[str | None, typer.Option("--name", metavar="NAME", help="The new variant's name (default: "
                                                "VARIANT-X-Y-Z for release X.Y.Z).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check everything and print the new recipe; write "
                                          "nothing.")] = False,
    lock: Annotated[bool, typer.Option("--lock/--no-lock", help="After writing, lock the new variant without a "
                                       "build (lock --no-build: commits, the base digest, a wheel set).")] = True,
    ca_cert: CaCert = None,
) -> None:
    """Write a variant for a newer vLLM release, with the mods that apply to its real source.

    The new recipe `extends` VARIANT and says only what differs: the vLLM pin (a git source follows the release's
    tag vX.Y.Z), the mods it drops and the env names it stops setting. Each vLLM mod is applied, in the build's
    order, to the release's source from PyPI (as check-mods does); one that fails there, or whose change the release
    already holds, is dropped with the reason. A mod that applies outside its declared targets is kept and its
    targets widened, but only after it also applied to every release the wider range takes in. Nothing is written
    unless the new variant passes check-mods; then `lock --no-build` runs (--no-lock skips it) and the diff against
    VARIANT is printed.

    Examples:
      ./build.py bump ng17 --to 0.18.0 --name ng18
      ./build.py bump pypi033 --latest --dry-run
    """
    from ..repro.diff import SECTIONS, diff_snapshots, from_plan, summary

    plan = plan_of(variant, policy=LockPolicy.IGNORE)
    opts = pipeline.build_options(ca_cert=ca_bundle(ca_cert))
    command = shlex.join(["./build.py", "bump", variant, *(["--to", to] if to else ["--latest"])]
                         + (["--name", name] if name else []))
    result = verbs.bump_variant(plan, State.layout, opts, to=to, latest=latest, name=name, dry_run=dry_run, lock=lock,
                                command=command, say=tell)
    emit(views.bump_lines(result))
    if result.lock is not None:
        emit(views.lock_lines(result.bump.recipe.stem, result.lock_path, result.lock))
    emit(views.diff_lines(diff_snapshots(from_plan(plan), from_plan(result.bump.new)), SECTIONS, summary))
