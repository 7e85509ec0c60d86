"""What changed between two variants, two locks or two built images.

Each side becomes a Snapshot of every field of a plan, section by section, read from a plan (with its lock's
packages), a lock file or an image's build record. What a side does not know is never reported as the same.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast
from collections.abc import Sequence

from ..errors import ConfigError
from ..imageref import ImageRef
from ..inimage.contract import BuildRecord
from ..recipe.config import list_variants
from ..recipe.lockfile import LOCK_SUFFIX, Lock, Pinned, read_lock
from ..recipe.layout import Layout
from ..recipe.plan import Plan, PythonTarget, WheelPin, platform_of

SECTIONS = ("image", "base", "os_packages", "vllm", "components", "protect", "build", "env", "mods", "tooling",
            "packages")

# A section's entries: (name, text); text None means this side does not know the value.
Entries = tuple[tuple[str, "str | None"], ...]

# The fields of a plan's identity that the named sections above show; `other` shows the rest.
_SHOWN = {"image", "platform", "base", "os_packages", "vllm", "components", "protect", "build", "env", "mods",
          "tooling_digest", "tool_version", "source_date_epoch", "pins", "gpus", "kernels_not_needed", "python",
          "wheel_set"}
# What names the variant rather than what is in it: every two variants differ there.
_NAMING = {"variant", "chain"}


@dataclass(frozen=True)
class Snapshot:
    """One side of a diff: each section's entries, or None where the whole section is not known."""

    label: str
    base: Entries
    vllm: Entries
    components: Entries
    mods: Entries
    image: Entries | None = None
    os_packages: Entries | None = None
    protect: Entries | None = None
    build: Entries | None = None
    env: Entries | None = None
    tooling: Entries | None = None
    packages: Entries | None = None
    other: Entries = ()  # every other field of a plan, as JSON: a field added to Plan is never missed
    unknown: tuple[tuple[str, str], ...] = ()  # (section, why this side does not know it), read where it is None
    built: tuple[str, str] | None = None  # an image's (plan hash, image ID): two builds of one plan compare by ID

    def section(self, name: str) -> Entries | None:
        return cast("Entries | None", getattr(self, name))  # SECTIONS and `other` are fields of that type


@dataclass(frozen=True)
class Change:
    section: str
    kind: str  # added | removed | changed | order
    name: str
    old: str = ""
    new: str = ""

    def line(self) -> str:
        if self.kind in ("added", "removed"):  # one side only: the other is ""
            return f"{'+' if self.kind == 'added' else '-'} {self.name} {self.old or self.new}".rstrip()
        return f"~ {self.name}: {self.old or '(none)'} -> {self.new or '(none)'}"


@dataclass(frozen=True)
class Diff:
    a: Snapshot
    b: Snapshot
    changes: tuple[Change, ...]
    notes: tuple[str, ...]  # why a section could not be compared

    def in_section(self, section: str) -> list[Change]:
        return [c for c in self.changes if c.section == section]

    @property
    def sections(self) -> tuple[str, ...]:
        """The sections to show: all of SECTIONS, then any other that holds a change."""
        extra = [c.section for c in self.changes if c.section not in SECTIONS]
        return SECTIONS + tuple(dict.fromkeys(extra))


def _vllm_text(source: str, version: str, ref: str | None, commit: str | None) -> str:
    if source in ("pypi", "wheel", "base"):
        return f"{version} ({source})"
    return f"{version} ({source} {ref} @ {commit or 'UNPINNED'})"


def _component_text(kind: str, package: str | None, version: str | None, repo: str | None, ref: str | None,
                    commit: str | None, dest: str | None) -> str:
    if kind == "pip":
        return f"pip {package}=={version or 'UNPINNED'}"
    return f"{kind} {repo} {ref} @ {commit or 'UNPINNED'}, dest {dest}"


def _os_packages(specs: tuple[str, ...] | list[str]) -> Entries:
    """`name` or `name=version`, by name: a version added or changed reads as a change of that package."""
    return tuple(sorted((name, version) for name, _, version in (s.partition("=") for s in specs)))


