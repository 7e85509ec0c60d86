"""The shape of a recipe (images/*.yaml) and of a mod (mods/*/mod.yaml): field types and models.

Every value that can later reach a shell line is checked here against a strict pattern, so a recipe
cannot inject shell. config reads the files into these models.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal, Union

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Patterns for every value that is rendered into the Dockerfile. Each is anchored with \A and \Z
# (never ^ and $: `$` also matches before a final newline) and is used with fullmatch, so a
# value such as "12.1a\n" is refused instead of reaching a Dockerfile line.

# A TCP port: 1 to 65535, without leading zeros (one port, one spelling).
PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
# A host name (RFC 1123: labels of letters, digits and inner hyphens, 1 to 63 long), which also spells an
# IPv4 address; host_problem says the rest (the whole name's length, an address's one spelling).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST = rf"{_LABEL}(?:\.{_LABEL})*"
MAX_HOST = 253  # RFC 1035: a name of 255 octets on the wire, 253 characters as text

NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9-]*\Z")
COMMIT_RE = re.compile(r"\A[0-9a-f]{40}\Z")
DIGEST_RE = re.compile(r"\Asha256:[0-9a-f]{64}\Z")
REF_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._/-]*\Z")
URL_RE = re.compile(rf"\Ahttps://(?P<host>{HOST})(:{PORT})?(/[A-Za-z0-9._~-]+)+/?\Z")
# A file to download: https, and a path that may hold a percent-encoded character or a '+'
# (wheel names of local versions). It never reaches a shell line; the host fetches it.
FILE_URL_RE = re.compile(rf"\Ahttps://(?P<host>{HOST})(:{PORT})?(/[A-Za-z0-9._~%+-]+)+\Z")
# A registry (a host with a port, or a name with a dot) may come first, as Docker reads a reference.
REPOSITORY_RE = re.compile(rf"\A[a-z0-9]+([._-][a-z0-9]+)*(:{PORT})?(/[a-z0-9]+([._-][a-z0-9]+)*)*\Z")
TAG_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
PKG_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\Z")
ENV_NAME_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
ENV_VALUE_RE = re.compile(r"\A[A-Za-z0-9_.,:;/=+@%-]*\Z")
# A compute capability, as `nvidia-smi --query-gpu=compute_cap` prints it: 12.1 for a GB10. CUDA
# numbers a GPU's architecture major.minor with a single-digit minor (sm_121 is 12.1; sm_1210 is none).
GPU_RE = re.compile(r"\A[1-9][0-9]?\.[0-9]\Z")
# A CUDA extension by its file name up to the first dot: _vllm_fa3_C for _vllm_fa3_C.abi3.so.
EXTENSION_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_-]{0,99}\Z")
# TORCH_CUDA_ARCH_LIST: capabilities as above, each arch-specific (a) or family (f), and +PTX.
_ARCH = r"[1-9][0-9]?\.[0-9][af]?(\+PTX)?"
ARCH_LIST_RE = re.compile(rf"\A{_ARCH}(;{_ARCH})*\Z")
ABS_PATH_RE = re.compile(r"\A(/[A-Za-z0-9._-]+)+\Z")
REL_PATH_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)*\Z")
DIST_RE = re.compile(r"\A[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\Z")  # PEP 508 name, no extras
OS_PKG_RE = re.compile(r"\A[a-z0-9][a-z0-9.+-]*(=[A-Za-z0-9.+:~-]+)?\Z")
PEP440_CHARS_RE = re.compile(r"\A[A-Za-z0-9.+!_-]+\Z")
MODE_RE = re.compile(r"\A0[0-7]{3}\Z")
# A patch named by URL: https only, an optional query (GitHub's `?full_index=1`), no fragment.
PATCH_URL_RE = re.compile(rf"\Ahttps://(?P<host>{HOST})(:{PORT})?(/[A-Za-z0-9._~%+-]+)+/?(\?[A-Za-z0-9._~%=&+-]+)?\Z")
# A GitHub pull request: OWNER/REPO#NUMBER.
PR_RE = re.compile(r"\A(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]{0,38}))/(?P<repo>[A-Za-z0-9_.-]{1,100})#(?P<number>[1-9][0-9]{0,9})\Z")
SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")
# The Python of an image, as MAJOR.MINOR, and the platform its wheels are for: uv's --python-platform of a
# glibc target, e.g. aarch64-manylinux_2_34 (a GB10's Linux on a base with glibc 2.34 or newer).
PYTHON_VERSION_RE = re.compile(r"\A3\.[0-9]{1,2}\Z")
WHEEL_PLATFORM_RE = re.compile(r"\A(aarch64|x86_64)-manylinux_2_[0-9]{2}\Z")
# A Python module a verify check imports: dotted identifiers.
MODULE_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def host_problem(host: str) -> str | None:
    """Why a host name that matches HOST cannot be one, or None. A name of digits and dots is an IPv4
    address only in its one spelling: the C library would read `010.0.0.1` as 8.0.0.1, `1.2.3` as 1.2.0.3."""
    if len(host) > MAX_HOST:
        return f"its host name is {len(host)} characters long; DNS allows {MAX_HOST}"
    if all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address (four numbers 0-255 without leading zeros)"
    return None


# Docker refuses a tag over 128 characters and a repository over 255. The immutable tag is
# "<variant>-<12 hex>", so a variant name may use 128 - 13 of them.
MAX_TAG = 128
MAX_REPOSITORY = 255
MAX_VARIANT = MAX_TAG - 13


def matching(pattern: re.Pattern[str], what: str, max_len: int | None = None) -> Any:
    """A str type whose values must match pattern in full; the error says what was expected. A pattern's
    group `host` must also be a host name that can be one (host_problem)."""

    def check(value: str) -> str:
        m = pattern.fullmatch(value)
        if not m:
            raise ValueError(f"{value!r} is not a valid {what}")
        if max_len is not None and len(value) > max_len:
            raise ValueError(f"{value[:40]!r}... is {len(value)} characters long; Docker allows at most {max_len} "
                             f"for this {what}")
        problem = host_problem(m["host"]) if "host" in m.groupdict() else None
        if problem:
            raise ValueError(f"{value[:80]!r} is not a valid {what}: {problem}")
        return value

    return Annotated[str, AfterValidator(check)]


def _segments_ok(value: str) -> bool:
    """No `.` or `..` segment: a path stays where it is named, and reads the same everywhere."""
    return all(seg not in (".", "..") for seg in value.split("/"))


def _path(pattern: re.Pattern[str], what: str):
    """A path type: matched in full, with no empty, `.` or `..` segment."""

    def check(value: str) -> str:
        if not pattern.fullmatch(value) or not _segments_ok(value):
            raise ValueError(f"{value!r} is not a valid {what} (letters, digits, '._-' and '/' between "
                             f"segments; no empty, '.' or '..' segment)")
        return value

    return Annotated[str, AfterValidator(check)]


def check_path(value: str) -> str:
    """An absolute path, or one relative to a component's root; either never leaves via `..`."""
    if not ((ABS_PATH_RE.fullmatch(value) or REL_PATH_RE.fullmatch(value)) and _segments_ok(value)):
        raise ValueError(f"{value!r} is not a valid path (absolute, or relative to the component; no empty, "
                         f"'.' or '..' segment)")
    return value


