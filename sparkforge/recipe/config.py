"""Config stage: read recipes (images/*.yaml) and mods (mods/*/mod.yaml) into validated data.

This is the only module that reads YAML. Every value that can later reach a shell line is
checked here against a strict pattern, so a recipe cannot inject shell.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .. import inimage
from ..errors import ConfigError
from ..files import read_regular

# Patterns for every value that is rendered into the Dockerfile. Each is anchored with \A and \Z
# (never ^ and $: `$` also matches before a final newline) and is used with fullmatch, so a
# value such as "12.1a\n" is refused instead of reaching a Dockerfile line.
NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9-]*\Z")
COMMIT_RE = re.compile(r"\A[0-9a-f]{40}\Z")
DIGEST_RE = re.compile(r"\Asha256:[0-9a-f]{64}\Z")
REF_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._/-]*\Z")
URL_RE = re.compile(r"\Ahttps://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~-]+)+/?\Z")
# A file to download: https, and a path that may hold a percent-encoded character or a '+'
# (wheel names of local versions). It never reaches a shell line; the host fetches it.
FILE_URL_RE = re.compile(r"\Ahttps://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~%+-]+)+\Z")
REPOSITORY_RE = re.compile(r"\A[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*\Z")
TAG_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
PKG_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\Z")
ENV_NAME_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
ENV_VALUE_RE = re.compile(r"\A[A-Za-z0-9_.,:;/=+@%-]*\Z")
# A compute capability, as `nvidia-smi --query-gpu=compute_cap` prints it: 12.1 for a GB10.
GPU_RE = re.compile(r"\A[0-9]+\.[0-9]\Z")
# A CUDA extension by its file name up to the first dot: _vllm_fa3_C for _vllm_fa3_C.abi3.so.
EXTENSION_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_-]{0,99}\Z")
ARCH_LIST_RE = re.compile(r"\A[0-9]+\.[0-9]+[af]?(\+PTX)?(;[0-9]+\.[0-9]+[af]?(\+PTX)?)*\Z")
ABS_PATH_RE = re.compile(r"\A(/[A-Za-z0-9._-]+)+\Z")
REL_PATH_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)*\Z")
OS_PKG_RE = re.compile(r"\A[a-z0-9][a-z0-9.+-]*(=[A-Za-z0-9.+:~-]+)?\Z")
PEP440_CHARS_RE = re.compile(r"\A[A-Za-z0-9.+!_-]+\Z")
MODE_RE = re.compile(r"\A0[0-7]{3}\Z")
# A patch named by URL: https only, an optional query (GitHub's `?full_index=1`), no fragment.
PATCH_URL_RE = re.compile(r"\Ahttps://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~%+-]+)+/?(\?[A-Za-z0-9._~%=&+-]+)?\Z")
# A GitHub pull request: OWNER/REPO#NUMBER.
PR_RE = re.compile(r"\A(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]{0,38}))/(?P<repo>[A-Za-z0-9_.-]{1,100})#(?P<number>[1-9][0-9]{0,9})\Z")
SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")

# Docker refuses a tag over 128 characters and a repository over 255. The immutable tag is
# "<variant>-<12 hex>", so a variant name may use 128 - 13 of them.
MAX_TAG = 128
MAX_REPOSITORY = 255
MAX_VARIANT = MAX_TAG - 13


def _matching(pattern: re.Pattern[str], what: str, max_len: int | None = None):
    """A str type whose values must match pattern in full; the error says what was expected."""

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid {what}")
        if max_len is not None and len(value) > max_len:
            raise ValueError(f"{value[:40]!r}... is {len(value)} characters long; Docker allows at most {max_len} "
                             f"for this {what}")
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


Name = _matching(NAME_RE, "name (lowercase letters, digits and '-')")
Commit = _matching(COMMIT_RE, "full commit: write 40 lowercase hex digits (put a short SHA in ref)")
Digest = _matching(DIGEST_RE, "digest: write sha256:<64 hex>")
GitRef = _matching(REF_RE, "git ref")
GitUrl = _matching(URL_RE, "https git URL")
FileUrl = _matching(FILE_URL_RE, "https URL of a file")
Repository = _matching(REPOSITORY_RE, "image repository", MAX_REPOSITORY)
ImageTag = _matching(TAG_RE, "image tag")
Package = _matching(PKG_RE, "pip package name")
EnvName = _matching(ENV_NAME_RE, "environment variable name")
EnvValue = _matching(ENV_VALUE_RE, "environment value (allowed: A-Z a-z 0-9 _ . , : ; / = + @ % -)")
ArchList = _matching(ARCH_LIST_RE, "TORCH_CUDA_ARCH_LIST such as '12.0a;12.1a'")
Gpu = _matching(GPU_RE, "compute capability such as '12.1'")
Extension = _matching(EXTENSION_RE, "extension name such as _vllm_fa3_C (its file name up to the first dot)")
AbsPath = _path(ABS_PATH_RE, "absolute path")
RelPath = _path(REL_PATH_RE, "relative path")
ModPath = Annotated[str, AfterValidator(check_path)]
OsPackage = _matching(OS_PKG_RE, "Debian package name")
PipVersion = Annotated[str, AfterValidator(_pep440)]
Specifier = Annotated[str, AfterValidator(_specifier)]
Text = Annotated[str, AfterValidator(_nonblank)]
Count = Annotated[int, Field(ge=1, le=256)]
PatchUrl = _matching(PATCH_URL_RE, "https URL of a patch")
Sha256 = _matching(SHA256_RE, "sha256: write the 64 lowercase hex digits (sha256sum FILE)")


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
    wheel named by url (https) or path (relative to the recipe's folder), pinned by sha256."""

    source: Literal["git", "pypi", "wheel"] | None = None
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
    build: BuildSpec | None = None
    # The GPUs (compute capabilities) the image is for; every CUDA extension must hold code they run.
    # `[]`: an image without CUDA kernels on purpose (no kernel check).
    gpus: list[Gpu] | None = None
    # Extensions that vLLM loads only on other GPUs than those, each with the reason.
    kernels_not_needed: dict[Extension, Union[Text, None]] | None = None
    env: dict[EnvName, Union[EnvValue, None]] | None = None
    mods: Union[list[Name], ModChanges, None] = None

    @field_validator("gpus")
    @classmethod
    def _gpus_once(cls, v: Any) -> Any:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("a GPU is listed twice")
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
    contains: str | None = None
    python: str | None = None
    needs: list[str] = []

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


