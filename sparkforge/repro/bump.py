"""`bump`: a new variant for a newer vLLM release, keeping the mods that apply to its real source.

The new variant `extends` the old one and says only what differs: the vLLM pin, the mods it drops and the env
names it no longer sets. A mod's targets are widened only over releases it was proven on. Nothing is written
until the new variant, planned from scratch copies, passes check-mods; then every file is written, or none.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

import yaml
from packaging.specifiers import Specifier, SpecifierSet
from packaging.version import Version

from ..errors import ConfigError
from ..files import write_atomic
from ..recipe import sources
from ..recipe.fields import MAX_VARIANT, NAME_RE
from ..recipe.layout import Layout
from ..recipe.plan import Mod, Plan
from ..recipe.planner import plan_variant
from ..recipe.resolve import NotFound, Unreachable, git_commit
from .checkmods import RowState, apply_in_scratch, check_env, check_variant, declares, matrix

# A wider range is proven release by release; past this many, widening is left to the user.
MAX_PROVEN = 12


@dataclass(frozen=True)
class Verdict:
    """What bump does with one mod of the old variant."""

    mod: str
    kept: bool
    reason: str
    widened: tuple[str, str] | None = None  # targets.versions before and after


@dataclass(frozen=True)
class Bump:
    """A new variant, checked and ready to write: its recipe's text, and the mod.yaml files it widens."""

    old: Plan
    new: Plan  # planned from scratch copies: its files are gone, its digests are those written
    version: str
    recipe: Path
    text: str
    verdicts: tuple[Verdict, ...]
    env_dropped: tuple[tuple[str, str], ...]  # (name, why)
    edits: tuple[tuple[Path, bytes], ...]  # mod.yaml: its new bytes
    unresolved: tuple[str, ...]  # what the new recipe leaves open, in words


def target_version(plan: Plan, recipe: Path, to: str | None, latest: bool,
                   releases: Callable[[str], list[str]] = sources.release_versions) -> str:
    """The release to bump to: --to, or with --latest the newest final release on PyPI."""
    if plan.vllm.source not in ("pypi", "git") or plan.vllm.wheel is not None:
        raise ConfigError(f"vllm.source is {plan.vllm.wheel and 'wheel' or plan.vllm.source}: bump follows vLLM's "
                          "releases, so it needs a pypi or git source; edit the recipe by hand",
                          path=recipe, field="vllm.source")
    if (to is None) == (not latest):
        raise ConfigError("give the release with --to VERSION, or --latest", field="--to")
    project = plan.vllm.package if plan.vllm.source == "pypi" else "vllm"
    try:
        found = releases(project)
    except sources.SourceUnavailable as exc:
        raise sources.SourceUnavailable(f"cannot list {project}'s releases: {exc}") from None
    version = found[-1] if latest else str(to)
    if version not in found:
        newest = f"; the newest is {found[-1]}" if found else ""
        raise ConfigError(f"{project} {version} is not a final release on the package index{newest}", field="--to")
    if Version(version) <= Version(plan.vllm.version):
        raise ConfigError(f"{plan.variant} pins vllm {plan.vllm.version}; {version} is not newer", field="--to")
    return version


def widened(spec: str, version: str, releases: list[str]) -> tuple[str, list[str]]:
    """targets.versions grown to take version, and the releases the new range claims that the old did not
    (besides version): each must be proven before the range is written."""
    old = SpecifierSet(spec)
    keep = [s for s in old if s.contains(version, prereleases=True)]
    declared = [r for r in releases if old.contains(r, prereleases=True)]
    lower = (">=", ">", "~=", "==", "===")
    if declared and not any(s.operator in lower for s in keep):
        keep.append(Specifier(f">={declared[0]}"))
    rank = {**dict.fromkeys(lower, 0), "!=": 1}  # lower bounds, then exclusions, then the rest
    new = ",".join([*(str(s) for s in sorted(keep, key=lambda s: (rank.get(s.operator, 2), str(s)))), f"<={version}"])
    claimed = SpecifierSet(new)
    return new, [r for r in releases if claimed.contains(r, prereleases=True) and not old.contains(r, prereleases=True)
                 and r != version]


_VERSIONS = re.compile(r"^(?P<lead>\s+versions:\s*)(?P<q>[\"']?)(?P<spec>[^\"'#\n]*?)(?P=q)(?P<tail>\s*(#.*)?)$",
                       re.MULTILINE)


def with_targets(text: str, old: str, new: str, path: Path) -> str:
    """mod.yaml's text with targets.versions old replaced by new, comments and layout kept."""
    hits = [m for m in _VERSIONS.finditer(text) if m.group("spec").strip() == old]
    if len(hits) != 1:
        raise ConfigError(f"cannot find one `versions: \"{old}\"` line to widen; widen it by hand", path=path,
                          field="targets.versions")
    m = hits[0]
    out = text[:m.start()] + f'{m.group("lead")}"{new}"{m.group("tail")}' + text[m.end():]
    if (yaml.safe_load(out) or {}).get("targets", {}).get("versions") != new:
        raise ConfigError("widening targets.versions did not read back; widen it by hand", path=path,
                          field="targets.versions")
    return out


