"""A recipe against its lock: where they disagree (check_lock), the plan a lock gives (apply_lock), and the Lock
a plan and a real build give (make_lock)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..errors import ConfigError, DownloadError, Hint
from .lockfile import (MIN_EPOCH, BuiltFrom, Lock, LockedBase, LockedComponent, LockedMod, LockedVllm, LockedWheels,
                       Pinned, Unresolved)
from .plan import BaseImage, Pin, Plan, rehash


@dataclass(frozen=True)
class Mismatch:
    field: str
    recipe: str
    lock: str
    recipe_changed: bool = True  # False: the lock does not record the field (made before locks did)


def _plan_pin(pin: Pin) -> Pinned:
    return Pinned(pin.value, pin.unknown)


def _fields(lock: Lock) -> list[tuple[str, Any]]:
    """(field, value) in a fixed order; a Pinned value is a pin that the lock may fill in."""
    out: list[tuple[str, Any]] = [("variant", lock.variant)]
    out += [(f"base.{key}", getattr(lock.base, key)) for key in ("repository", "tag", "digest")]
    out += [(f"vllm.{key}", getattr(lock.vllm, key))
            for key in ("source", "version", "repo", "ref", "commit", "sha256", "install_deps")]
    out += [("vllm.package", lock.vllm.package or "vllm"), ("components", list(lock.components))]
    for name, lc in lock.components.items():
        out += [(f"components.{name}.{key}", getattr(lc, key))
                for key in ("kind", "package", "version", "repo", "ref", "commit", "dest")]
    out += [("mods", [m.name for m in lock.mods])]
    out += [(f"mods.{m.name}.digest", m.digest) for m in lock.mods]
    out += [("protect", list(lock.protect)), ("os_packages", list(lock.os_packages))]
    w = lock.wheels
    out += [("python.version", w.python if w else None), ("python.platform", w.platform if w else None),
            ("python.leave_out", sorted(w.leave_out or ()) if w else [])]
    return out


def _show(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, Pinned):
        return value.value if value.value is not None else f"unknown ({value.unresolved})"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    return str(value)


def compare(plan: Plan, lock: Lock) -> list[Mismatch]:
    """Where the recipe (as planned now) and the lock disagree; what the recipe leaves open the lock fills in."""
    wheels = LockedWheels.of(plan.python, None, (), "not resolved") if plan.python else None
    recipe = dict(_fields(make_lock(plan, {}, MIN_EPOCH, packages=None, packages_unresolved="not built", wheels=wheels)))
    locked = dict(_fields(lock))
    out = []
    for name in dict.fromkeys([*recipe, *locked]):
        section, _, rest = name.partition(".")
        if section in ("components", "mods") and rest and rest.split(".")[0] not in (
                set(recipe[section]) & set(locked[section])):
            continue  # a component or mod on one side only: reported once, by the field "components" or "mods"
        a, b = recipe.get(name), locked.get(name)
        if isinstance(a, Pinned) and a.value is None:
            continue  # the recipe leaves it open: the lock fills it in
        if name == "vllm.repo" and b is None and a is not None:
            out.append(Mismatch(name, _show(a), "nothing (the lock was made before locks named vLLM's repository)",
                                recipe_changed=False))
        elif (a.value if isinstance(a, Pinned) else a) != (b.value if isinstance(b, Pinned) else b):
            out.append(Mismatch(name, _show(a), _show(b)))
    return out


def check_lock(plan: Plan, lock: Lock, path: Path, given: dict[str, str] | None = None) -> None:
    """Refuse, naming the first field, when the recipe was changed after it was locked. given: the fields (by
    prefix) that a command-line option set instead of the recipe, and the option (`{"base.": "--base"}`)."""
    if diffs := compare(plan, lock):
        first = diffs[0]
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        said = next((option for prefix, option in (given or {}).items() if first.field.startswith(prefix)), None)
        why = "; the recipe changed after it was locked" if first.recipe_changed and said is None else ""
        raise ConfigError(f"{said or 'recipe'} says {first.recipe}, lock says {first.lock}{more}{why}", path=path,
                          field=first.field, hint=Hint("lock it again with", ("lock", plan.variant)))


def apply_lock(plan: Plan, lock: Lock) -> Plan:
    """The plan with the lock's pins, its installed packages as pip constraints, and its SOURCE_DATE_EPOCH."""
    base = plan.base
    if base.digest.value is None and lock.base.digest.value:
        base = BaseImage(base.repository, base.tag, Pin(lock.base.digest.value))
    vllm = plan.vllm
    if vllm.source == "git" and vllm.commit.value is None and lock.vllm.commit and lock.vllm.commit.value:
        vllm = replace(vllm, commit=Pin(lock.vllm.commit.value))
    components = []
    for c in plan.components:
        lc = lock.components.get(c.name)
        if lc and c.kind == "pip" and c.version.value is None and lc.version and lc.version.value:
            c = replace(c, version=Pin(lc.version.value))
        if lc and c.kind == "git" and c.commit.value is None and lc.commit and lc.commit.value:
            c = replace(c, commit=Pin(lc.commit.value))
        components.append(c)
    wheel_set = lock.wheels.pins if lock.wheels is not None else ()
    return rehash(replace(plan, base=base, vllm=vllm, components=tuple(components),
                          pins=constraints(lock.installed), source_date_epoch=lock.source_date_epoch,
                          wheel_set=wheel_set))


