"""Plan stage: resolve a recipe and its mods into one frozen, printable Plan.

The Plan is everything the image will contain. It never touches Docker, and the same Plan
always gives the same immutable tag.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.parse
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .. import __version__
from ..errors import ConfigError
from ..imageref import ImageRef
from ..inimage.contract import SCHEMA
from .config import Recipe, load_mod, load_variant
from .schema import DIGEST_RE, MAX_REPOSITORY, REPOSITORY_RE, TAG_RE, ModSpec, Unknown

DEFAULT_IMAGE = "sparkforge/vllm"
# The file name of a recipe's wheel, after its URL is decoded: it names a cache file and reaches a Dockerfile line.
WHEEL_FILE_RE = re.compile(r"\A[A-Za-z0-9._+-]+\.whl\Z")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # sparkforge/
PROJECT_ROOT = PACKAGE_DIR.parent


@dataclass(frozen=True)
class Layout:
    """Where the project's inputs live."""

    images_dir: Path
    mods_dir: Path
    template: Path
    inimage: Path  # the image-side package folder, copied into every image
    gitfetch: Path

    def inimage_files(self) -> list[tuple[str, Path]]:
        """Every file of the image-side package, by its path relative to the folder, in sorted order
        (compiled bytecode left out: it is not source, and the image makes its own)."""
        found = []
        for parent, dirs, names in os.walk(self.inimage):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if not name.endswith((".pyc", ".pyo")):
                    path = Path(parent) / name
                    found.append((path.relative_to(self.inimage).as_posix(), path))
        return sorted(found)

    @classmethod
    def default(cls, root: Path = PROJECT_ROOT, images_dir: Path | None = None,
                mods_dir: Path | None = None) -> "Layout":
        return cls(
            images_dir=images_dir or root / "images",
            mods_dir=mods_dir or root / "mods",
            template=root / "Dockerfile.j2",
            inimage=PACKAGE_DIR / "inimage",
            gitfetch=PACKAGE_DIR / "gitfetch.py",
        )


@dataclass(frozen=True)
class Pin:
    """A pinned value, or the reason it is not known yet."""

    value: str | None
    unknown: str | None = None

    @classmethod
    def of(cls, raw: str | Unknown | None, missing: str) -> "Pin":
        if isinstance(raw, Unknown):
            return cls(None, raw.unknown)
        if raw is None:
            return cls(None, missing)
        return cls(raw)


@dataclass(frozen=True)
class BaseImage:
    repository: str
    tag: str
    digest: Pin

    @property
    def ref(self) -> str:
        return str(ImageRef(self.repository, self.tag, self.digest.value or None))


@dataclass(frozen=True)
class WheelFile:
    """A prebuilt wheel the recipe names: an https URL or a path relative to the recipe's folder."""

    filename: str
    sha256: str
    url: str | None = None
    path: str | None = None
    local: str | None = field(default=None, compare=False)  # path's place on this host; not part of the plan


@dataclass(frozen=True)
class PythonTarget:
    """The image's Python (3.12) and wheel platform (aarch64-manylinux_2_34), which `lock` resolves the
    wheel set for."""

    version: str
    platform: str


@dataclass(frozen=True)
class WheelPin:
    """One distribution of a locked wheel set: its version and every wheel of it pip may pick for the
    platform, by file name, sha256 and size in bytes."""

    name: str
    version: str
    files: tuple[tuple[str, str, int], ...]


@dataclass(frozen=True)
class Vllm:
    source: str  # "git": clone and compile; "pypi": install the release; "wheel": install a prebuilt wheel;
    # "base": keep the vLLM the base image carries
    version: str
    repo: str | None
    ref: str | None
    commit: Pin
    install_deps: bool
    wheel: WheelFile | None = None


@dataclass(frozen=True)
class Component:
    name: str
    kind: str  # "pip" or "git"
    package: str | None
    version: Pin
    repo: str | None
    ref: str | None
    commit: Pin
    dest: str | None
    pip_install: bool = False

    @property
    def requirement(self) -> str:
        """The pip requirement of a pip component: pinned, or bare when the version is unknown."""
        return f"{self.package}=={self.version.value}" if self.version.value else str(self.package)