def judge_mods(plan: Plan, version: str, tree: Path, workdir: Path, releases: list[str],
               say: Callable[[str], None]) -> list[Verdict]:
    """A verdict per mod of the old variant, in its order."""
    vllm_mods = [m for m in plan.mods if m.spec.component == "vllm"]
    results: dict[str, tuple[RowState, str]] = {}
    if vllm_mods:
        # One pass in the build's order: a mod that fails leaves its files untouched, so the mods after it
        # are applied as they would be without it.
        say(f"applying {len(vllm_mods)} vLLM mods to vllm {version}'s release source")
        applied = apply_in_scratch(vllm_mods, tree, workdir / "sequence")
        results = {mod.name: (state, detail) for mod, state, detail in applied}

    def verdict(mod: Mod) -> Verdict:
        declared, takes = mod.spec.targets.versions, declares(mod, version)
        if mod.spec.component == "image" and takes:
            return Verdict(mod.name, True, f"drop-in files; its targets ({declared}) take {version}")
        if mod.spec.component == "image":
            return Verdict(mod.name, False, f"its targets ({declared}) leave out {version}, and drop-in files are "
                           "read against a release by hand, not proven by applying them")
        if mod.spec.component != "vllm":
            return Verdict(mod.name, True, f"edits {mod.spec.component}, which bump leaves at its pin")
        state, detail = results[mod.name]
        if state == RowState.ALREADY:
            return Verdict(mod.name, False, f"its change is already in vllm {version}'s source")
        if state != RowState.APPLIED:
            return Verdict(mod.name, False, f"does not apply to vllm {version}: {detail}")
        if takes:
            return Verdict(mod.name, True, f"applies to vllm {version}")
        return prove_wider(mod, version, releases, workdir, say)

    return [verdict(mod) for mod in plan.mods]


def prove_wider(mod: Mod, version: str, releases: list[str], workdir: Path, say: Callable[[str], None]) -> Verdict:
    """A mod that applies to version outside its declared range: kept, with the range widened, when it also
    applies alone to every release the wider range newly claims."""
    declared = mod.spec.targets.versions
    new, claimed = widened(declared, version, releases)
    if len(claimed) > MAX_PROVEN:
        return Verdict(mod.name, False, f"applies to vllm {version}, but its targets ({declared}) would widen over "
                       f"{len(claimed)} releases; prove them with check-mods --matrix and widen by hand")
    if claimed:
        say(f"{mod.name}: proving {', '.join(claimed)} before widening its targets to {new}")
        cells = matrix([mod], claimed, workdir, progress=lambda v: say(f"  {mod.name} on vllm {v}"))
        bad = [c for c in cells if c.state not in (RowState.APPLIED, RowState.ALREADY)]
        if bad:
            return Verdict(mod.name, False, f"applies to vllm {version}, but not to {bad[0].version}, which its "
                           f"targets ({declared}) would have to take on the way: {bad[0].detail}")
    return Verdict(mod.name, True, f"applies to vllm {version}; targets widened from {declared} to {new}",
                   (declared, new))


def vllm_pin(plan: Plan, recipe: Path, version: str, tree: Path,
             say: Callable[[str], None]) -> tuple[dict[str, Any], list[str]]:
    """The new recipe's `vllm:` and what it leaves open. A git source follows the release's tag, whose
    commit the remote gives and the release's source records the start of."""
    if plan.vllm.source == "pypi":
        return {"version": version}, []
    ref = f"v{version}"
    recorded = sources.recorded_commit(tree)
    repo = plan.vllm.repo or ""
    try:
        commit = git_commit(repo, ref)
    except (Unreachable, NotFound) as exc:
        why = f"bump could not ask {repo} for {ref} ({exc}); `lock` asks again"
        say(f"vllm.commit left open: {exc}")
        return {"ref": ref, "commit": {"unknown": why}, "version": version}, [f"vllm.commit: {why}"]
    if recorded and not commit.startswith(recorded):
        raise ConfigError(f"{repo} tag {ref} is commit {commit[:12]}, but vllm {version}'s release source records "
                          f"{recorded}; the remote is not vLLM's release", path=recipe, field="vllm.repo")
    return {"ref": ref, "commit": commit, "version": version}, []


def recipe_text(plan: Plan, name: str, version: str, vllm: dict[str, Any], verdicts: list[Verdict],
                env_dropped: list[tuple[str, str]], command: str) -> str:
    """The new variant's recipe: what differs from the old one, with the reasons as comments."""
    doc: dict[str, Any] = {"extends": plan.variant, "description": f"{plan.variant} with vLLM {version}", "vllm": vllm}
    if env_dropped:
        doc["env"] = {n: None for n, _ in env_dropped}
    dropped = [v for v in verdicts if not v.kept]
    if dropped:
        doc["mods"] = {"remove": [v.mod for v in dropped]}
    head = [f"# {name}: {plan.variant} with vLLM {version}, written by `{command}` on "
            f"{datetime.date.today().isoformat()}.",
            f"# Each mod of {plan.variant} was applied, in the build's order, to vLLM {version}'s release source."]
    head += [f"# Dropped {v.mod}: {v.reason}" for v in dropped]
    head += [f"# Not set: {n}: {why}" for n, why in env_dropped]
    head += [f"# Kept {v.mod}: {v.reason}" for v in verdicts if v.kept]
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000)
    return "\n".join(" ".join(line.split()) for line in head) + "\n" + body


