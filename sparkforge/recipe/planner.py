"""Plan stage: resolve a recipe chain and its mods into one Plan, checking it is complete and consistent."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from ..errors import ConfigError
from ..imageref import ImageRef
from .config import Recipe, load_mod, load_variant
from .layout import Layout, digest_tooling, digest_tree
from .plan import (MACHINE, BaseImage, BuildArgs, Component, Mod, Pin, Plan, PythonTarget, Vllm, WheelFile,
                   platform_of, rehash)
from .lockfile import WHEEL_FILE_RE
from .schema import BaseSpec, ComponentSpec, ModChanges, PythonSpec, RecipeFile, Unknown, VllmSpec

DEFAULT_IMAGE = "sparkforge/vllm"
T = TypeVar("T")


def _need(value: T | None, leaf: Path, fld: str) -> T:
    """A field the plan cannot do without, set in the recipe or in a parent."""
    if value is None:
        raise ConfigError("required field is missing (set it here or in a parent)", path=leaf, field=fld)
    return value


def _pin(raw: str | Unknown | None, leaf: Path, fld: str) -> Pin:
    """A field the plan cannot do without that pins a value, or says why it is not known yet ({unknown: why})."""
    return Pin(None, raw.unknown) if isinstance(raw, Unknown) else Pin(_need(raw, leaf, fld))


def parse_image_ref(ref: str, source: str = "--base") -> BaseImage:
    """Parse REPOSITORY:TAG[@sha256:DIGEST], as given to --base (no tag: latest)."""
    parsed = ImageRef.parse(ref)
    repo, tag, digest = parsed.repository, "latest" if parsed.tag is None else parsed.tag, parsed.digest
    try:  # the checks of a recipe's base: section
        BaseSpec(repository=repo, tag=tag, digest=digest)
    except ValidationError:
        raise ConfigError(f"{ref!r} is not an image reference REPOSITORY:TAG[@sha256:DIGEST]", field=source) from None
    pin = Pin(digest) if digest else Pin(None, f"base given as {ref} with {source}, without a digest")
    return BaseImage(repo, tag, pin)


DEFAULT_PLATFORM = "linux/arm64"  # a DGX Spark


def resolve(recipe: Recipe, layout: Layout, *, base: str | None = None, platform: str | None = None) -> Plan:
    """Turn a merged recipe into a Plan, checking that it is complete and consistent."""
    data = recipe.data
    leaf = layout.images_dir / f"{recipe.variant}.yaml"

    b = _need(data.base, leaf, "base")
    base_image = BaseImage(_need(b.repository, leaf, "base.repository"), _need(b.tag, leaf, "base.tag"),
                           _pin(b.digest, leaf, "base.digest"))
    if base is not None:
        base_image = parse_image_ref(base)

    vllm = _vllm(_need(data.vllm, leaf, "vllm"), leaf)
    components = _components(data.components or {}, leaf)

    bs = _need(data.build, leaf, "build")
    build_env = {k: v for k, v in (bs.env or {}).items() if v is not None}
    build = BuildArgs(_need(bs.torch_cuda_arch_list, leaf, "build.torch_cuda_arch_list"),
                      bs.max_jobs or 4, bs.nvcc_threads or 2, tuple(sorted(build_env.items())))

    mods, env = _mods(data, layout, leaf, vllm, components)
    python = _python(data.python, vllm, leaf)

    chosen = _platform(data.platform, python, leaf, platform)
    device = data.device or "cuda"
    gpus = tuple(data.gpus) if data.gpus is not None else gpus_of(build.torch_cuda_arch_list)
    if device == "cpu" and gpus:
        raise ConfigError("an image for the CPU has no GPUs to check kernels for: set gpus: [] (or device: cuda)",
                          path=leaf, field="gpus")
    not_needed: list[tuple[str, str]] = []
    for name, reason in (data.kernels_not_needed or {}).items():
        if reason is None:
            raise ConfigError("a null reason only removes a parent's entry; give the reason why no listed GPU "
                              "needs it", path=layout.images_dir / f"{recipe.chain[-1]}.yaml",
                              field=f"kernels_not_needed.{name}")
        not_needed.append((name, reason))
    return rehash(Plan(
        variant=recipe.variant, chain=recipe.chain, recipe_files=recipe.files,
        description=(data.description or "").strip(), image=data.image or DEFAULT_IMAGE, base=base_image,
        os_packages=tuple(data.os_packages or ()), vllm=vllm, components=tuple(components),
        protect=tuple(data.protect or ()), build=build, env=tuple(sorted(env.items())), mods=tuple(mods),
        tooling_digest=digest_tooling(layout), gpus=gpus, kernels_not_needed=tuple(sorted(not_needed)),
        kernels_scan=tuple(data.kernels_scan or ()), python=python, device=device, platform=chosen,
    ))


def _platform(recipe_value: str | None, python: PythonTarget | None, leaf: Path, given: str | None) -> str:
    """--platform, else the recipe's, else the wheel set's architecture, else a Spark's; checked against the set."""
    if given is not None and given not in MACHINE:
        raise ConfigError(f"{given!r} is not a platform sparkforge builds for: {', '.join(MACHINE)}",
                          field="--platform")
    wheels = python.platform.partition("-")[0] if python else None
    from_wheels = platform_of(wheels)
    chosen = given or recipe_value or from_wheels or DEFAULT_PLATFORM
    if from_wheels is not None and chosen != from_wheels:
        raise ConfigError(f"{chosen} does not run the wheel set's {wheels} wheels (python.platform "
                          f"{python.platform if python else ''})", path=None if given else leaf,
                          field="--platform" if given else "platform")
    return chosen


