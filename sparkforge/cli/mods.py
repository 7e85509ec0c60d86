"""The `mod` verbs: `mod new` writes a mod folder for an upstream patch or one by hand, `mod save` writes the latter."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from ..errors import ConfigError
from ..recipe.remote import new_mod
from ..recipe.scaffold import with_mod
from ..repro import verbs
from . import views
from .usage import App
from .app import CaCert, State, app, ca_bundle, emit, next_step, plan_of, say, tell

mod_app = App(help="Write a new mod: from an upstream patch, or by hand against a variant's source.")
app.add_typer(mod_app, name="mod")

Name = Annotated[str, typer.Argument(metavar="NAME", help="The mod's name, and its folder mods/NAME (lowercase "
                                     "letters, digits and '-').")]


class Phase(str, enum.Enum):
    """When a mod applies."""

    install = "install"
    source = "source"


@mod_app.command("new")
def mod_new(
    name: Name,
    variant: Annotated[str | None, typer.Option(
        "--variant", metavar="VARIANT", help="Write the patch by hand: make a git work tree of the pristine source "
        "this variant's release has, to edit and then `mod save`.")] = None,
    from_url: Annotated[str | None, typer.Option("--from-url", metavar="URL", help="https URL of a unified diff, "
                                                    "e.g. a GitHub commit's URL with .diff after it.")] = None,
    pr: Annotated[str | None, typer.Option("--pr", metavar="OWNER/REPO#N", help="A GitHub pull request; its diff "
                                              "is read from github.com, as .../pull/N.diff.")] = None,
    versions: Annotated[str | None, typer.Option(
        "--versions", metavar="SPEC", help="The releases of the component the patch is for, as a PEP 440 range, e.g. "
        "'>=0.17.0,<0.19' (with --variant, default: the variant's release).")] = None,
    component: Annotated[str, typer.Option("--component", metavar="NAME", help="What the patch edits: vllm, or a "
                                           "component of the recipe.")] = "vllm",
    phase: Annotated[Phase, typer.Option("--phase", help="install: the installed package; source: the vLLM tree "
                                         "before its compile (variants that build vLLM from git).")] = Phase.install,
    ca_cert: CaCert = None,
) -> None:
    """Write mods/NAME/mod.yaml: for an upstream patch, or for a patch written by hand.

    With --from-url or --pr, the diff is downloaded once into the cache and checked: a unified diff whose files stay
    inside the component's tree. The mod names the URL (or pull request), pinned by the sha256 of what came, with one
    verify check: a line the patch adds. Nothing is written when any of this fails.

    With --variant, mod.yaml lists every required field with what it means, and build/mod-src/NAME is a git work tree
    of the pristine source the variant's mods are checked against. Edit the files there, then `mod save NAME` writes
    the patch from `git diff`, with paths relative to that tree's root (a/vllm/...).

    Examples:
      ./build.py mod new my-fix --variant ng17
      ./build.py mod new colpali-template --pr vllm-project/vllm#12345 --versions '>=0.17.0,<0.18.1'
    """
    given = [flag for flag, value in (("--variant", variant), ("--from-url", from_url), ("--pr", pr)) if value]
    if len(given) != 1:
        raise ConfigError("give one of --variant VARIANT (a patch by hand), --from-url URL or --pr OWNER/REPO#N",
                          field=" and ".join(given) or "mod new")
    if variant is not None:
        work = verbs.new_local_mod(State.layout, plan_of(variant), name, component=component, phase=phase.value,
                                   versions=versions, ca_cert=ca_bundle(ca_cert))
        say(f"wrote {State.layout.mods_dir / name / 'mod.yaml'}: every required field, with what it means")
        on = f"with {variant}'s mods {work.applied} applied, as the build hands it to this mod" if work.applied \
            else "pristine"
        say(f"made {work.path}: {work.source}, {on}, as a git work tree (its paths are the patch's paths)")
        say("next: " + next_step(f"edit the files in {work.path}, then write the patch with", "mod", "save", name))
        return
    if versions is None:
        raise ConfigError("give the releases the patch is for, e.g. --versions '>=0.17.0,<0.19'", field="--versions")
    made = new_mod(State.layout.mods_dir, name, url=from_url, pr=pr, versions=versions, component=component,
                   phase=phase.value, ca_cert=ca_bundle(ca_cert))
    say(f"wrote {made.folder / 'mod.yaml'}: {made.url} (sha256 {made.sha256}), changes {', '.join(made.files)}")
    say(f"next: read the patch, then add {name} to a variant's mods and " + next_step("run", "check-mods", "VARIANT"))


@mod_app.command("save")
def mod_save(name: Name) -> None:
    """Write mods/NAME's patch from `git diff` in its work tree, then check the mod as check-mods does.

    The patch is the work tree's change since `mod new --variant` made it, new files included, with paths relative to
    the tree's root. While mod.yaml says `verify: []`, a check is written too: a line the patch adds. The variant's
    mods and this one are then applied to that source in a scratch copy, twice: exit 1 unless it applies.
    """
    work, saved = verbs.save_local_mod(State.layout, name)
    say(f"wrote {saved.patch} from git diff in {work.path}: changes {', '.join(saved.files)}")
    if saved.verify:
        say(f"wrote the verify check {saved.verify} into {State.layout.mods_dir / name / 'mod.yaml'}")
    plan = with_mod(plan_of(work.variant), State.layout, name)
    report = verbs.check_mods([plan], say=tell)
    emit([views.check_table(report.rows, [plan]), views.check_summary(report)])
    if report.failed(strict=False):
        raise typer.Exit(1)
    if plan.mods[-1].name == name:
        say(f"next: add {name} to the mods of {plan.recipe_files[0]}, then "
            + next_step("run", "check-mods", work.variant))
