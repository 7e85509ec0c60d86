"""The real source of a component at a pinned version, from a PyPI simple index (sha256-checked) or git, cached;
mods are only ever applied to scratch copies."""

from __future__ import annotations

import contextlib
import hashlib
import html.parser
import os
import shutil
import tarfile
import tempfile
import time
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

from packaging.utils import (InvalidSdistFilename, InvalidWheelFilename, canonicalize_name, parse_sdist_filename,
                             parse_wheel_filename)
from packaging.version import InvalidVersion, Version

from .. import gitfetch, net
from ..errors import mask_url
from ..files import locked, name_path, write_atomic
from ..inimage import version_file_commit

DEFAULT_INDEX = "https://pypi.org/simple"
INDEX_TTL = 6 * 3600  # seconds a cached index page stays fresh
GIT_LOCK_TIMEOUT = 1800.0  # seconds to wait for another process's fetch into the shared git mirror


class SourceUnavailable(Exception):
    """The source cannot be had from here (network, missing release); the message says why."""


@dataclass(frozen=True)
class Release:
    project: str
    filename: str
    url: str
    sha256: str | None


def cache_dir() -> Path:
    return Path(os.environ.get("SPARKFORGE_CACHE", Path.home() / ".cache" / "sparkforge"))


def index_url() -> str:
    return os.environ.get("SPARKFORGE_INDEX_URL", DEFAULT_INDEX).rstrip("/")


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def project_files(project: str, *, refresh: bool = False) -> list[tuple[str, str]]:
    """(filename, url) of every file a project has on the index; the page is cached for a while."""
    name = canonicalize_name(project)
    cached = cache_dir() / "index" / f"{name}.html"
    page_url = f"{index_url()}/{name}/"
    if refresh or not cached.exists() or time.time() - cached.stat().st_mtime > INDEX_TTL:
        try:
            page = net.get(page_url, deadline=120)
        except net.FetchFailed as exc:
            raise SourceUnavailable(f"cannot fetch {exc}") from None
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, page)  # others sharing the cache see the old page or the new, whole
    parser = _Links()
    parser.feed(cached.read_text(encoding="utf-8", errors="replace"))
    return [(text, urllib.parse.urljoin(page_url, href)) for text, href in parser.links]


def _parse(filename: str) -> tuple[str, Version, bool] | None:
    """(project, version, is_sdist) of a distribution file name, or None for anything else."""
    with contextlib.suppress(InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        if filename.endswith(".whl"):
            return (*parse_wheel_filename(filename)[:2], False)
        if filename.endswith(".tar.gz"):
            return (*parse_sdist_filename(filename), True)
    return None


def release_versions(project: str) -> list[str]:
    """Final releases of a project on the index, oldest first."""
    parsed = (_parse(filename) for filename, _ in project_files(project))
    versions = {found[1] for found in parsed if found and not found[1].is_prerelease and not found[1].is_devrelease}
    return [str(v) for v in sorted(versions)]


def find_release(project: str, version: str) -> Release:
    """The sdist of project==version, or a wheel when the release has no sdist."""
    wanted = Version(version)
    sdist = wheel = None
    for filename, url in project_files(project):
        parsed = _parse(filename)
        if not parsed or parsed[1] != wanted:
            continue
        if parsed[2]:
            sdist = (filename, url)
        elif wheel is None or "x86_64" in filename:
            wheel = (filename, url)
    chosen = sdist or wheel
    if chosen is None:
        raise SourceUnavailable(f"{project} {version} has no sdist or wheel on {mask_url(index_url())}")
    filename, url = chosen
    base, _, fragment = url.partition("#")
    sha = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
    return Release(project, filename, base, sha)


# Where a download's progress goes: the command line sets it to a line on stderr; a library caller sees nothing.
announce: Callable[[str], None] = lambda line: None


def download(release: Release) -> Path:
    """The release file, downloaded once into the cache and checked against its sha256 (progress: `announce`)."""
    target = cache_dir() / "sources" / canonicalize_name(release.project) / release.filename
    if target.is_file():
        return target
    # Streamed to a file of this process's own, hashed on the way: a release wheel (0.15.x has no sdist)
    # is hundreds of MB, so it is never held in memory.
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in net.stream(release.url, deadline=3600,
                                    progress=net.byte_progress(announce, f"downloading {release.filename}")):
                digest.update(chunk)
                out.write(chunk)
        if release.sha256 and digest.hexdigest() != release.sha256:
            raise SourceUnavailable(f"{release.filename}: sha256 does not match the index")
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, net.FetchFailed):
            raise SourceUnavailable(f"cannot fetch {exc}") from None
        name_path(exc, target)
        raise
    return target