def constraints(packages: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The installed packages with a PEP 440 version (a Debian build's may not be one; pip never installs it)."""
    out = []
    for name, version in packages:
        with contextlib.suppress(InvalidVersion):
            Version(version)
            out.append((name, version))
    return tuple(out)


def pinned_plan(plan: Plan, pins: dict[str, Pinned], source_date_epoch: int,
                wheels: LockedWheels | None = None) -> Plan:
    """The plan to build for a lock: resolved digest, commits and wheel set, the epoch; no package pins yet."""
    lock = make_lock(plan, pins, source_date_epoch, packages=None, packages_unresolved="not built yet", wheels=wheels)
    return apply_lock(plan, lock)


def make_lock(plan: Plan, pins: dict[str, Pinned], source_date_epoch: int, *,
              packages: dict[str, str] | None, packages_unresolved: str | None,
              built_from: BuiltFrom | None = None, wheels: LockedWheels | None = None) -> Lock:
    """A Lock from the plan, the resolved pins and (from a real build) the installed packages."""
    installed: dict[str, str] = {canonicalize_name(k): v for k, v in (packages or {}).items()}
    comps: dict[str, LockedComponent] = {}
    for c in plan.components:
        if c.kind == "pip":
            if c.version.value:
                version = Pinned(c.version.value)
            elif packages is not None:
                got = installed.get(canonicalize_name(str(c.package).split("[")[0]))
                version = Pinned(got) if got else Pinned(None, f"the build did not install {c.package}")
            else:
                version = Pinned(None, f"{packages_unresolved} (recipe: {c.version.unknown})")
            comps[c.name] = LockedComponent(kind="pip", package=c.package, version=version)
        else:
            comps[c.name] = LockedComponent(kind="git", repo=c.repo, ref=c.ref, dest=c.dest,
                                            commit=pins.get(f"components.{c.name}.commit", _plan_pin(c.commit)))
    v = plan.vllm
    return Lock(
        variant=plan.variant, source_date_epoch=source_date_epoch,
        base=LockedBase(repository=plan.base.repository, tag=plan.base.tag,
                        digest=pins.get("base.digest", _plan_pin(plan.base.digest))),
        vllm=LockedVllm(source=v.source, version=v.version, ref=v.ref, install_deps=v.install_deps,
                        commit=pins.get("vllm.commit", _plan_pin(v.commit)) if v.source == "git" else None,
                        sha256=v.wheel.sha256 if v.wheel else None, repo=v.repo,
                        package=v.package if v.package != "vllm" else None),
        components=comps, mods=tuple(LockedMod(name=m.name, digest=m.digest) for m in plan.mods),
        protect=plan.protect, os_packages=plan.os_packages,
        packages=installed if packages is not None else Unresolved(unresolved=packages_unresolved or "not known"),
        built_from=built_from, wheels=wheels,
    )


def lost_pins(before: Lock, after: Lock) -> list[tuple[str, str]]:
    """(field, old value) of each pin `before` resolved that `after` leaves open for the same source because the
    source did not answer: locking again then must not drop it."""
    lost: list[tuple[str, str]] = []

    def check(field: str, old: Pinned | None, new: Pinned | None) -> None:
        if old is not None and new is not None and old.value is not None and new.value is None and not new.answered:
            lost.append((field, old.value))

    if (before.base.repository, before.base.tag) == (after.base.repository, after.base.tag):
        check("base.digest", before.base.digest, after.base.digest)
    # A lock made before locks named vLLM's repository is taken to be of the recipe's: kept, not lost.
    if (before.vllm.source, before.vllm.repo or after.vllm.repo, before.vllm.ref) == \
            (after.vllm.source, after.vllm.repo, after.vllm.ref):
        check("vllm.commit", before.vllm.commit, after.vllm.commit)
    named = {name: c for name, c in before.components.items() if c.kind == "git"}
    by_source = {(c.repo, c.ref): c.commit for c in before.components.values()  # what a renamed component had
                 if c.kind == "git" and c.commit is not None and c.commit.value is not None}
    for name, c in after.components.items():
        was = named.get(name)
        if c.kind != "git":
            continue  # a pip component's version comes from a build, not from asking its source
        if was is not None and (was.repo, was.ref) == (c.repo, c.ref):
            check(f"components.{name}.commit", was.commit, c.commit)
        elif was is None and (c.repo, c.ref) in by_source:
            check(f"components.{name}.commit", by_source[(c.repo, c.ref)], c.commit)
    if before.wheels is not None and after.wheels is not None and before.wheels.unresolved is None \
            and after.wheels.unresolved is not None and _same_requirements(before, after):
        n = len(before.wheels.packages or ())
        lost.append(("wheels", f"a set of {n} wheel{'' if n == 1 else 's'}"))
    return lost


def _same_requirements(before: Lock, after: Lock) -> bool:
    """`after`'s wheel set is asked for what `before`'s was: Python target, vLLM release, pip components."""
    assert before.wheels is not None and after.wheels is not None
    if (before.wheels.target, before.vllm.version, before.vllm.install_deps) != \
            (after.wheels.target, after.vllm.version, after.vllm.install_deps):
        return False
    old_pip = {name: c for name, c in before.components.items() if c.kind == "pip"}
    new_pip = {name: c for name, c in after.components.items() if c.kind == "pip"}
    return old_pip.keys() == new_pip.keys() and all(
        old_pip[n].package == c.package and (c.version is None or c.version.value is None
                                             or (old_pip[n].version or Pinned(None)).value == c.version.value)
        for n, c in new_pip.items())


def keep_pins(path: Path, before: Lock, after: Lock) -> None:
    """Refuse (a network failure, exit 1) a lock that would drop a pin the earlier one made; the file stays."""
    if lost := lost_pins(before, after):
        field, value = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        raise DownloadError(f"cannot be resolved now: {dict(after.unresolved()).get(field, 'no answer')}; the lock "
                            f"file, which pins it to {value}, is left unchanged{more} (a pin written in the recipe "
                            "is not asked for)", path=path, field=field)