# ---------------------------------------------------------------- loading

# The file name a patch fetched by URL takes beside the mod's own files (remote.materialize).
REMOTE_PATCH_FILE = "upstream.diff"


# libyaml's loader when PyYAML was built with it: the same safe subset, parsed several times faster.
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_DEPTH = 64  # nested mappings and lists; a recipe needs 5. Deeper input would crash the parser's recursion.


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        self.key, self.first, self.second = key, first, second


class _Loader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a key written twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key; SafeConstructor refuses it with its own message
                    continue
        return super().construct_mapping(node, deep=deep)


def read_text(path: Path, missing: str = "file not found") -> str:
    """A file's text; a missing, unreadable, non-regular (a FIFO) or non-UTF-8 file is one line naming it."""
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        raise ConfigError(missing, path=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", path=path) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}; save the file as UTF-8",
                          path=path) from None


def read_yaml(path: Path) -> Any:
    """Parse one YAML file, turning parse errors into one line that names the file and line.

    Refused as well: a key written twice in one mapping (naming both lines), and nesting deeper than
    MAX_DEPTH, checked on the parser's events before anything is built from them."""
    text = read_text(path)
    try:
        _check_depth(text, path)
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as exc:
        raise ConfigError(f"key {exc.key!r} is written twice, on lines {exc.first} and {exc.second}; keep one",
                          path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"malformed YAML: {where}{problem}", path=path) from None


def _check_depth(text: str, path: Path) -> None:
    loader = _BASE_LOADER(text)
    depth = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (line {line}); a recipe, mod or "
                                      "cluster file needs a handful", path=path)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    finally:
        loader.dispose()


_NO_DATA = object()