def _build(arch: str | None, max_jobs: Any, nvcc: Any, env: Any, epoch: int | None) -> Entries:
    return (("TORCH_CUDA_ARCH_LIST", arch), ("MAX_JOBS", None if max_jobs is None else str(max_jobs)),
            ("NVCC_THREADS", None if nvcc is None else str(nvcc)),
            ("SOURCE_DATE_EPOCH", str(epoch) if epoch is not None else "none"),
            *((f"env {k}", v) for k, v in env or ()))


def _kernels(gpus: tuple[str, ...] | None, not_needed: Sequence[tuple[str, str | None]] | None) -> Entries:
    """The kernel check's inputs: the GPUs, and the extensions not needed with each reason (None in a record)."""
    names = None if not_needed is None else " ".join(name for name, _ in not_needed) or "none"
    return (("gpus", None if gpus is None else " ".join(gpus)), ("kernels_not_needed", names),
            *((f"kernels_not_needed {name}", reason) for name, reason in not_needed or ()))


def _wheels(python: PythonTarget | None, pins: tuple[WheelPin, ...], unresolved: str | None = None) -> Entries:
    """The image's Python and its locked wheel set: one entry per distribution, by version and sha256s."""
    shown = f"{python.version} on {python.platform}" if python else "none"
    if python and python.leave_out:
        shown += f", leaving out {', '.join(python.leave_out)}"
    if unresolved:
        return ("python", shown), ("wheel set", f"unresolved: {unresolved}")
    return (("python", shown), ("wheel set", f"{len(pins)} wheels" if pins else "none"),
            *((f"wheel {p.name}", f"{p.version} " + " ".join(f"sha256:{sha}" for _, sha, _ in p.files)) for p in pins))


def from_plan(plan: Plan, lock: Lock | None = None, lock_note: str = "") -> Snapshot:
    """A plan; installed packages come from its lock (or the pins a lock gave the plan)."""
    v = plan.vllm
    comps: list[tuple[str, str | None]] = []
    for c in plan.components:
        comps.append((c.name, _component_text(c.kind, c.package, c.version.value, c.repo, c.ref, c.commit.value,
                                              c.dest)))
        if c.pip_install:
            comps.append((f"{c.name}.pip_install", "yes"))
    packages = lock.installed if lock is not None and not lock.packages_unresolved else plan.pins or None
    note = lock_note or (f"lock: {lock.packages_unresolved}" if lock is not None else "no lock applied")
    b, identity = plan.build, plan.identity()
    base = plan.base.ref + ("" if plan.base.digest.value else " (digest unknown)")
    return Snapshot(
        label=f"variant {plan.variant}",
        image=(("image", plan.image), ("platform", plan.platform)),
        base=(("base", base),),
        os_packages=_os_packages(plan.os_packages),
        vllm=(("vllm", _vllm_text(v.source, v.version, v.ref, v.commit.value)), ("repo", v.repo or "none"),
              ("package", v.package), ("install_deps", "yes" if v.install_deps else "no"),
              ("wheel", " ".join(x for x in (v.wheel.filename, v.wheel.url, v.wheel.path, f"sha256:{v.wheel.sha256}")
                                 if x) if v.wheel else "none")) + _wheels(plan.python, plan.wheel_set)
        + (("venv", plan.python.venv if plan.python and plan.python.venv else "none"),),
        components=tuple(comps),
        protect=tuple((n, "") for n in sorted(plan.protect)),
        build=_build(b.torch_cuda_arch_list, b.max_jobs, b.nvcc_threads, b.env, plan.source_date_epoch)
        + _kernels(plan.gpus, plan.kernels_not_needed),
        env=tuple(plan.env),
        mods=tuple((m.name, m.digest) for m in plan.mods),
        tooling=(("template and tools", plan.tooling_digest), ("sparkforge", plan.tool_version)),
        packages=packages,
        other=tuple((key, json.dumps(identity[key], sort_keys=True)) for key in sorted(identity)
                    if key not in _SHOWN | _NAMING),
        unknown=(("packages", note),),
    )


def _p(pin: Pinned | None) -> str | None:
    return pin.value if pin else None