@dataclass(frozen=True)
class BuildArgs:
    torch_cuda_arch_list: str
    max_jobs: int
    nvcc_threads: int
    # Environment of the compile step only (recipe `build.env`); never the image's ENV.
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Mod:
    name: str
    digest: str  # sha256 over the mod folder's files
    folder: str
    spec: ModSpec


@dataclass(frozen=True)
class Plan:
    variant: str
    chain: tuple[str, ...]
    recipe_files: tuple[str, ...]
    description: str
    image: str
    base: BaseImage
    os_packages: tuple[str, ...]
    vllm: Vllm
    components: tuple[Component, ...]
    protect: tuple[str, ...]
    build: BuildArgs
    env: tuple[tuple[str, str], ...]
    mods: tuple[Mod, ...]
    tooling_digest: str
    # Compute capabilities ("12.1") every CUDA extension in the image must hold code for.
    gpus: tuple[str, ...] = ()
    # Extensions no listed GPU needs (vLLM loads them only on others), with the recipe's reason.
    kernels_not_needed: tuple[tuple[str, str], ...] = ()
    # Distributions whose libraries the kernel check reads too (besides vLLM and the pip components).
    kernels_scan: tuple[str, ...] = ()
    tool_version: str = __version__
    # The recipe's `python:`; with it, `lock` resolves the wheel set below.
    python: PythonTarget | None = None
    # From a lock file: every wheel the runtime's pip install takes (vLLM, its dependencies and the pip
    # components), installed with hashes enforced. Empty when not locked.
    wheel_set: tuple[WheelPin, ...] = ()
    # From a lock file (sparkforge/recipe/lockfile.py): every installed package's version, as pip
    # constraints, and the SOURCE_DATE_EPOCH of the build. Empty and None when not locked.
    pins: tuple[tuple[str, str], ...] = ()
    source_date_epoch: int | None = None
    plan_hash: str = field(default="", compare=False)

    @property
    def tag(self) -> str:
        """The immutable tag: the same plan always gives the same tag."""
        return f"{self.image}:{self.variant}-{self.plan_hash[:12]}"

    @property
    def moving_tag(self) -> str:
        return f"{self.image}:{self.variant}"

    def mods_in(self, phase: str) -> tuple[Mod, ...]:
        return tuple(m for m in self.mods if m.spec.phase == phase)

    def unpinned(self) -> list[tuple[str, str]]:
        """Every value that is not pinned yet, with the reason the recipe gives."""
        out = []
        if self.base.digest.value is None:
            out.append(("base.digest", self.base.digest.unknown or ""))
        if self.vllm.source == "git" and self.vllm.commit.value is None:
            out.append(("vllm.commit", self.vllm.commit.unknown or ""))
        for c in self.components:
            if c.kind == "git" and c.commit.value is None:
                out.append((f"components.{c.name}.commit", c.commit.unknown or ""))
            if c.kind == "pip" and c.version.value is None:
                out.append((f"components.{c.name}.version", c.version.unknown or ""))
        if self.python is not None and not self.wheel_set:
            out.append(("wheels", f"the wheel set for {self.python.platform} is resolved by `python build.py lock "
                                  f"{self.variant}`; until then pip resolves the dependencies at build time"))
        return out

    def to_dict(self) -> dict[str, Any]:
        data = _jsonable(self)
        for mod in data["mods"]:
            mod.pop("folder")  # a host path: it would make renders depend on the checkout's place
        if data["vllm"]["wheel"]:
            data["vllm"]["wheel"].pop("local")
        data["schema"] = SCHEMA  # plan.json crosses into the image (sparkforge.inimage.contract)
        data["tag"] = self.tag
        data["moving_tag"] = self.moving_tag
        data["unpinned"] = [{"field": f, "reason": r} for f, r in self.unpinned()]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def identity(self) -> dict[str, Any]:
        """What decides the image's content, and so the tag (not the description)."""
        data = _jsonable(self)
        for key in ("plan_hash", "description", "recipe_files"):
            data.pop(key)
        if not data["kernels_scan"]:
            data.pop("kernels_scan")  # plans from before the field keep their tags
        for mod in data["mods"]:
            mod.pop("folder")
        if data["vllm"]["wheel"]:
            data["vllm"]["wheel"].pop("local")
        return data


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, ModSpec):
        return obj.model_dump(mode="json", exclude_defaults=True)
    if isinstance(obj, (tuple, list)):
        return [_jsonable(x) for x in obj]
    return obj