def field_path(loc: tuple[Any, ...], data: Any = _NO_DATA) -> str:
    """A pydantic error location in the user's terms: `mods[0]`, `components.cutlass.ref`."""
    # pydantic puts the union branch it tried (`list[function-after[check(), str]]`, `none`, ...)
    # into the location. Walking the input alongside keeps only the keys and indexes the user
    # wrote; without the input, the parts that name a branch are dropped.
    out = ""
    node = data
    for part in loc:
        if data is not _NO_DATA and isinstance(node, dict) and part in node:
            node = node[part]
        elif data is not _NO_DATA and isinstance(node, list) and isinstance(part, int):
            node = node[part] if 0 <= part < len(node) else None
        elif _is_branch(part) or (data is not _NO_DATA and not isinstance(node, dict)):
            continue
        else:
            node = None  # a key the user did not write: a missing field
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_branch(part: Any) -> bool:
    """A location part that names a type pydantic tried, not a key the user wrote."""
    return isinstance(part, str) and (part in _UNION_BRANCHES or any(c in part for c in "[](),' "))


# The union members of the schemas below, as pydantic names them in a location.
_UNION_BRANCHES = {"str", "int", "bool", "float", "none", "Unknown", "ModChanges", "ComponentSpec", "RemotePatch"}


def validation_error(exc: ValidationError, path: Path, data: Any = _NO_DATA) -> ConfigError:
    """One ConfigError for a pydantic error: the field in the user's terms and what is wrong."""
    errors = exc.errors()
    # Of the branches of a union, report the one the user meant: a value error over a type mismatch.
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    loc = field_path(tuple(err["loc"]), data)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif err["type"] == "string_type":
        msg = f"expected a string, got {type(err['input']).__name__} (quote numbers in YAML)"
    elif err["type"].endswith("_type"):
        msg = f"{msg}, got {type(err['input']).__name__}"
    return ConfigError(msg, path=path, field=loc or None)


def load_recipe_file(path: Path) -> RecipeFile:
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("a recipe must be a YAML mapping", path=path)
    try:
        return RecipeFile.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path, data) from None


def load_mod(mods_dir: Path, name: str, *, used_by: Path | None = None) -> tuple[ModSpec, Path]:
    """Load mods/<name>/mod.yaml and check that every asset it names exists."""
    folder = mods_dir / name
    meta = folder / "mod.yaml"
    try:
        meta.stat()
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            exc.strerror = None
        why = f": {exc.strerror}" if exc.strerror else ""
        raise ConfigError(f"unknown mod {_clip(name)!r}: {_clip(str(meta))} does not exist{why}", path=used_by or meta,
                          field="mods") from None
    if not meta.is_file():
        raise ConfigError(f"unknown mod {name!r}: {meta} does not exist", path=used_by or meta, field="mods")
    data = read_yaml(meta)
    if not isinstance(data, dict):
        raise ConfigError("mod.yaml must be a YAML mapping", path=meta)
    try:
        spec = ModSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, meta, data) from None
    if spec.name != name:
        raise ConfigError(f"name {spec.name!r} differs from the folder name {name!r}", path=meta, field="name")
    local_patch = spec.patch if isinstance(spec.patch, str) else None
    assets = [("patch", local_patch), ("patcher", spec.patcher)] + [("files", f.src) for f in spec.files]
    for field, rel in assets:
        if rel is not None and not (folder / rel).is_file():
            raise ConfigError(f"{rel!r} is not a file in {folder}", path=meta, field=field)
    static = spec.model_dump(mode="json")
    if isinstance(spec.patch, RemotePatch):
        # The patch is checked when it is fetched (remote.materialize); here only the folder is.
        static.pop("patch")
        if (folder / REMOTE_PATCH_FILE).exists():
            raise ConfigError(f"{REMOTE_PATCH_FILE} is the name the fetched patch takes in the build; rename "
                              f"this mod's own file", path=folder / REMOTE_PATCH_FILE, field="patch")
    try:  # a patch or patcher naming a path outside its tree is bad input, refused before any build
        inimage.check_static(static, folder)
    except inimage.ModFailure as exc:
        raise ConfigError(str(exc), path=meta, field=spec.kind) from None
    return spec, folder


def _clip(text: str, most: int = 120) -> str:
    """A name as given, cut in the middle when it is far too long to be one."""
    return text if len(text) <= most else f"{text[:most - 40]}...{text[-30:]}"


class _ModDumper(yaml.SafeDumper):
    """Writes a text of several lines as a literal block, as mods are written by hand."""


_ModDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def mod_yaml_text(data: dict[str, Any], path: Path) -> str:
    """mod.yaml for data (checked against the schema first), in the order the keys are given."""
    try:
        ModSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path, data) from None
    return yaml.dump(data, Dumper=_ModDumper, sort_keys=False, allow_unicode=True, width=110)