def from_lock(lock: Lock, path: Path) -> Snapshot:
    """A lock file: what it pins. It does not record the image, build options, env or tooling."""
    v = lock.vllm
    comps: list[tuple[str, str | None]] = []
    for name, c in lock.components.items():
        comps.append((name, _component_text(c.kind, c.package, _p(c.version), c.repo, c.ref, _p(c.commit), c.dest)))
        if c.kind == "git":
            comps.append((f"{name}.pip_install", None))
    base = f"{lock.base.repository}:{lock.base.tag}"
    base += f"@{lock.base.digest.value}" if lock.base.digest.value else " (digest unknown)"
    not_in_lock = "a lock file does not record it"
    return Snapshot(
        label=f"lock {path}",
        base=(("base", base),),
        os_packages=_os_packages(lock.os_packages),
        vllm=(("vllm", _vllm_text(v.source, v.version, v.ref, _p(v.commit))),
              ("repo", "none" if v.source != "git" else v.repo), ("package", v.package or "vllm"),
              ("install_deps", "yes" if v.install_deps else "no"), ("wheel", None))
        + (_wheels(lock.wheels.target, lock.wheels.pins, lock.wheels.unresolved) if lock.wheels else _wheels(None, ()))
        + (("venv", None),),
        components=tuple(comps),
        protect=tuple((n, "") for n in sorted(lock.protect)),
        build=_build(None, None, None, None, lock.source_date_epoch) + _kernels(None, None),
        mods=tuple((m.name, m.digest) for m in lock.mods),
        packages=None if lock.packages_unresolved else lock.installed,
        unknown=(("image", not_in_lock), ("env", not_in_lock), ("tooling", not_in_lock),
                 ("packages", f"unresolved: {lock.packages_unresolved}")),
    )


def from_record(image: str, record: BuildRecord, labels: dict[str, str] | None = None) -> Snapshot:
    """The build record inside an image, and its labels (the base the engine held, where the plan pinned none)."""
    from ..build.builder import BASE_LABEL

    b = record.base
    resolved = (labels or {}).get(BASE_LABEL)
    base = f"{b['repository']}:{b['tag']}"
    if b["digest"].get("value"):
        base += f"@{b['digest']['value']}"
    else:
        base += f" (built from {resolved})" if resolved else " (digest unknown)"
    v = record.vllm
    commit = v["commit"].get("value") or v.get("built_commit")
    installed = record.installed
    comps: list[tuple[str, str | None]] = []
    for c in record.components:
        if c["kind"] == "pip":
            version = c["version"].get("value") or installed.get(c["package"].split("[")[0])
            comps.append((c["name"], _component_text("pip", c["package"], version, None, None, None, None)))
        else:
            commit_c = installed.get(c["name"]) or c["commit"].get("value")
            comps.append((c["name"], _component_text("git", None, None, c.get("repo"), c["ref"], commit_c, c["dest"])))
            if c.get("pip_install"):
                comps.append((f"{c['name']}.pip_install", "yes"))
    bs = record.build or {}
    packages = record.packages
    not_in_record = "an image's build record does not list it"
    return Snapshot(
        label=f"image {image}",
        image=(("image", ImageRef.parse(record.tag).repository), ("platform", platform_of(record.machine))),
        base=(("base", base),),
        vllm=(("vllm", _vllm_text(v["source"], v["version"], v["ref"], commit)), ("repo", v.get("repo") or "none"),
              ("package", v.get("package") or "vllm"), ("install_deps", "yes" if v.get("install_deps") else "no"),
              ("python", None), ("wheel set", None), ("venv", None)),
        components=tuple(comps),
        build=_build(bs.get("torch_cuda_arch_list"), bs.get("max_jobs"), bs.get("nvcc_threads"), bs.get("env"),
                     record.source_date_epoch)
        + _kernels(record.kernels.gpus if record.kernels else None,
                   [(n, None) for n in record.kernels.not_needed] if record.kernels else None),
        env=record.env,
        mods=tuple((m.name, m.digest) for m in record.mods),
        tooling=(("template and tools", None), ("sparkforge", record.tool_version)),
        packages=tuple(sorted(packages.items())) if packages is not None else None,
        unknown=(("os_packages", not_in_record), ("protect", not_in_record),
                 ("packages", "the image's build record predates package lists; rebuild it")),
    )