def _python(spec: PythonSpec | None, vllm: Vllm, leaf: Path) -> PythonTarget | None:
    """The recipe's `python:`: both fields, and only where pip resolves what the image installs (source pypi)."""
    if spec is None:
        return None
    if vllm.source != "pypi":
        raise ConfigError(f"a wheel set is resolved for a pypi source only (this variant's vllm.source is "
                          f"{vllm.source})", path=leaf, field="python")
    version, platform = _need(spec.version, leaf, "python.version"), _need(spec.platform, leaf, "python.platform")
    left = sorted((name, reason) for name, reason in (spec.leave_out or {}).items() if reason is not None)
    return PythonTarget(version, platform, tuple(n for n, _ in left), tuple(r for _, r in left), spec.venv)


def _vllm(v: VllmSpec, leaf: Path) -> Vllm:
    """The recipe's vllm: section as a Vllm, each source with only the fields it takes."""
    source = _need(v.source, leaf, "vllm.source")
    version = _need(v.version, leaf, "vllm.version")
    install_deps = v.install_deps is not False  # a pypi or wheel source installs vLLM's dependencies by default
    if source == "git":
        vllm = Vllm("git", version, _need(v.repo, leaf, "vllm.repo"), _need(v.ref, leaf, "vllm.ref"),
                    _pin(v.commit, leaf, "vllm.commit"), bool(v.install_deps))
    if source != "pypi":
        _refuse(v, leaf, ("package",), f"a {source} source does not take package: it names the distribution to "
                "install from the index (source pypi)")
    if source in ("git", "pypi"):
        _refuse(v, leaf, ("url", "path", "sha256"), f"a {source} source does not take {{}} (that is for source: wheel)")
    if source == "pypi":
        _refuse(v, leaf, ("repo", "ref", "commit"), "a pypi source takes only version and install_deps")
        vllm = Vllm("pypi", version, None, None, Pin(None), install_deps, package=v.package or "vllm")
    elif source == "wheel":
        _refuse(v, leaf, ("repo", "ref", "commit"), "a wheel source takes url or path, sha256, version and "
                "install_deps (in a child of a git variant, set {} to null)")
        vllm = Vllm("wheel", version, None, None, Pin(None), install_deps, _wheel_file(v, version, leaf))
    elif source == "base":
        _refuse(v, leaf, ("repo", "ref", "commit", "url", "path", "sha256", "install_deps"), "a base source takes "
                "only version: the vLLM release the base image carries (in a child of another variant, set {} to null)")
        vllm = Vllm("base", version, None, None, Pin(None), False)
    return vllm


def _refuse(v: VllmSpec, leaf: Path, names: tuple[str, ...], why: str) -> None:
    """Refuse the first of the vllm: fields `names` that is set; `{}` in why is its name."""
    for fld in names:
        if getattr(v, fld) is not None:
            raise ConfigError(why.format(fld), path=leaf, field=f"vllm.{fld}")


def _components(entries: dict[str, ComponentSpec | None], leaf: Path) -> list[Component]:
    """The recipe's components, by name: each is pip (with version) or git (with ref, commit, dest)."""
    components = []
    for name, c in sorted(entries.items()):
        if c is None:
            continue
        fld = f"components.{name}"
        if c.pip and not c.git:
            if c.ref or c.commit or c.dest or c.pip_install is not None:
                raise ConfigError("a pip component takes only pip and version", path=leaf, field=fld)
            components.append(Component(name, "pip", c.pip, _pin(c.version, leaf, f"{fld}.version")))
        elif c.git and not c.pip:
            if c.version:
                raise ConfigError("a git component is pinned by ref and commit, not version", path=leaf,
                                  field=f"{fld}.version")
            components.append(Component(name, "git", repo=c.git, ref=_need(c.ref, leaf, f"{fld}.ref"),
                                        commit=_pin(c.commit, leaf, f"{fld}.commit"),
                                        dest=_need(c.dest, leaf, f"{fld}.dest"), pip_install=bool(c.pip_install)))
        else:
            raise ConfigError("a component is either pip (with version) or git (with ref, commit, dest)",
                              path=leaf, field=fld)
    return components