# ---------------------------------------------------------------- variants and inheritance


class Recipe(Strict):
    """A variant after `extends` is resolved: the merged recipe and the files it came from."""

    variant: Name
    chain: tuple[str, ...]  # the variant first, then its parent, grandparent, ...
    files: tuple[str, ...]  # the recipe files, in the same order
    data: RecipeFile


def recipe_path(images_dir: Path, name: str) -> Path:
    return images_dir / f"{name}.yaml"


def list_variants(images_dir: Path) -> list[str]:
    if not images_dir.is_dir():
        raise ConfigError("recipe folder not found", path=images_dir)
    return sorted(p.stem for p in images_dir.glob("*.yaml"))


def load_variant(images_dir: Path, name: str) -> Recipe:
    """Load a variant and its ancestors, and merge them parent first."""
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a variant name (lowercase letters, digits and '-')", path=images_dir)
    if len(name) > MAX_VARIANT:
        raise ConfigError(f"the variant name is {len(name)} characters long; its tag ({name[:12]}...-<12 hex>) "
                          f"would pass Docker's {MAX_TAG}: rename it to at most {MAX_VARIANT}",
                          path=recipe_path(images_dir, name), field="variant name")
    chain: list[str] = []
    files: list[RecipeFile] = []
    paths: list[Path] = []
    current: str | None = name
    child_path: Path | None = None
    while current is not None:
        path = recipe_path(images_dir, current)
        if current in chain:
            cycle = " -> ".join(chain[chain.index(current):] + [current])
            raise ConfigError(f"extends forms a cycle: {cycle}", path=child_path, field="extends")
        if not path.exists():  # a FIFO or a folder by that name is refused when read, naming what it is
            if child_path is None:
                known = ", ".join(list_variants(images_dir)) or "none"
                raise ConfigError(f"unknown variant {name!r} (known: {known})", path=images_dir)
            raise ConfigError(f"unknown parent variant {current!r}: {path} does not exist",
                              path=child_path, field="extends")
        recipe = load_recipe_file(path)
        chain.append(current)
        files.append(recipe)
        paths.append(path)
        child_path = path
        current = recipe.extends

    merged: dict[str, Any] = {}
    for recipe, path in zip(reversed(files), reversed(paths)):
        merged = _merge(merged, recipe.model_dump(exclude_unset=True), path)
    merged.pop("extends", None)
    try:
        data = RecipeFile.model_validate(merged)
    except ValidationError as exc:  # a merge can only recombine valid parts; kept as a guard
        raise validation_error(exc, paths[0], merged) from None
    return Recipe(variant=name, chain=tuple(chain), files=tuple(_shown(p, images_dir) for p in paths),
                  data=data)


def _shown(path: Path, images_dir: Path) -> str:
    """A recipe path as recorded in plans: relative to the folder that holds the recipe folder,
    so that renders do not depend on where the checkout lives or where the tool runs."""
    # The recipe's own name, not where a link leads: a recipe may be a link to a file elsewhere.
    folder = images_dir.resolve()
    return (folder / path.name).relative_to(folder.parent).as_posix()


_REPLACED_WHOLE = {"digest", "commit"}


def _merge(parent: dict[str, Any], child: dict[str, Any], path: Path, where: str = "") -> dict[str, Any]:
    """Merge rules: a scalar overrides; a mapping merges key by key (null deletes a key);
    a list replaces; `mods: {remove, add}` edits the parent's mod list by name."""
    out = dict(parent)
    for key, value in child.items():
        field = f"{where}{key}"
        if key == "mods" and not where and isinstance(value, dict):
            out["mods"] = _edit_mods(list(parent.get("mods") or []), value, path)
        elif value is None and where:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key not in _REPLACED_WHOLE:
            out[key] = _merge(out[key], value, path, f"{field}.")
        else:
            out[key] = value
    return out


def _edit_mods(mods: list[str], change: dict[str, list[str]], path: Path) -> list[str]:
    for name in change.get("remove", []):
        if name not in mods:
            raise ConfigError(f"cannot remove {name!r}: the parent does not list it", path=path, field="mods.remove")
        mods.remove(name)
    for name in change.get("add", []):
        if name in mods:
            raise ConfigError(f"cannot add {name!r}: it is already listed", path=path, field="mods.add")
        mods.append(name)
    return mods