def snapshot(arg: str, layout: Layout) -> Snapshot:
    """A variant name, a lock file, or an image in the local engine, in that order of preference."""
    path = Path(arg)
    if arg.endswith(LOCK_SUFFIX) or (path.suffix == ".json" and path.is_file()):
        return from_lock(read_lock(path), path)
    if arg in list_variants(layout.images_dir):
        from ..build.pipeline import load_plan  # the plan every other command sees, lock applied

        loaded = load_plan(layout, arg)
        if loaded.lock is None:
            note = loaded.warnings[0] if loaded.warnings else f"{arg} has no lock ({arg}{LOCK_SUFFIX})"
            return from_plan(loaded.plan, None, note)
        return from_plan(loaded.plan, read_lock(loaded.lock))
    if ":" in arg or "/" in arg or "@" in arg:
        from ..build.builder import current_image
        from ..build.inspect import read_record

        record, labels = read_record(arg)
        return replace(from_record(arg, record, labels), built=(record.plan_hash, current_image(arg) or ""))
    known = ", ".join(list_variants(layout.images_dir)) or "none"
    raise ConfigError(f"{arg!r} is not a variant (known: {known}), a lock file or an image reference", field="diff")


def diff_snapshots(a: Snapshot, b: Snapshot) -> Diff:
    changes: list[Change] = []
    notes: list[str] = []
    for section in SECTIONS + ("other",):
        ea, eb = a.section(section), b.section(section)
        if ea is None or eb is None:
            notes += [f"{section} of {side.label} not known: {dict(side.unknown).get(section, '')}"
                      for side, e in ((a, ea), (b, eb)) if e is None]
            continue
        da, db = dict(ea), dict(eb)  # an entry one side does not know (None) is not compared
        found = [Change(section, "removed", k, old=v) for k, v in da.items() if k not in db and v is not None]
        found += [Change(section, "added", k, new=v) for k, v in db.items() if k not in da and v is not None]
        found += [Change(section, "changed", k, v, w) for k, v in da.items()
                  if v is not None and (w := db.get(k)) is not None and v != w]
        found = [replace(c, old=_short_digest(c.old), new=_short_digest(c.new))
                 for c in sorted(found, key=lambda c: (c.name, c.kind))]
        if section == "mods":
            common_a = [n for n, _ in ea if n in db]
            common_b = [n for n, _ in eb if n in da]
            if common_a != common_b:
                found.append(Change("mods", "order", "order", ", ".join(common_a), ", ".join(common_b)))
        changes += found
    if a.built and b.built and a.built[0] == b.built[0]:
        (plan, id_a), (_, id_b) = a.built, b.built
        if id_a != id_b:
            notes.append(f"both are builds of plan {plan[:12]}, yet their images differ: {id_a[:19]} and "
                         f"{id_b[:19]}; `verify-repro VARIANT` builds it twice and names the files that differ")
        else:
            notes.append(f"both name one image, {id_a[:19]}")
    return Diff(a, b, tuple(changes), tuple(notes))


_COMMIT = re.compile(r"\b([0-9a-f]{12})[0-9a-f]{28}\b")


def _short_digest(text: str) -> str:
    """Digests and commits are compared in full and shown short: sha256: and 12 hex, 12 hex."""
    return text[:19] if text.startswith("sha256:") else _COMMIT.sub(r"\1", text)


def diff(arg_a: str, arg_b: str, layout: Layout) -> Diff:
    return diff_snapshots(snapshot(arg_a, layout), snapshot(arg_b, layout))


def summary(d: Diff, section: str) -> str:
    """What to print for a section without changes."""
    ea, eb = d.a.section(section), d.b.section(section)
    if ea is None or eb is None:
        return "not compared"
    known = [(k, v) for k, v in ea if v is not None and dict(eb).get(k) is not None]
    if section in ("image", "base", "vllm"):  # the first entry names the whole: the image, the base, vllm's pin
        return f"same: {_short_digest(known[0][1] or '')}"
    if section in ("components", "mods", "os_packages", "protect"):
        names = [k for k, _ in ea if not k.endswith(".pip_install")]
        return f"same: {', '.join(names) or 'none'}"
    if section == "packages":
        return f"same: {len(ea)} packages"
    return f"same: {', '.join(f'{k}={_short_digest(v)}' for k, v in known) or 'none'}"