def _pep440(value: str) -> str:
    try:
        Version(value)
    except InvalidVersion:
        raise ValueError(f"{value!r} is not a valid PEP 440 version") from None
    if not PEP440_CHARS_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid PEP 440 version")
    return value


def specifier_error(value: str) -> str | None:
    """Why value is not a PEP 440 specifier set, or None when it is one."""
    # packaging strips surrounding whitespace; a newline or tab in a range is still a typo.
    try:
        if value.isprintable():
            SpecifierSet(value)
            return None
    except InvalidSpecifier:
        pass
    return f"{value!r} is not a PEP 440 specifier set such as '>=0.16,<0.18'"


def _specifier(value: str) -> str:
    problem = specifier_error(value)
    if problem:
        raise ValueError(problem)
    return value


def _nonblank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


Name = matching(NAME_RE, "name (lowercase letters, digits and '-')")
Commit = matching(COMMIT_RE, "full commit: write 40 lowercase hex digits (put a short SHA in ref)")
Digest = matching(DIGEST_RE, "digest: write sha256:<64 hex>")
GitRef = matching(REF_RE, "git ref")
GitUrl = matching(URL_RE, "https git URL")
FileUrl = matching(FILE_URL_RE, "https URL of a file")
Repository = matching(REPOSITORY_RE, "image repository", MAX_REPOSITORY)
ImageTag = matching(TAG_RE, "image tag")
Package = matching(PKG_RE, "pip package name")
Distribution = matching(DIST_RE, "installed distribution name such as torch (no extras)")
EnvName = matching(ENV_NAME_RE, "environment variable name")
EnvValue = matching(ENV_VALUE_RE, "environment value (allowed: A-Z a-z 0-9 _ . , : ; / = + @ % -)")
ArchList = matching(ARCH_LIST_RE, "TORCH_CUDA_ARCH_LIST such as '12.0a;12.1a'")
Gpu = matching(GPU_RE, "compute capability such as '12.1'")
Extension = matching(EXTENSION_RE, "extension name such as _vllm_fa3_C (its file name up to the first dot)")
AbsPath = _path(ABS_PATH_RE, "absolute path")
RelPath = _path(REL_PATH_RE, "relative path")
ModPath = Annotated[str, AfterValidator(check_path)]
OsPackage = matching(OS_PKG_RE, "Debian package name")
PipVersion = Annotated[str, AfterValidator(_pep440)]
Specifier = Annotated[str, AfterValidator(_specifier)]
Text = Annotated[str, AfterValidator(_nonblank)]
Count = Annotated[int, Field(ge=1, le=256)]
PatchUrl = matching(PATCH_URL_RE, "https URL of a patch")
Sha256 = matching(SHA256_RE, "sha256: write the 64 lowercase hex digits (sha256sum FILE)")
Module = matching(MODULE_RE, "Python module name such as torch or vllm.platforms")
PythonVersion = matching(PYTHON_VERSION_RE, "Python version such as '3.12'")
WheelPlatform = matching(WHEEL_PLATFORM_RE, "wheel platform such as 'aarch64-manylinux_2_34' (ARCH-manylinux_2_GLIBC)")


