"""Which pins of a variant have newer releases on PyPI, and which mods apply to them.

The vLLM mods are tried on the newer vLLM releases as `check-mods --matrix` tries them; the image mods (drop-in
files) are installed once and set against the releases their targets declare.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..recipe import sources
from ..recipe.plan import Plan
from .checkmods import MatrixCell, applies_ranges, apply_in_scratch, declares, matrix, release_progress, scratch_dir

# Git components whose releases PyPI also carries, by component name.
ON_PYPI = {"transformers": "transformers"}


@dataclass(frozen=True)
class Outdated:
    """One pinned component and the final releases newer than its pin."""

    component: str
    project: str  # on PyPI
    pinned: str  # the pinned version, or what is pinned instead (a git ref)
    newer: tuple[str, ...]
    note: str = ""  # why it could not be checked, or how the pin is not a version
    checked: bool = True  # False: no release list was read, so `newer` says nothing

    @property
    def newest(self) -> str | None:
        return self.newer[-1] if self.newer else None

    @property
    def verdict(self) -> str:
        """What was found, in words: the newer releases, "up to date", or "not checked"."""
        if not self.checked:
            return "not checked"
        if not self.newer:
            return "up to date"
        if len(self.newer) > 6:
            return f"{', '.join(self.newer[:3])}, ... {self.newer[-1]} ({len(self.newer)})"
        return ", ".join(self.newer)


@dataclass(frozen=True)
class Report:
    plan: Plan
    components: tuple[Outdated, ...]
    cells: tuple[MatrixCell, ...]  # vLLM and image mods x newer vLLM releases
    mods: tuple[str, ...]  # the mods tried, in the variant's order

    def applies_to(self, mod: str) -> list[tuple[str, str]]:
        return applies_ranges(list(self.cells), mod)


def newer_releases(project: str, pinned: str | None,
                   releases: Callable[[str], list[str]] = sources.release_versions) -> tuple[str, ...]:
    """Final releases of project newer than pinned (all of them when the pin is not a version)."""
    found = releases(project)
    try:
        floor = None if pinned is None else Version(pinned)
    except InvalidVersion:
        floor = None
    return tuple(v for v in found if floor is None or Version(v) > floor)


def _one(component: str, project: str, pinned: str | None, shown: str, note: str,
         releases: Callable[[str], list[str]]) -> Outdated:
    try:
        return Outdated(component, project, shown, newer_releases(project, pinned, releases), note)
    except sources.SourceUnavailable as exc:
        return Outdated(component, project, shown, (), f"not checked: {exc}", checked=False)


def check_components(plan: Plan, releases: Callable[[str], list[str]] = sources.release_versions) -> list[Outdated]:
    out = [_one("vllm", "vllm", plan.vllm.version, plan.vllm.version, "", releases)]
    for c in plan.components:
        if c.kind == "pip":
            project = canonicalize_name(str(c.package).split("[")[0])
            note = "" if c.version.value else f"version not pinned ({c.version.unknown})"
            out.append(_one(c.name, project, c.version.value, c.version.value or "UNPINNED", note, releases))
        elif c.name in ON_PYPI:
            out.append(_one(c.name, ON_PYPI[c.name], None, f"git {c.ref}",
                            f"pinned by git ref {c.ref}, not a release: every release is listed", releases))
        else:
            out.append(Outdated(c.name, "", f"git {c.ref}", (), "not checked: its releases are git tags, and PyPI "
                                "is the only release source asked", checked=False))
    return out


def outdated(plan: Plan, workdir: Path, *, try_mods: bool = True, until: str | None = None,
             releases: Callable[[str], list[str]] = sources.release_versions,
             progress: Callable[[str], None] = lambda _: None) -> Report:
    """The newer releases of each pinned component and, for vLLM, which mods apply to them."""
    comps = check_components(plan, releases)
    mods = [m for m in plan.mods if m.spec.component in ("vllm", "image")]
    vllm_mods = [m for m in mods if m.spec.component == "vllm"]
    newer_vllm = [v for v in comps[0].newer if until is None or Version(v) <= Version(until)]
    cells: list[MatrixCell] = []
    if try_mods and newer_vllm:
        if vllm_mods:
            cells = matrix(vllm_mods, newer_vllm, workdir,
                           progress=release_progress(progress, "mods: vllm", len(newer_vllm)))
        for mod in (m for m in mods if m.spec.component == "image"):
            # Drop-in files: installed once into an empty root, as check-mods does, and set against every release.
            with scratch_dir(workdir, "outdated-image-") as root:
                (_, state, detail), = apply_in_scratch([mod], None, root)
            cells += [MatrixCell(mod.name, v, state, detail, declares(mod, v)) for v in newer_vllm]
    return Report(plan, tuple(comps), tuple(cells), tuple(m.name for m in mods))