def digest_tree(folder: Path) -> str:
    """sha256 over the relative paths and bytes of every file below folder, in sorted order.

    The folder holds no links: config.load_mod refused any before the plan reads it.
    """
    h = hashlib.sha256()
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files += [Path(dirpath) / name for name in filenames]
    for path in sorted(files, key=lambda p: p.relative_to(folder).as_posix()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def digest_tooling(layout: Layout) -> str:
    """sha256 over the template, gitfetch and every file of the image-side package (its names too)."""
    h = hashlib.sha256()
    for name, path in [("Dockerfile.j2", layout.template), ("gitfetch.py", layout.gitfetch)] + [
            (f"inimage/{rel}", path) for rel, path in layout.inimage_files()]:
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def parse_image_ref(ref: str, source: str = "--base") -> BaseImage:
    """Parse REPOSITORY:TAG[@sha256:DIGEST], as given to --base (no tag: latest)."""
    parsed = ImageRef.parse(ref)
    repo, tag, digest = parsed.repository, "latest" if parsed.tag is None else parsed.tag, parsed.digest
    if (not REPOSITORY_RE.fullmatch(repo) or len(repo) > MAX_REPOSITORY or not TAG_RE.fullmatch(tag)
            or (digest is not None and not DIGEST_RE.fullmatch(digest))):
        raise ConfigError(f"{ref!r} is not an image reference REPOSITORY:TAG[@sha256:DIGEST]", field=source)
    pin = Pin(digest) if digest else Pin(None, f"base given as {ref} with {source}, without a digest")
    return BaseImage(repo, tag, pin)


def resolve(recipe: Recipe, layout: Layout, *, base: str | None = None) -> Plan:
    """Turn a merged recipe into a Plan, checking that it is complete and consistent."""
    data = recipe.data
    leaf = layout.images_dir / f"{recipe.variant}.yaml"

    def need(value: Any, fld: str) -> Any:
        if value is None:
            raise ConfigError("required field is missing (set it here or in a parent)", path=leaf, field=fld)
        return value

    b = need(data.base, "base")
    base_image = BaseImage(need(b.repository, "base.repository"), need(b.tag, "base.tag"),
                           Pin.of(need(b.digest, "base.digest"), ""))
    if base is not None:
        base_image = parse_image_ref(base)

    vllm = _vllm(need(data.vllm, "vllm"), leaf, need)
    components = _components(data.components or {}, leaf, need)

    bs = need(data.build, "build")
    build_env = {k: v for k, v in (getattr(bs, "env", None) or {}).items() if v is not None}
    build = BuildArgs(need(bs.torch_cuda_arch_list, "build.torch_cuda_arch_list"),
                      bs.max_jobs or 4, bs.nvcc_threads or 2, tuple(sorted(build_env.items())))

    mods, env = _mods(data, layout, leaf, vllm, components)
    python = _python(data.python, vllm, leaf)

    for name, reason in (data.kernels_not_needed or {}).items():
        if reason is None:
            raise ConfigError("a null reason only removes a parent's entry; give the reason why no listed GPU "
                              "needs it", path=layout.images_dir / f"{recipe.chain[-1]}.yaml",
                              field=f"kernels_not_needed.{name}")
    plan = Plan(
        variant=recipe.variant,
        chain=recipe.chain,
        recipe_files=recipe.files,
        description=(data.description or "").strip(),
        image=data.image or DEFAULT_IMAGE,
        base=base_image,
        os_packages=tuple(data.os_packages or ()),
        vllm=vllm,
        components=tuple(components),
        protect=tuple(data.protect or ()),
        build=build,
        env=tuple(sorted(env.items())),
        mods=tuple(mods),
        tooling_digest=digest_tooling(layout),
        gpus=tuple(data.gpus) if data.gpus is not None else gpus_of(build.torch_cuda_arch_list),
        kernels_not_needed=tuple(sorted((data.kernels_not_needed or {}).items())),
        kernels_scan=tuple(data.kernels_scan or ()),
        python=python,
    )
    return rehash(plan)


def _python(spec: Any, vllm: Vllm, leaf: Path) -> PythonTarget | None:
    """The recipe's `python:`: both fields, and only where pip resolves what the image installs (source pypi)."""
    if spec is None:
        return None
    if vllm.source != "pypi":
        raise ConfigError(f"a wheel set is resolved for a pypi source only (this variant's vllm.source is "
                          f"{vllm.source})", path=leaf, field="python")
    for fld in ("version", "platform"):
        if getattr(spec, fld) is None:
            raise ConfigError("required field is missing (set it here or in a parent)", path=leaf,
                              field=f"python.{fld}")
    return PythonTarget(spec.version, spec.platform)


def _vllm(v: Any, leaf: Path, need: Callable[[Any, str], Any]) -> Vllm:
    """The recipe's vllm: section as a Vllm, each source with only the fields it takes."""
    source = need(v.source, "vllm.source")
    version = need(v.version, "vllm.version")
    if source == "git":
        vllm = Vllm("git", version, need(v.repo, "vllm.repo"), need(v.ref, "vllm.ref"),
                    Pin.of(need(v.commit, "vllm.commit"), ""), bool(v.install_deps))
    if source in ("git", "pypi"):
        for fld in ("url", "path", "sha256"):
            if getattr(v, fld) is not None:
                raise ConfigError(f"a {source} source does not take {fld} (that is for source: wheel)", path=leaf,
                                  field=f"vllm.{fld}")
    if source == "pypi":
        for fld in ("repo", "ref", "commit"):
            if getattr(v, fld) is not None:
                raise ConfigError("a pypi source takes only version and install_deps", path=leaf,
                                  field=f"vllm.{fld}")
        vllm = Vllm("pypi", version, None, None, Pin(None), True if v.install_deps is None else v.install_deps)
    elif source == "wheel":
        vllm = Vllm("wheel", version, None, None, Pin(None), True if v.install_deps is None else v.install_deps,
                    _wheel_file(v, version, leaf))
    elif source == "base":
        for fld in ("repo", "ref", "commit", "url", "path", "sha256", "install_deps"):
            if getattr(v, fld) is not None:
                raise ConfigError("a base source takes only version: the vLLM release the base image carries (in a "
                                  f"child of another variant, set {fld} to null)", path=leaf, field=f"vllm.{fld}")
        vllm = Vllm("base", version, None, None, Pin(None), False)
    return vllm


def _components(entries: dict[str, Any], leaf: Path, need: Callable[[Any, str], Any]) -> list[Component]:
    """The recipe's components, by name: each is pip (with version) or git (with ref, commit, dest)."""
    components = []
    for name, c in sorted(entries.items()):
        if c is None:
            continue
        fld = f"components.{name}"
        if c.pip and not c.git:
            if c.ref or c.commit or c.dest or c.pip_install is not None:
                raise ConfigError("a pip component takes only pip and version", path=leaf, field=fld)
            components.append(Component(name, "pip", c.pip, Pin.of(need(c.version, f"{fld}.version"), ""),
                                        None, None, Pin(None), None))
        elif c.git and not c.pip:
            if c.version:
                raise ConfigError("a git component is pinned by ref and commit, not version", path=leaf,
                                  field=f"{fld}.version")
            components.append(Component(name, "git", None, Pin(None), c.git, need(c.ref, f"{fld}.ref"),
                                        Pin.of(need(c.commit, f"{fld}.commit"), ""),
                                        need(c.dest, f"{fld}.dest"), bool(c.pip_install)))
        else:
            raise ConfigError("a component is either pip (with version) or git (with ref, commit, dest)",
                              path=leaf, field=fld)
    return components


def _mods(data: Any, layout: Layout, leaf: Path, vllm: Vllm,
          components: list[Component]) -> tuple[list[Mod], dict[str, str]]:
    """The recipe's mods, loaded and checked against the plan, and the env they and the recipe set; no env
    name or drop-in file may belong to two mods."""
    known_components = {"vllm", "image"} | {c.name for c in components}
    mods = []
    env: dict[str, str] = {}
    owners: dict[tuple[str, str], str] = {}  # an env name or a drop-in dest -> the mod that has it: two mods may not share one
    for name in data.mods or []:
        spec, folder = load_mod(layout.mods_dir, name, used_by=leaf)
        check_mod_fits(spec, folder, vllm, known_components, leaf)
        mods.append(Mod(name, digest_tree(folder), str(folder), spec))
        for what, value in [("env", spec.env.name if spec.env else None)] + [("files", f.dest) for f in spec.files]:
            if value is None:
                continue
            if (what, value) in owners:
                other = owners[(what, value)]
                who = f"mod {name} writes {value} twice" if other == name else (
                    f"mods {other} and {name} both {'set the env name' if what == 'env' else 'write'} {value}")
                raise ConfigError(f"{who}; only one may, or the last would win silently", path=leaf, field="mods")
            owners[(what, value)] = name
        if spec.env:
            env[spec.env.name] = spec.env.default
    for key, value in (data.env or {}).items():
        if value is not None:
            env[key] = value
    return mods, env


def gpus_of(arch_list: str) -> tuple[str, ...]:
    """The compute capabilities a TORCH_CUDA_ARCH_LIST names: '12.0a;12.1a' -> ('12.0', '12.1')."""
    caps = (re.sub(r"[af]?(\+PTX)?\Z", "", arch) for arch in arch_list.split(";"))
    return tuple(dict.fromkeys(caps))


def rehash(plan: Plan) -> Plan:
    """The plan with its hash (and so its tag) computed from its identity; call it after
    changing a plan with dataclasses.replace."""
    canonical = json.dumps(plan.identity(), sort_keys=True, separators=(",", ":"))
    return _with_hash(plan, hashlib.sha256(canonical.encode()).hexdigest())


def _with_hash(plan: Plan, plan_hash: str) -> Plan:
    values = {f.name: getattr(plan, f.name) for f in fields(plan)} | {"plan_hash": plan_hash}
    return Plan(**values)


def _wheel_file(v: Any, version: str, leaf: Path) -> WheelFile:
    """The wheel of a `source: wheel` recipe; its file name must be a vLLM wheel of the recipe's version."""
    for fld in ("repo", "ref", "commit"):
        if getattr(v, fld) is not None:
            raise ConfigError("a wheel source takes url or path, sha256, version and install_deps (in a child of a "
                              f"git variant, set {fld} to null)", path=leaf, field=f"vllm.{fld}")
    if (v.url is None) == (v.path is None):
        raise ConfigError("give the wheel as url (https) or as path (relative to the recipe's folder), one of them",
                          path=leaf, field="vllm.url")
    if v.sha256 is None:
        raise ConfigError("required field is missing: the wheel's sha256 (`sha256sum FILE` prints it)", path=leaf,
                          field="vllm.sha256")
    fld = "vllm.url" if v.url else "vllm.path"
    filename = urllib.parse.unquote(v.url.rsplit("/", 1)[1]) if v.url else v.path.rsplit("/", 1)[-1]
    try:
        if not WHEEL_FILE_RE.fullmatch(filename):
            raise InvalidWheelFilename(filename)
        name, wheel_version, _, _ = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion):
        raise ConfigError(f"{filename!r} is not a wheel file name (NAME-VERSION-PY-ABI-PLATFORM.whl, of letters, "
                          "digits and '._+-')", path=leaf,
                          field=fld) from None
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


def check_mod_fits(spec: ModSpec, folder: Path, vllm: Vllm, components: set[str], leaf: Path) -> None:
    """Refuse a mod the variant cannot take: another component, a source phase without a source, other releases."""
    where = f"mods: {spec.name}"
    if spec.component not in components:
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


def plan_variant(layout: Layout, variant: str, *, base: str | None = None) -> Plan:
    """Config and plan stages in one call: load the recipe chain and resolve it."""
    return resolve(load_variant(layout.images_dir, variant), layout, base=base)