def _pull_request(value: str) -> str:
    m = PR_RE.fullmatch(value)
    if not m or m["repo"] in (".", ".."):
        raise ValueError(f"{value!r} is not a pull request: write OWNER/REPO#NUMBER, e.g. vllm-project/vllm#12345")
    return value


PullRequest = Annotated[str, AfterValidator(_pull_request)]


class Strict(BaseModel):
    """Base of every schema: unknown keys are errors, values are never coerced across types."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Unknown(Strict):
    """A fact that is not known yet; the recipe says why instead of inventing a value."""

    unknown: Text


class BaseSpec(Strict):
    repository: Repository | None = None
    tag: ImageTag | None = None
    digest: Union[Digest, Unknown, None] = None


class VllmSpec(Strict):
    """git: clone a commit and compile it; pypi: install the release; wheel: install a prebuilt
    wheel named by url (https) or path (relative to the recipe's folder), pinned by sha256; base: keep
    the vLLM the base image carries (version: the release it is)."""

    source: Literal["git", "pypi", "wheel", "base"] | None = None
    repo: GitUrl | None = None
    ref: GitRef | None = None
    commit: Union[Commit, Unknown, None] = None
    url: FileUrl | None = None
    path: RelPath | None = None
    sha256: Sha256 | None = None
    version: PipVersion | None = None
    install_deps: bool | None = None


class ComponentSpec(Strict):
    """A pip package pinned to a version, or a git tree pinned to a ref and commit."""

    pip: Package | None = None
    version: Union[PipVersion, Unknown, None] = None
    git: GitUrl | None = None
    ref: GitRef | None = None
    commit: Union[Commit, Unknown, None] = None
    dest: AbsPath | None = None
    pip_install: bool | None = None  # git only: also `pip install` the tree after it is in place


class PythonSpec(Strict):
    """The image's Python and wheel platform, for which `lock` resolves the wheel set."""

    version: PythonVersion | None = None
    platform: WheelPlatform | None = None


class BuildSpec(Strict):
    torch_cuda_arch_list: ArchList | None = None
    max_jobs: Count | None = None
    nvcc_threads: Count | None = None
    # Environment of the compile step only, e.g. VLLM_TARGET_DEVICE; never the image's ENV.
    env: dict[EnvName, Union[EnvValue, None]] | None = None


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
    components: dict[Name, Union[ComponentSpec, None]] | None = None
    protect: list[Package] | None = None
    # The image's Python and platform: `lock` resolves vLLM and the pip components for them into one wheel
    # set, every wheel pinned by version and sha256, which `build --locked` installs with hashes enforced.
    python: PythonSpec | None = None
    build: BuildSpec | None = None
    # The GPUs (compute capabilities) the image is for; every CUDA extension must hold code they run.
    # `[]`: an image without CUDA kernels on purpose (no kernel check).
    gpus: list[Gpu] | None = None
    # Extensions that vLLM loads only on other GPUs than those, each with the reason.
    kernels_not_needed: dict[Extension, Union[Text, None]] | None = None
    # Installed distributions whose libraries the kernel check reads besides vLLM's and the pip
    # components' (torch, nvidia-nccl-cu13, ...).
    kernels_scan: list[Distribution] | None = None
    env: dict[EnvName, Union[EnvValue, None]] | None = None
    mods: Union[list[Name], ModChanges, None] = None

    @field_validator("gpus")
    @classmethod
    def _gpus_once(cls, v: Any) -> Any:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("a GPU is listed twice")
        return v

    @field_validator("kernels_scan")
    @classmethod
    def _scan_once(cls, v: Any) -> Any:
        if v is not None and len({name.lower().replace("_", "-") for name in v}) != len(v):
            raise ValueError("a distribution is listed twice")
        return v

    @field_validator("protect", "os_packages")
    @classmethod
    def _packages_once(cls, v: Any, info: ValidationInfo) -> Any:
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
    def _unique(cls, v: Any) -> Any:
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
    def _one_kind(self) -> "ModVerify":
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
    def _one_source(self) -> "RemotePatch":
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
    patch: Union[RelPath, RemotePatch, None] = None  # a file of the folder, or {url|pr, sha256}
    patcher: RelPath | None = None
    files: list[ModFile] = []
    env: ModEnv | None = None
    verify: list[ModVerify]

    @model_validator(mode="after")
    def _kind_fields(self) -> "ModSpec":
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
