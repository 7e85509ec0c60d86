"""The field types of a recipe and of a mod: every value that can reach a shell line meets a strict pattern here.

Each type is a module-level `Annotated` alias, so a type checker reads it as the str or int it is.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from typing import Annotated, TypeAlias

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, Field

# Every pattern is anchored with \A and \Z (never ^ and $: `$` also matches before a final newline) and used
# with fullmatch, so a value such as "12.1a\n" is refused instead of reaching a Dockerfile line.

# A TCP port: 1 to 65535, without leading zeros (one port, one spelling).
PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
# A host name (RFC 1123 labels, 1 to 63 long), which also spells an IPv4 address; host_problem says the rest.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST = rf"{_LABEL}(?:\.{_LABEL})*"
MAX_HOST = 253  # RFC 1035: a name of 255 octets on the wire, 253 characters as text

NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9-]*\Z")
COMMIT_RE = re.compile(r"\A[0-9a-f]{40}\Z")
DIGEST_RE = re.compile(r"\Asha256:[0-9a-f]{64}\Z")
REF_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._/-]*\Z")
URL_RE = re.compile(rf"\Ahttps://(?P<host>{HOST})(:{PORT})?(/[A-Za-z0-9._~-]+)+/?\Z")
# A file the host downloads (never on a shell line): its path may hold a '%xx' or a '+' (local version wheels).
FILE_URL_RE = re.compile(rf"\Ahttps://(?P<host>{HOST})(:{PORT})?(/[A-Za-z0-9._~%+-]+)+\Z")
# A registry (a host with a port, or a name with a dot) may come first, as Docker reads a reference.
REPOSITORY_RE = re.compile(rf"\A[a-z0-9]+([._-][a-z0-9]+)*(:{PORT})?(/[a-z0-9]+([._-][a-z0-9]+)*)*\Z")
TAG_RE = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
PKG_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\Z")
ENV_NAME_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
ENV_VALUE_RE = re.compile(r"\A[A-Za-z0-9_.,:;/=+@%-]*\Z")
# A compute capability as nvidia-smi prints it (12.1 for a GB10): the minor is one digit (sm_121 is 12.1).
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
PR_RE = re.compile(r"\A(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]{0,38}))/(?P<repo>[A-Za-z0-9_.-]{1,100})#(?P<number>[1-9][0-9]{0,9})\Z")
SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")
# The Python of an image (MAJOR.MINOR) and uv's --python-platform of its glibc, e.g. aarch64-manylinux_2_34.
PYTHON_VERSION_RE = re.compile(r"\A3\.[0-9]{1,2}\Z")
WHEEL_PLATFORM_RE = re.compile(r"\A(aarch64|x86_64)-manylinux_2_[0-9]{2}\Z")
MODULE_RE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def host_problem(host: str) -> str | None:
    """Why a host name that matches HOST cannot be one, or None. Digits and dots are an IPv4 address only in its one
    spelling: the C library would read `010.0.0.1` as 8.0.0.1, `1.2.3` as 1.2.0.3."""
    if len(host) > MAX_HOST:
        return f"its host name is {len(host)} characters long; DNS allows {MAX_HOST}"
    if all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address (four numbers 0-255 without leading zeros)"
    return None


# Docker refuses a tag over 128 characters and a repository over 255; a variant's tags are "<variant>-<12 hex>"
# and, for a build kept beside it, "<variant>-<12 hex>.<12 hex>" (build/builder.kept_tag): 26 more.
MAX_TAG = 128
MAX_REPOSITORY = 255
MAX_VARIANT = MAX_TAG - 26


def matching(pattern: re.Pattern[str], what: str, max_len: int | None = None) -> AfterValidator:
    """The validator of a str type that must match pattern in full (a group `host` also passing host_problem)."""

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

    return AfterValidator(check)


def _path(pattern: re.Pattern[str], what: str, spelled: str = "letters, digits, '._-' and '/' between segments"
          ) -> AfterValidator:
    """The validator of a path type: matched in full, and no `.` or `..` segment, so it stays where it is named."""

    def check(value: str) -> str:
        if not pattern.fullmatch(value) or any(seg in (".", "..") for seg in value.split("/")):
            raise ValueError(f"{value!r} is not a valid {what} ({spelled}; no empty, '.' or '..' segment)")
        return value

    return AfterValidator(check)


def _pep440(value: str) -> str:
    with contextlib.suppress(InvalidVersion):
        if PEP440_CHARS_RE.fullmatch(value):
            Version(value)
            return value
    raise ValueError(f"{value!r} is not a valid PEP 440 version")


def specifier_error(value: str) -> str | None:
    """Why value is not a PEP 440 specifier set, or None when it is one."""
    # packaging strips surrounding whitespace; a newline or tab in a range is still a typo.
    with contextlib.suppress(InvalidSpecifier):
        if value.isprintable():
            SpecifierSet(value)
            return None
    return f"{value!r} is not a PEP 440 specifier set such as '>=0.16,<0.18'"


def _specifier(value: str) -> str:
    if problem := specifier_error(value):
        raise ValueError(problem)
    return value


def _nonblank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


Name: TypeAlias = Annotated[str, matching(NAME_RE, "name (lowercase letters, digits and '-')")]
Commit: TypeAlias = Annotated[str, matching(
    COMMIT_RE, "full commit: write 40 lowercase hex digits (put a short SHA in ref)")]
Digest: TypeAlias = Annotated[str, matching(DIGEST_RE, "digest: write sha256:<64 hex>")]
GitRef: TypeAlias = Annotated[str, matching(REF_RE, "git ref")]
GitUrl: TypeAlias = Annotated[str, matching(URL_RE, "https git URL")]
FileUrl: TypeAlias = Annotated[str, matching(FILE_URL_RE, "https URL of a file")]
Repository: TypeAlias = Annotated[str, matching(REPOSITORY_RE, "image repository", MAX_REPOSITORY)]
ImageTag: TypeAlias = Annotated[str, matching(TAG_RE, "image tag")]
Package: TypeAlias = Annotated[str, matching(PKG_RE, "pip package name")]
Distribution: TypeAlias = Annotated[str, matching(DIST_RE, "installed distribution name such as torch (no extras)")]
EnvName: TypeAlias = Annotated[str, matching(ENV_NAME_RE, "environment variable name")]
EnvValue: TypeAlias = Annotated[str, matching(
    ENV_VALUE_RE, "environment value (allowed: A-Z a-z 0-9 _ . , : ; / = + @ % -)")]
ArchList: TypeAlias = Annotated[str, matching(ARCH_LIST_RE, "TORCH_CUDA_ARCH_LIST such as '12.0a;12.1a'")]
Gpu: TypeAlias = Annotated[str, matching(GPU_RE, "compute capability such as '12.1'")]
Extension: TypeAlias = Annotated[str, matching(
    EXTENSION_RE, "extension name such as _vllm_fa3_C (its file name up to the first dot)")]
AbsPath: TypeAlias = Annotated[str, _path(ABS_PATH_RE, "absolute path")]
RelPath: TypeAlias = Annotated[str, _path(REL_PATH_RE, "relative path")]
ModPath: TypeAlias = Annotated[str, _path(re.compile(f"{ABS_PATH_RE.pattern}|{REL_PATH_RE.pattern}"), "path",
                                           "absolute, or relative to the component")]
OsPackage: TypeAlias = Annotated[str, matching(OS_PKG_RE, "Debian package name")]
PipVersion: TypeAlias = Annotated[str, AfterValidator(_pep440)]
Specifier: TypeAlias = Annotated[str, AfterValidator(_specifier)]
Text: TypeAlias = Annotated[str, AfterValidator(_nonblank)]
FileMode: TypeAlias = Annotated[str, matching(MODE_RE, "octal file mode such as '0644'")]
Count: TypeAlias = Annotated[int, Field(ge=1, le=256)]
PatchUrl: TypeAlias = Annotated[str, matching(PATCH_URL_RE, "https URL of a patch")]
Sha256: TypeAlias = Annotated[str, matching(SHA256_RE, "sha256: write the 64 lowercase hex digits (sha256sum FILE)")]
Module: TypeAlias = Annotated[str, matching(MODULE_RE, "Python module name such as torch or vllm.platforms")]
PythonVersion: TypeAlias = Annotated[str, matching(PYTHON_VERSION_RE, "Python version such as '3.12'")]
WheelPlatform: TypeAlias = Annotated[str, matching(
    WHEEL_PLATFORM_RE, "wheel platform such as 'aarch64-manylinux_2_34' (ARCH-manylinux_2_GLIBC)")]


def _pull_request(value: str) -> str:
    m = PR_RE.fullmatch(value)
    if not m or m["repo"] in (".", ".."):
        raise ValueError(f"{value!r} is not a pull request: write OWNER/REPO#NUMBER, e.g. vllm-project/vllm#12345")
    return value


PullRequest: TypeAlias = Annotated[str, AfterValidator(_pull_request)]
