"""Check that each mod applies to the real source it targets, in a scratch copy, with the build's own applier.

Only a variant that keeps its base's vLLM (`vllm.source: base`) asks the engine, for that base's installed tree.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .. import inimage
from ..build import basetree, prebuilt
from ..errors import DownloadError
from ..net import time_left
from ..recipe import sources
from ..recipe.plan import Mod, Plan
from ..recipe.remote import materialize


class RowState(str, Enum):
    """What check-mods found for a mod (a Row, or a cell of the release matrix) or an env name."""

    APPLIED = "applied"
    ALREADY = "already"  # the change is in the pristine source already
    FAILED = "failed"
    UNVERIFIED = "unverified"  # the source or a patch could not be fetched from here
    READ = "read"  # an env name some .py file of the vllm package reads (the env check)

    def __str__(self) -> str:  # printed as its word, as the strings before it were
        return self.value


@dataclass(frozen=True)
class Row:
    variant: str
    mod: str
    state: RowState
    detail: str
    source: str  # what the mod was checked against


@dataclass(frozen=True)
class SourceRef:
    """Where the source of a component at the variant's pin comes from."""

    label: str
    fetch: Callable[[], Path | None]  # None: an empty root (the image component)


def unavailable(label: str, reason: str) -> SourceRef:
    """A source that cannot be fetched; checking against it reports the mods unverified, with reason."""

    def fetch() -> Path:
        raise sources.SourceUnavailable(reason)

    return SourceRef(label, fetch)


def vllm_source(plan: Plan, ca_cert: Path | None = None) -> SourceRef:
    """The vLLM tree at the variant's pin: the release's sdist when the pin is that release (for a git pin, when
    the release records the start of its commit), else git; for a wheel source, the wheel's own files."""
    v = plan.vllm
    if v.wheel is not None:
        wheel = v.wheel

        def from_wheel() -> Path:
            # Checked as the build checks it: a wrong wheel is bad input (exit 2); only an unreachable one unverified.
            try:
                path = prebuilt.checked_wheel(plan, Path(plan.recipe_files[0]), ca_cert=ca_cert)
            except DownloadError as exc:
                raise sources.SourceUnavailable(f"the recipe's wheel: {exc.detail}") from None
            return sources.extract_tree(path, "vllm", f"{wheel.sha256[:16]}-{wheel.filename}")
        return SourceRef(f"vllm wheel {wheel.filename} (sha256 {wheel.sha256[:12]})", from_wheel)
    if v.source == "pypi":
        return SourceRef(f"vllm {v.version} (PyPI)", lambda: sources.release_tree("vllm", v.version))
    if v.source == "base":  # the base image's own tree where the engine has it; else the release's sdist, said so
        try:
            found = basetree.base_tree(plan.base.ref)
        except basetree.NotOnEngine as exc:
            return SourceRef(f"vllm {v.version} (PyPI, the release the base carries; the base's own tree is not read: "
                             f"{exc})", lambda: sources.release_tree("vllm", v.version))
        return SourceRef(f"vllm {v.version} installed in the base {plan.base.ref} ({found.installed_at}, image "
                         f"{found.image_id[:19]})", lambda: found.root)
    if v.commit.value is None:
        return unavailable(f"vllm {v.ref} (commit unknown)", f"vllm.commit is not pinned ({v.commit.unknown})")
    commit = v.commit.value
    version = Version(v.version)
    if not version.is_prerelease and not version.is_devrelease:
        def from_release() -> Path:
            tree = sources.release_tree("vllm", v.version)
            recorded = sources.recorded_commit(tree)
            if not recorded or not commit.startswith(recorded):
                raise sources.SourceUnavailable(
                    f"the vllm {v.version} release records commit {recorded}, not {commit[:12]}")
            return tree
        return SourceRef(f"vllm {v.version} (PyPI, commit {commit[:9]})", from_release)
    return SourceRef(f"vllm {commit[:12]} (git)", lambda: sources.git_tree(v.repo or "", commit, "vllm"))