def _scratch_layout(layout: Layout, plan: Plan, work: Path, edits: dict[Path, str]) -> Layout:
    """Copies of the recipe chain and the old variant's mods (targets widened), to plan the new variant from."""
    images, mods = work / "images", work / "mods"
    images.mkdir()
    mods.mkdir()
    for file in plan.recipe_files:
        shutil.copy2(layout.images_dir / Path(file).name, images / Path(file).name)
    for mod in plan.mods:
        shutil.copytree(mod.folder, mods / mod.name, symlinks=True)
        edited = edits.get(Path(mod.folder) / "mod.yaml")
        if edited is not None:
            (mods / mod.name / "mod.yaml").write_text(edited)
    return replace(layout, images_dir=images, mods_dir=mods)


def prepare(plan: Plan, layout: Layout, *, to: str | None, latest: bool, name: str | None, command: str,
            say: Callable[[str], None] = lambda line: None) -> Bump:
    """Everything bump would write, checked: nothing is written here."""
    if name is not None and (not NAME_RE.fullmatch(name) or len(name) > MAX_VARIANT):
        raise ConfigError(f"{name!r} is not a variant name: lowercase letters, digits and '-', at most {MAX_VARIANT}",
                          field="--name")
    own = layout.images_dir / Path(plan.recipe_files[0]).name  # recipe_files are relative to images_dir's parent
    version = target_version(plan, own, to, latest)
    name = name or f"{plan.variant}-{version.replace('.', '-')}"  # a variant name holds no dots
    recipe = layout.images_dir / f"{name}.yaml"
    if recipe.exists() or recipe.is_symlink():
        raise ConfigError(f"{recipe} exists; name the new variant with --name", field="--name")
    releases = sources.release_versions("vllm")
    say(f"vllm {version}: its release source from the package index (cached)")
    tree = sources.release_tree("vllm", version)
    with tempfile.TemporaryDirectory(prefix="sparkforge-bump-") as tmp:
        work = Path(tmp)
        verdicts = judge_mods(plan, version, tree, work, releases, say)
        vllm, unresolved = vllm_pin(plan, own, version, tree, say)
        edits: dict[Path, str] = {}  # mod.yaml: its text with widened targets
        for mod, v in zip(plan.mods, verdicts):
            if v.widened:
                path = Path(mod.folder) / "mod.yaml"
                edits[path] = with_targets(path.read_text(), *v.widened, path)
        scratch = _scratch_layout(layout, plan, work, edits)
        dropped_mods = {v.mod for v in verdicts if not v.kept}
        toggles = {m.spec.env.name: m.name for m in plan.mods if m.spec.env and m.name in dropped_mods}
        env_dropped = [(n, f"the toggle of {toggles[n]}, which is dropped") for n, _ in plan.env if n in toggles]
        # An env name the recipe sets that the new release does not read goes too, with the reason; the recipe
        # then changes, and its env is read again (a name still unread after that fails check-mods below).
        for _ in range(2):
            text = recipe_text(plan, name, version, vllm, verdicts, env_dropped, command)
            (scratch.images_dir / recipe.name).write_text(text)
            new = plan_variant(scratch, name, platform=None)
            env_rows = check_env(new, work)
            unread = [(r.mod.removeprefix("env "), r.detail) for r in env_rows if r.state == RowState.FAILED]
            if not unread:
                break
            env_dropped += unread
        say(f"check-mods {name}")
        rows = check_variant(new, work) + env_rows
        failed = [r for r in rows if r.state == RowState.FAILED]
        if failed:
            raise ConfigError(f"the new variant fails check-mods: {failed[0].mod}: {failed[0].detail}",
                              path=recipe, field="mods")
    return Bump(plan, new, version, recipe, text, tuple(verdicts), tuple(env_dropped),
                tuple((path, edited.encode()) for path, edited in edits.items()), tuple(unresolved))


def write(bump: Bump) -> None:
    """The recipe first, never over an existing one (of two bumps to one name, the second stops before it touches
    a mod), then the widened mod.yaml files; on any failure, every file written before is put back."""
    write_atomic(bump.recipe, bump.text.encode(), new=True)
    done: list[tuple[Path, bytes]] = []
    try:
        for path, data in bump.edits:
            old = path.read_bytes()
            write_atomic(path, data, mode=os.stat(path).st_mode & 0o777)
            done.append((path, old))
    except BaseException:
        for path, old in reversed(done):
            write_atomic(path, old)
        bump.recipe.unlink(missing_ok=True)
        raise