def _mods(data: RecipeFile, layout: Layout, leaf: Path, vllm: Vllm,
          components: list[Component]) -> tuple[list[Mod], dict[str, str]]:
    """The recipe's mods, checked against the plan, and the env they and the recipe set (no name set twice)."""
    mods = []
    env: dict[str, str] = {}
    owners: dict[tuple[str, str], str] = {}  # an env name or a drop-in dest -> the mod that has it: two mods may not share one
    assert not isinstance(data.mods, ModChanges), "merged: a parent's list with the changes made"
    for name in data.mods or []:
        mods.append(load_fitting_mod(layout.mods_dir, name, vllm, components, leaf))
        spec = mods[-1].spec
        claims = [("env", spec.env.name)] if spec.env else []
        for what, value in claims + [("files", f.dest) for f in spec.files]:
            if (what, value) in owners:
                other = owners[(what, value)]
                who = f"mod {name} writes {value} twice" if other == name else (
                    f"mods {other} and {name} both {'set the env name' if what == 'env' else 'write'} {value}")
                raise ConfigError(f"{who}; only one may, or the last would win silently", path=leaf, field="mods")
            owners[(what, value)] = name
        if spec.env:
            env[spec.env.name] = spec.env.default
    env.update((key, value) for key, value in (data.env or {}).items() if value is not None)
    return mods, env


def gpus_of(arch_list: str) -> tuple[str, ...]:
    """The compute capabilities a TORCH_CUDA_ARCH_LIST names: '12.0a;12.1a' -> ('12.0', '12.1')."""
    caps = (re.sub(r"[af]?(\+PTX)?\Z", "", arch) for arch in arch_list.split(";"))
    return tuple(dict.fromkeys(caps))


def _wheel_file(v: VllmSpec, version: str, leaf: Path) -> WheelFile:
    """The wheel of a `source: wheel` recipe; its file name must be a vLLM wheel of the recipe's version."""
    if (v.url is None) == (v.path is None):
        raise ConfigError("give the wheel as url (https) or as path (relative to the recipe's folder), one of them",
                          path=leaf, field="vllm.url")
    if v.sha256 is None:
        raise ConfigError("required field is missing: the wheel's sha256 (`sha256sum FILE` prints it)", path=leaf,
                          field="vllm.sha256")
    fld = "vllm.url" if v.url else "vllm.path"
    filename = urllib.parse.unquote(v.url.rsplit("/", 1)[1]) if v.url else (v.path or "").rsplit("/", 1)[-1]
    try:
        if not WHEEL_FILE_RE.fullmatch(filename):
            raise InvalidWheelFilename(filename)
        name, wheel_version, _, _ = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion):
        raise ConfigError(f"{filename!r} is not a wheel file name (NAME-VERSION-PY-ABI-PLATFORM.whl, of letters, "
                          "digits and '._+-')", path=leaf, field=fld) from None
    if name != "vllm":
        raise ConfigError(f"{filename} is a wheel of {name}, not of vllm", path=leaf, field=fld)
    if wheel_version != Version(version):
        raise ConfigError(f"{filename} is vllm {wheel_version}, but the recipe says version {version}", path=leaf,
                          field="vllm.version")
    local = None
    if v.path:
        local = leaf.parent / v.path
        if local.exists() and leaf.parent.resolve() not in local.resolve().parents:
            raise ConfigError(f"{v.path} leads outside {leaf.parent} (through a link); keep the wheel inside it",
                              path=leaf, field="vllm.path")
    return WheelFile(filename, v.sha256, v.url, v.path, str(local) if local else None)


def load_fitting_mod(mods_dir: Path, name: str, vllm: Vllm, components: Iterable[Component], leaf: Path) -> Mod:
    """Load mod `name`, refused unless the variant can take it (its component, phase and releases)."""
    spec, folder = load_mod(mods_dir, name, used_by=leaf)
    where = f"mods: {spec.name}"
    if spec.component not in {"vllm", "image"} | {c.name for c in components}:
        raise ConfigError(f"targets component {spec.component!r}, which this variant does not have",
                          path=leaf, field=where)
    if spec.phase == "source" and vllm.source == "wheel":
        raise ConfigError("is a source-phase mod, but this variant installs a prebuilt wheel, which has no source "
                          "tree to patch (use an install-phase mod, or build from git)", path=leaf, field=where)
    if spec.phase == "source" and (spec.component != "vllm" or vllm.source != "git"):
        raise ConfigError("is a source-phase mod, but this variant builds no vLLM source tree "
                          "(vllm.source is not git)", path=leaf, field=where)
    if spec.component in ("vllm", "image") and spec.targets.versions:
        wanted = SpecifierSet(spec.targets.versions)
        if not wanted.contains(Version(vllm.version), prereleases=True):
            raise ConfigError(f"targets vllm {spec.targets.versions}, but this variant pins vllm {vllm.version}",
                              path=leaf, field=where)
    return Mod(name, digest_tree(folder), str(folder), spec)


def plan_variant(layout: Layout, variant: str, *, base: str | None = None, platform: str | None = None) -> Plan:
    """Config and plan stages in one call: load the recipe chain and resolve it."""
    return resolve(load_variant(layout.images_dir, variant), layout, base=base, platform=platform)
