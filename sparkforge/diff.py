"""What changed between two variants, two locks or two built images.

Each side becomes a Snapshot (base, vLLM, components, mods, installed Python packages), read
from a plan (with its lock's packages when the lock agrees with the recipe), a lock file, or the
build record inside an image. Comparing two snapshots gives the changes, section by section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import list_variants
from .errors import ConfigError
from .lock import LOCK_SUFFIX, Lock, Pinned, compare, lock_path, read_lock
from .plan import Layout, Plan, plan_variant

SECTIONS = ("base", "vllm", "components", "mods", "packages")


@dataclass(frozen=True)
class Snapshot:
    """One side of a diff."""

    label: str
    base: str
    vllm: str
    components: tuple[tuple[str, str], ...]  # (name, what is pinned)
    mods: tuple[tuple[str, str], ...]  # (name, content digest), in order
    packages: tuple[tuple[str, str], ...] | None  # None: not known, see packages_note
    packages_note: str = ""


@dataclass(frozen=True)
class Change:
    section: str
    kind: str  # added | removed | changed | order
    name: str
    old: str = ""
    new: str = ""

    def line(self) -> str:
        mark = {"added": "+", "removed": "-", "changed": "~", "order": "~"}[self.kind]
        if self.kind == "added":
            return f"{mark} {self.name} {self.new}".rstrip()
        if self.kind == "removed":
            return f"{mark} {self.name} {self.old}".rstrip()
        return f"{mark} {self.name}: {self.old} -> {self.new}"


@dataclass(frozen=True)
class Diff:
    a: Snapshot
    b: Snapshot
    changes: tuple[Change, ...]
    notes: tuple[str, ...]  # why a section could not be compared

    def in_section(self, section: str) -> list[Change]:
        return [c for c in self.changes if c.section == section]


# ------------------------------------------------------------------ snapshots


def _pin(value: str | None, unknown: str = "UNPINNED") -> str:
    return value if value else unknown


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "UNPINNED"


def _vllm_text(source: str, version: str, ref: str | None, commit: str | None) -> str:
    return f"{version} (pypi)" if source == "pypi" else f"{version} (git {ref} @ {_short(commit)})"


def _component_text(kind: str, package: str | None, version: str | None, ref: str | None,
                    commit: str | None, dest: str | None) -> str:
    if kind == "pip":
        return f"pip {package}=={_pin(version)}"
    return f"git {ref} @ {_short(commit)} -> {dest}"


def from_plan(plan: Plan, lock: Lock | None = None, lock_note: str = "") -> Snapshot:
    v = plan.vllm
    vllm = _vllm_text(v.source, v.version, v.ref, v.commit.value)
    comps = [(c.name, _component_text(c.kind, c.package, c.version.value, c.ref, c.commit.value, c.dest))
             for c in plan.components]
    packages = lock.packages if lock is not None and not lock.packages_unresolved else None
    note = lock_note or (f"lock: {lock.packages_unresolved}" if lock is not None and lock.packages_unresolved else "")
    return Snapshot(f"variant {plan.variant}", plan.base.ref + ("" if plan.base.digest.value else " (digest unknown)"),
                    vllm, tuple(comps), tuple((m.name, m.digest) for m in plan.mods), packages, note)


def _p(pin: Pinned | None) -> str | None:
    return pin.value if pin else None


def from_lock(lock: Lock, path: Path) -> Snapshot:
    v = lock.vllm
    vllm = _vllm_text(v.source, v.version, v.ref, _p(v.commit))
    comps = [(c.name, _component_text(c.kind, c.package, _p(c.version), c.ref, _p(c.commit), c.dest))
             for c in lock.components]
    base = f"{lock.base.repository}:{lock.base.tag}"
    base += f"@{lock.base.digest.value}" if lock.base.digest.value else " (digest unresolved)"
    return Snapshot(f"lock {path}", base, vllm, tuple(comps), lock.mods,
                    None if lock.packages_unresolved else lock.packages,
                    f"unresolved: {lock.packages_unresolved}" if lock.packages_unresolved else "")


def from_record(image: str, record: dict[str, Any]) -> Snapshot:
    b = record["base"]
    base = f"{b['repository']}:{b['tag']}"
    base += f"@{b['digest']['value']}" if b["digest"].get("value") else " (digest unknown)"
    v = record["vllm"]
    commit = v["commit"].get("value") or v.get("built_commit")
    vllm = _vllm_text(v["source"], v["version"], v["ref"], commit)
    installed = record.get("installed", {})
    comps = []
    for c in record["components"]:
        if c["kind"] == "pip":
            version = c["version"].get("value") or installed.get(c["package"].split("[")[0])
            comps.append((c["name"], _component_text("pip", c["package"], version, None, None, None)))
        else:
            commit = installed.get(c["name"]) or c["commit"].get("value")
            comps.append((c["name"], _component_text("git", None, None, c["ref"], commit, c["dest"])))
    packages = record.get("packages")
    return Snapshot(f"image {image}", base, vllm, tuple(comps), tuple((m["name"], m["digest"]) for m in record["mods"]),
                    tuple(sorted(packages.items())) if packages is not None else None,
                    "" if packages is not None else "the image's build record predates package lists; rebuild it")


def snapshot(arg: str, layout: Layout) -> Snapshot:
    """A variant name, a lock file, or an image in the local engine, in that order of preference."""
    path = Path(arg)
    if arg.endswith(LOCK_SUFFIX) or (path.suffix == ".json" and path.is_file()):
        return from_lock(read_lock(path), path)
    if arg in list_variants(layout.images_dir):
        plan = plan_variant(layout, arg)
        lpath = lock_path(layout.images_dir, arg)
        if not lpath.exists():
            return from_plan(plan, None, f"{arg} has no lock ({lpath.name})")
        lock = read_lock(lpath)
        stale = compare(plan, lock)
        if stale:
            return from_plan(plan, None, f"the lock of {arg} is stale ({stale[0].field} differs)")
        return from_plan(plan, lock)
    if ":" in arg or "/" in arg or "@" in arg:
        from .inspect import read_record

        record, _ = read_record(arg)
        return from_record(arg, record)
    known = ", ".join(list_variants(layout.images_dir)) or "none"
    raise ConfigError(f"{arg!r} is not a variant (known: {known}), a lock file or an image reference",
                      field="diff")


# ------------------------------------------------------------------ comparing


def _pairs(section: str, a: tuple[tuple[str, str], ...], b: tuple[tuple[str, str], ...]) -> list[Change]:
    da, db = dict(a), dict(b)
    out = [Change(section, "removed", k, old=da[k]) for k in da if k not in db]
    out += [Change(section, "added", k, new=db[k]) for k in db if k not in da]
    out += [Change(section, "changed", k, da[k], db[k]) for k in da if k in db and da[k] != db[k]]
    return sorted(out, key=lambda c: (c.name, c.kind))


def diff_snapshots(a: Snapshot, b: Snapshot) -> Diff:
    changes: list[Change] = []
    notes: list[str] = []
    if a.base != b.base:
        changes.append(Change("base", "changed", "base", a.base, b.base))
    if a.vllm != b.vllm:
        changes.append(Change("vllm", "changed", "vllm", a.vllm, b.vllm))
    changes += _pairs("components", a.components, b.components)
    mods = _pairs("mods", a.mods, b.mods)
    changes += [replace_digest(c) for c in mods]
    common_a = [n for n, _ in a.mods if n in dict(b.mods)]
    common_b = [n for n, _ in b.mods if n in dict(a.mods)]
    if common_a != common_b:
        changes.append(Change("mods", "order", "order", ", ".join(common_a), ", ".join(common_b)))
    if a.packages is None or b.packages is None:
        for side in (a, b):
            if side.packages is None:
                notes.append(f"packages of {side.label} not known: {side.packages_note}")
    else:
        changes += _pairs("packages", a.packages, b.packages)
    return Diff(a, b, tuple(changes), tuple(notes))


def replace_digest(change: Change) -> Change:
    """Mod digests are long: show the first 19 characters (sha256: and 12 hex)."""
    return Change(change.section, change.kind, change.name, change.old[:19], change.new[:19])


def diff(arg_a: str, arg_b: str, layout: Layout) -> Diff:
    return diff_snapshots(snapshot(arg_a, layout), snapshot(arg_b, layout))


def summary(d: Diff, section: str) -> str:
    """What to print for a section without changes."""
    side = d.a
    if section == "base":
        return f"same: {side.base}"
    if section == "vllm":
        return f"same: {side.vllm}"
    if section == "components":
        return f"same: {', '.join(n for n, _ in side.components) or 'none'}"
    if section == "mods":
        return f"same: {', '.join(n for n, _ in side.mods) or 'none'}"
    if d.a.packages is None or d.b.packages is None:
        return "not compared"
    return f"same: {len(side.packages or ())} packages"