def apply_in_scratch(mods: list[Mod], tree: Path | None, scratch: Path, *,
                     patcher_timeout: float = inimage.PATCHER_TIMEOUT,
                     ca_cert: Path | None = None) -> list[tuple[Mod, RowState, str]]:
    """Apply mods in the build's order (source phase first) to a scratch copy of tree (None: an empty root): apply,
    run its file checks, apply again (must be detected as already applied). A failed mod leaves its files untouched,
    so one broken mod never hides the state of the next; a patch URL that cannot be fetched leaves it unverified."""
    if tree is not None:
        # Install-phase mods of vLLM see what the image's site-packages holds of it, the vllm/ package alone: only
        # that is copied (under half of a release's source tree). Source-phase mods see the whole checkout.
        vllm_install = all(m.spec.component == "vllm" and m.spec.phase == "install" for m in mods)
        sources.scratch_copy(tree, scratch, only="vllm" if vllm_install else None)
    else:
        scratch.mkdir(parents=True)

    def outcome(mod: Mod) -> tuple[RowState, str]:
        try:
            spec, folder = materialize(mod, ca_cert)
        except DownloadError as exc:
            return RowState.UNVERIFIED, exc.detail
        first = inimage.apply_mod(spec, folder, scratch, patcher_timeout=patcher_timeout)
        if first.state == inimage.ModState.FAILED:
            return RowState.FAILED, first.detail
        bad = [c for c in inimage.verify_mod(spec, scratch, in_image=False) if c[1] == inimage.CheckState.FAILED]
        if bad:
            return RowState.FAILED, f"verify: {bad[0][0]}: {bad[0][2]}"
        second = inimage.apply_mod(spec, folder, scratch, patcher_timeout=patcher_timeout)
        if second.state != inimage.ModState.ALREADY:
            return RowState.FAILED, f"second application was {second.state.value}, not detected as already applied"
        if first.state == inimage.ModState.APPLIED:
            return RowState.APPLIED, ""
        return RowState.ALREADY, "already present in the pristine source"

    return [(mod, *outcome(mod)) for mod in sorted(mods, key=lambda m: m.spec.phase != "source")]


def check_variant(plan: Plan, workdir: Path, *, patcher_timeout: float = inimage.PATCHER_TIMEOUT,
                  ca_cert: Path | None = None) -> list[Row]:
    """Rows for each mod of a variant, in the variant's order."""
    rows: dict[str, Row] = {}
    groups: dict[str, list[Mod]] = {}
    for mod in plan.mods:
        groups.setdefault(mod.spec.component, []).append(mod)
    if plan.vllm.wheel is not None and "vllm" not in groups:
        # The recipe's wheel is checked as the build checks it, even when no mod reads it (unreachable: let be).
        with contextlib.suppress(DownloadError):
            prebuilt.checked_wheel(plan, Path(plan.recipe_files[0]), ca_cert=ca_cert)
    for component, mods in groups.items():
        ref = source_of(plan, component, ca_cert)
        try:
            tree = ref.fetch()
        except sources.SourceUnavailable as exc:
            for mod in mods:
                rows[mod.name] = Row(plan.variant, mod.name, RowState.UNVERIFIED, str(exc), ref.label)
            continue
        with scratch_dir(workdir, f"{plan.variant}-{component}-") as root:
            for mod, state, detail in apply_in_scratch(mods, tree, root, patcher_timeout=patcher_timeout,
                                                       ca_cert=ca_cert):
                rows[mod.name] = Row(plan.variant, mod.name, state, detail, ref.label)
    return [rows[m.name] for m in plan.mods]


def source_of(plan: Plan, component: str, ca_cert: Path | None = None) -> SourceRef:
    """The pristine tree a component's mods apply to: vLLM's, a component's at its pin, or for `image` None."""
    if component == "image":
        return SourceRef("an empty image root", lambda: None)
    if component == "vllm":
        return vllm_source(plan, ca_cert)
    comp = next(c for c in plan.components if c.name == component)
    if comp.kind == "pip" and comp.version.value:
        project = (comp.package or "").split("[")[0]
        return SourceRef(f"{project} {comp.version.value} (PyPI)",
                         lambda: sources.release_tree(project, comp.version.value or ""))
    if comp.kind == "git" and comp.commit.value:
        package = component.replace("-", "_")
        return SourceRef(f"{component} {comp.commit.value[:12]} (git)",
                         lambda: sources.git_tree(comp.repo or "", comp.commit.value or "", package))
    return unavailable(f"{component} (unpinned)", f"components.{component} is not pinned")


@dataclass(frozen=True)
class MatrixCell:
    mod: str
    version: str
    state: RowState
    detail: str
    declared: bool  # whether the mod's targets include this release


def release_progress(say: Callable[[str], None], label: str, total: int,
                     clock: Callable[[], float] = time.monotonic) -> Callable[[str], None]:
    """A progress callback for a run over releases: a line each, with n/N and, from the second on, the time left."""
    start = clock()
    seen = 0

    def tick(version: str) -> None:
        nonlocal seen
        seen += 1
        per = (clock() - start) / max(1, seen - 1)  # the pace so far, known from the second release on
        left = f", {time_left(per * (total - seen + 1))}" if seen > 1 else ""
        say(f"{label} {version} ({seen}/{total}{left})")
    return tick