# Bumped when what a cached tree holds changes, so that older caches are extracted anew.
TREE_FORMAT = "tree-2"


def extract_tree(archive: Path, package: str, name: str | None = None) -> Path:
    """The cached root of a whole sdist (a source-phase mod may touch setup.py or csrc/) or of a wheel's sources
    (no shared library: ~1 GB of a CUDA vLLM wheel that no mod can edit): regular files only, each confined to the
    root. `name` names it (default: the archive's)."""
    root = cache_dir() / "trees" / f"{TREE_FORMAT}-{name or archive.name}"
    if (root / ".complete").exists():
        return root
    with _staged_tree(root, archive.name) as staging:
        if archive.name.endswith(".whl"):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    base = info.filename.rsplit("/", 1)[-1]
                    shared_library = base.endswith(".so") or ".so." in base  # x.so, x.so.12
                    if not info.is_dir() and _confined(info.filename) and not shared_library:
                        zf.extract(info, staging)
        else:
            with tarfile.open(archive) as tf:
                extract_files(tf, staging, strip_top=True)
        if not (staging / package).is_dir():
            raise SourceUnavailable(f"{archive.name} holds no {package}/ folder")
    return root


def extract_files(tf: tarfile.TarFile, dest: Path, *, strip_top: bool) -> None:
    """Write the regular files of a tarball under dest; links, devices and names that climb out are skipped.
    (By hand: extract(filter="data") exists only from Python 3.11.4 on.)"""
    for member in tf.getmembers():
        name = member.name.split("/", 1)[1] if strip_top and "/" in member.name else member.name
        if strip_top and "/" not in member.name or not member.isfile() or not _confined(name):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = tf.extractfile(member)
        assert source is not None  # a regular file always has content
        with source, open(target, "wb") as out:
            shutil.copyfileobj(source, out)
        target.chmod(0o755 if member.mode & 0o111 else 0o644)


def _confined(name: str) -> bool:
    """A relative archive member name that stays inside the folder it is extracted to."""
    return bool(name) and not name.startswith("/") and ".." not in name.split("/")


@contextlib.contextmanager
def _staged_tree(root: Path, marker: str) -> Iterator[Path]:
    """Fill a temporary sibling of root, then swap it into place whole; on failure, drop it."""
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tree.", dir=root.parent))
    try:
        yield staging
        (staging / ".complete").write_text(marker + "\n")
        if root.exists() and not (root / ".complete").exists():
            # A half tree of an older sparkforge: renamed away before it is deleted, so no reader sees it half deleted.
            trash = root.parent / f".trash.{os.getpid()}.{time.monotonic_ns()}"
            with contextlib.suppress(FileNotFoundError):
                os.replace(root, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(staging, root)
        except OSError:  # another process put the same tree there first: its tree is used, this one dropped
            if not (root / ".complete").exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        name_path(exc, root)
        raise


def recorded_commit(tree: Path, package: str = "vllm") -> str | None:
    """The short commit a release records in <package>/_version.py (without setuptools-scm's 'g')."""
    return version_file_commit(tree / package / "_version.py")


def release_tree(project: str, version: str) -> Path:
    """A cached, extracted tree of project==version from the index."""
    return extract_tree(download(find_release(project, version)), canonicalize_name(project).replace("-", "_"))


def git_tree(repo: str, commit: str, package: str) -> Path:
    """A cached tree of a whole commit, fetched into the same blob-less mirror the builds use."""
    root = cache_dir() / "trees" / f"{TREE_FORMAT}-git-{hashlib.sha256(repo.encode()).hexdigest()[:12]}-{commit}"
    if (root / ".complete").exists():
        return root
    try:
        with locked(cache_dir() / "git" / ".lock", timeout=GIT_LOCK_TIMEOUT, what="fetches into the git mirror"):
            mirror, full = gitfetch.resolve(cache_dir() / "git", repo, commit, commit)
        with _staged_tree(root, commit) as staging:
            gitfetch.export(mirror, full, staging)
            if not (staging / package).is_dir():
                raise SourceUnavailable(f"{repo} at {commit[:12]} holds no {package}/ folder")
    except gitfetch.FetchError as exc:
        raise SourceUnavailable(f"{repo} {commit[:12]}: {exc}") from None
    return root


def scratch_copy(tree: Path, dest: Path, only: str | None = None) -> Path:
    """A copy of a cached tree, or of its top-level folder `only`, to edit without touching the cache (no hard links)."""
    if only is None:
        shutil.copytree(tree, dest, symlinks=True, ignore=shutil.ignore_patterns(".complete"))
    else:
        dest.mkdir(parents=True)
        if (tree / only).is_dir() and not (tree / only).is_symlink():
            shutil.copytree(tree / only, dest / only, symlinks=True)
    return dest
