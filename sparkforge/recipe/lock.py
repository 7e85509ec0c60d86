"""A recipe against its lock: where they disagree, and the plan a lock gives.

A locked build (`build --locked`) first checks that the recipe still says what the lock was made
from (`check_lock`), then builds with the lock's pins (`apply_lock`); `lock` makes a Lock from a
plan and what a real build installed (`make_lock`). The file itself is `lockfile`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..errors import ConfigError, DownloadError, Hint
from .lockfile import BuiltFrom, Lock, LockedBase, LockedComponent, LockedMod, LockedVllm, LockedWheels, Pinned, \
    Unresolved
from .plan import BaseImage, Pin, Plan, rehash

# ------------------------------------------------------------------ recipe versus lock


@dataclass(frozen=True)
class Mismatch:
    field: str
    recipe: str
    lock: str
    recipe_changed: bool = True  # False: the lock does not record the field (made before locks did)


def _plan_pin(pin: Pin) -> Pinned:
    return Pinned(pin.value, pin.unknown)


def _fields(plan: Plan | None, lock: Lock | None) -> list[tuple[str, Any]]:
    """(field, value) in a fixed order; a Pinned value is a pin that the lock may fill in."""
    out: list[tuple[str, Any]] = []
    if plan is not None:
        b, v = plan.base, plan.vllm
        out += [("variant", plan.variant), ("base.repository", b.repository), ("base.tag", b.tag),
                ("base.digest", _plan_pin(b.digest)), ("vllm.source", v.source), ("vllm.version", v.version),
                ("vllm.repo", v.repo), ("vllm.ref", v.ref),
                ("vllm.commit", _plan_pin(v.commit) if v.source == "git" else None),
                ("vllm.sha256", v.wheel.sha256 if v.wheel else None), ("vllm.install_deps", v.install_deps),
                ("vllm.package", v.package), ("components", [c.name for c in plan.components])]
        for c in plan.components:
            out += [(f"components.{c.name}.kind", c.kind), (f"components.{c.name}.package", c.package),
                    (f"components.{c.name}.version", _plan_pin(c.version) if c.kind == "pip" else None),
                    (f"components.{c.name}.repo", c.repo), (f"components.{c.name}.ref", c.ref),
                    (f"components.{c.name}.commit", _plan_pin(c.commit) if c.kind == "git" else None),
                    (f"components.{c.name}.dest", c.dest)]
        out += [("mods", [m.name for m in plan.mods])]
        out += [(f"mods.{m.name}.digest", m.digest) for m in plan.mods]
        out += [("protect", list(plan.protect)), ("os_packages", list(plan.os_packages))]
        out += [("python.version", plan.python.version if plan.python else None),
                ("python.platform", plan.python.platform if plan.python else None),
                ("python.leave_out", list(plan.python.leave_out) if plan.python else [])]
    if lock is not None:
        lb, lv = lock.base, lock.vllm
        out += [("variant", lock.variant), ("base.repository", lb.repository), ("base.tag", lb.tag),
                ("base.digest", lb.digest), ("vllm.source", lv.source), ("vllm.version", lv.version),
                ("vllm.repo", lv.repo), ("vllm.ref", lv.ref), ("vllm.commit", lv.commit),
                ("vllm.sha256", lv.sha256), ("vllm.install_deps", lv.install_deps),
                ("vllm.package", lv.package or "vllm"), ("components", list(lock.components))]
        for name, lc in lock.components.items():
            out += [(f"components.{name}.kind", lc.kind), (f"components.{name}.package", lc.package),
                    (f"components.{name}.version", lc.version), (f"components.{name}.repo", lc.repo),
                    (f"components.{name}.ref", lc.ref), (f"components.{name}.commit", lc.commit),
                    (f"components.{name}.dest", lc.dest)]
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
    """Where the recipe (as planned now) and the lock disagree, in a fixed order.

    A value the recipe pins must be the lock's; a value the recipe leaves unknown is the lock's
    to fill in (or to mark unresolved).
    """
    recipe = dict(_fields(plan, None))
    locked = dict(_fields(None, lock))
    out = []
    for name in dict.fromkeys([f for f, _ in _fields(plan, None)] + [f for f, _ in _fields(None, lock)]):
        if name.startswith("components.") and name.count(".") == 2:
            comp = name.split(".")[1]
            if comp not in recipe["components"] or comp not in locked["components"]:
                continue  # reported once, by the field "components"
        if name.startswith("mods.") and name.split(".")[1] not in set(recipe["mods"]) & set(locked["mods"]):
            continue  # reported by the field "mods"
        a, b = recipe.get(name), locked.get(name)
        if isinstance(a, Pinned) and a.value is None:
            continue  # the recipe leaves it open: the lock fills it in
        if isinstance(a, Pinned) or isinstance(b, Pinned):
            same = (a.value if isinstance(a, Pinned) else a) == (b.value if isinstance(b, Pinned) else b)
        else:
            same = a == b
        if name == "vllm.repo" and b is None and a is not None:
            out.append(Mismatch(name, _show(a), "nothing (the lock was made before locks named vLLM's repository)",
                                recipe_changed=False))
        elif not same:
            out.append(Mismatch(name, _show(a), _show(b)))
    return out


def check_lock(plan: Plan, lock: Lock, path: Path, given: dict[str, str] | None = None) -> None:
    """Refuse, naming the first field, when the recipe was changed after it was locked. given: the fields (by
    prefix) that a command-line option set instead of the recipe, and the option (`{"base.": "--base"}`)."""
    diffs = compare(plan, lock)
    if diffs:
        first = diffs[0]
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        said = next((option for prefix, option in (given or {}).items() if first.field.startswith(prefix)), None)
        why = "; the recipe changed after it was locked" if first.recipe_changed and said is None else ""
        raise ConfigError(f"{said or 'recipe'} says {first.recipe}, lock says {first.lock}{more}{why}", path=path,
                          field=first.field, hint=Hint("lock it again with", ("lock", plan.variant)))


def apply_lock(plan: Plan, lock: Lock) -> Plan:
    """The plan with the lock's pins: base digest, commits and versions the recipe leaves open,
    every installed package as a pip constraint, and the SOURCE_DATE_EPOCH."""
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
    """The installed packages that can be pip constraints: PEP 440 versions only (a Debian-built
    distribution can carry a version pip cannot parse; pip would never install it anyway)."""
    out = []
    for name, version in packages:
        try:
            Version(version)
        except InvalidVersion:
            continue
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
        variant=plan.variant,
        source_date_epoch=source_date_epoch,
        base=LockedBase(repository=plan.base.repository, tag=plan.base.tag,
                        digest=pins.get("base.digest", _plan_pin(plan.base.digest))),
        vllm=LockedVllm(source=v.source, version=v.version, ref=v.ref, install_deps=v.install_deps,
                        commit=pins.get("vllm.commit", _plan_pin(v.commit)) if v.source == "git" else None,
                        sha256=v.wheel.sha256 if v.wheel else None, repo=v.repo,
                        package=v.package if v.package != "vllm" else None),
        components=comps,
        mods=tuple(LockedMod(name=m.name, digest=m.digest) for m in plan.mods),
        protect=plan.protect,
        os_packages=plan.os_packages,
        packages=installed if packages is not None else Unresolved(unresolved=packages_unresolved or "not known"),
        built_from=built_from,
        wheels=wheels,
    )


def lost_pins(before: Lock, after: Lock) -> list[tuple[str, str]]:
    """The pins `before` resolved that `after` leaves unresolved for the same source, because the source did not
    answer: (field, the value `before` holds). The same source: the base's repository:tag, a git repository and
    ref, and for the wheel set the Python target, the vLLM version and the pip components the recipe pins.
    Locking again where a registry, remote or index does not answer must not drop a pin an earlier lock made."""
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
    """The wheel set of `after` is asked for what `before`'s was: the Python target, the vLLM release and the
    pip components (each version the recipe pins; `after`, locked without a build, holds only those)."""
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
    """Refuse, with the lock file unchanged, a lock that would drop a pin the earlier lock made: its registry,
    git remote or index did not answer this time (a network failure, exit 1), and the pin it held is not lost."""
    lost = lost_pins(before, after)
    if lost:
        field, value = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        raise DownloadError(f"cannot be resolved now: {dict(after.unresolved()).get(field, 'no answer')}; the lock "
                            f"file, which pins it to {value}, is left unchanged{more} (a pin written in the recipe "
                            "is not asked for)", path=path, field=field)