def matrix(mods: list[Mod], versions: list[str], workdir: Path,
           progress: Callable[[str], None] = lambda _: None, *, ca_cert: Path | None = None) -> list[MatrixCell]:
    """Try each vLLM mod alone against each release: where does it start and stop applying?"""
    cells = []
    for version in versions:
        progress(version)
        try:
            tree = sources.release_tree("vllm", version)
        except sources.SourceUnavailable as exc:
            cells += [MatrixCell(m.name, version, RowState.UNVERIFIED, str(exc), declares(m, version)) for m in mods]
            continue
        for mod in mods:
            with scratch_dir(workdir, f"matrix-{version}-") as root:
                (_, state, detail), = apply_in_scratch([mod], tree, root, ca_cert=ca_cert)
            cells.append(MatrixCell(mod.name, version, state, detail, declares(mod, version)))
    return cells


def declares(mod: Mod, version: str) -> bool:
    """Whether the mod's targets take a release."""
    return SpecifierSet(mod.spec.targets.versions).contains(Version(version), prereleases=True)


@contextlib.contextmanager
def scratch_dir(workdir: Path, prefix: str) -> Iterator[Path]:
    """A root to apply mods in (not yet made), inside a folder of workdir that is removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=workdir, ignore_cleanup_errors=True) as scratch:
        yield Path(scratch) / "root"


def applies_ranges(cells: list[MatrixCell], mod: str) -> list[tuple[str, str]]:
    """Runs of consecutive releases where the mod applies, as (first, last)."""
    groups = itertools.groupby((c for c in cells if c.mod == mod),
                               key=lambda c: c.state in (RowState.APPLIED, RowState.ALREADY))
    runs = [[c.version for c in group] for applies, group in groups if applies]
    return [(run[0], run[-1]) for run in runs]


# The namespace of vLLM's own settings: a name in it that vLLM does not read is a mistake. A name outside it may
# be meant for another program in the image (NCCL, CUDA), which this check cannot see into: unverified, not failed.
VLLM_PREFIX = "VLLM_"


def names_read(tree: Path, names: Iterable[str], package: str = "vllm") -> set[str]:
    """The names that a .py file of tree/package holds as a whole string literal (`os.getenv("NAME")`, envs.py's
    `"NAME": lambda: ...`); a comment, a longer name or a name built at run time (an f-string) does not count."""
    wanted = set(names)
    found: set[str] = set()
    for path in sorted((tree / package).rglob("*.py")):
        if found >= wanted:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        candidates = {n for n in wanted - found if n.encode() in data}
        if candidates:
            found |= candidates & _string_literals(data)
    return found


def _string_literals(data: bytes) -> set[str]:
    """The plain str literals of a Python file; a file that does not tokenize holds none."""
    import ast
    import io
    import tokenize

    try:
        literals = [t.string for t in tokenize.tokenize(io.BytesIO(data).readline) if t.type == tokenize.STRING]
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return set()
    values = []
    for literal in literals:
        with contextlib.suppress(ValueError, SyntaxError):  # an f-string: its name is built at run time
            values.append(ast.literal_eval(literal))
    return {value for value in values if isinstance(value, str)}


def check_env(plan: Plan, workdir: Path, *, ca_cert: Path | None = None) -> list[Row]:
    """A row per runtime env name of a variant: is it read (names_read) by the pinned vLLM source after the
    variant's vLLM mods? A VLLM_ name that is not fails; another is unverified, as all are without the source."""
    toggles = {m.spec.env.name: f"toggle of mod {m.name}" for m in plan.mods if m.spec.env}
    origins = {name: toggles.get(name, "recipe env") for name, _ in plan.env}
    if not origins:
        return []
    ref = vllm_source(plan, ca_cert)
    try:
        tree = ref.fetch()
    except sources.SourceUnavailable as exc:
        return [Row(plan.variant, f"env {n}", RowState.UNVERIFIED, str(exc), ref.label) for n in origins]
    mods = [m for m in plan.mods if m.spec.component == "vllm"]
    with scratch_dir(workdir, f"{plan.variant}-env-") as root:
        if mods:
            apply_in_scratch(mods, tree, root, ca_cert=ca_cert)
            tree = root
        read = names_read(tree, origins) if tree is not None else set()  # None: an empty root reads no name
    release = f"vllm {plan.vllm.version}"
    after = " with its mods" if mods else ""
    rows = []
    for name, origin in origins.items():
        if name in read:
            state, detail = RowState.READ, f"{origin}; read by {release}{after}"
        elif name.startswith(VLLM_PREFIX):
            state = RowState.FAILED
            detail = f"{plan.variant} sets {name} ({origin}), which no .py file of {release}{after} reads"
        else:
            state = RowState.UNVERIFIED
            detail = (f"{name} ({origin}) is read by no .py file of {release}{after}; a name outside {VLLM_PREFIX}* "
                      "may be meant for another program, which is not checked")
        rows.append(Row(plan.variant, f"env {name}", state, detail, ref.label))
    return rows
