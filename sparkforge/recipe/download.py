"""Files a recipe or a mod names by URL and sha256 (a remote patch, a prebuilt wheel), kept in the cache by hash.

Downloaded on the host into <cache>/downloads/<sha256>/<name>, which is all the build and check-mods ever read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import BinaryIO
from collections.abc import Callable, Iterable, Iterator

from .. import net
from ..files import name_path, open_regular
from .sources import cache_dir

_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")
_NAME = re.compile(r"\A[A-Za-z0-9._+-]+\Z")
DEADLINE = 3600.0  # seconds a whole download may take (a vLLM wheel is some 400 MB); see net.stream
CHUNK = 1 << 20


class DownloadFailed(Exception):
    """The file could not be had (network, TLS, HTTP status); the message says why in one line."""


class HashMismatch(Exception):
    """The file arrived, but its sha256 is not the one pinned."""

    def __init__(self, url: str, wanted: str, got: str) -> None:
        self.url, self.wanted, self.got = url, wanted, got
        super().__init__(f"{url} has sha256 {got}, not the pinned {wanted}")


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def cached(sha256: str, name: str) -> Path:
    """Where the file with this hash is kept (it may not be there yet): always a file of <cache>/downloads/<sha256>/."""
    if not (_HEX64.fullmatch(sha256) and _NAME.fullmatch(name)) or name in (".", ".."):
        raise ValueError(f"not a sha256 and a plain file name: {sha256!r}, {name!r}")
    return downloads_dir() / sha256 / name


def fetch(url: str, sha256: str, name: str, *, ca_cert: Path | None = None) -> Path:
    """The file at url whose sha256 is `sha256`, from the cache or downloaded into it; nothing stays on a failure."""
    return _keep(sha256, name, url, lambda out: _stream(url, out, ca_cert))


def _keep(sha256: str, name: str, origin: str, fill: Callable[[BinaryIO], str]) -> Path:
    """The cached file of this hash, or one fill writes (returning its sha256) kept only when that is `sha256`."""
    target = cached(sha256, name)
    if target.is_file():
        if sha256_of(target) == sha256:  # checked on every use: the cache is a folder anyone may write
            return target
        target.unlink(missing_ok=True)
    part = None
    try:
        fd, part = _part_file(target.parent, name)  # one of this process's own: others may fetch the same file
        with os.fdopen(fd, "wb") as out:
            got = fill(out)
        if got != sha256:
            raise HashMismatch(origin, sha256, got)
        os.replace(part, target)  # a race's loser puts the same bytes in place
    except BaseException as exc:
        if part:
            Path(part).unlink(missing_ok=True)
        _drop_if_empty(target.parent)
        name_path(exc, target)
        raise
    return target


def _part_file(folder: Path, name: str) -> tuple[int, str]:
    """A new temporary file in folder (made if need be), even while another process drops the empty folder."""
    for _ in range(5):
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # removed between the two calls by a process that found it empty
            return tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder)
    return tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder)


def _drop_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (another process's file), gone already, or not ours to remove
        folder.rmdir()


def fetch_new(url: str, name: str, *, ca_cert: Path | None = None) -> tuple[Path, str]:
    """Download a file whose hash is not known yet (to pin it): (its place in the cache, its sha256)."""
    root = downloads_dir()
    fd, part = _part_file(root, name)
    try:
        with os.fdopen(fd, "wb") as out:
            got = _stream(url, out, ca_cert)
        target = cached(got, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, target)
    except BaseException as exc:
        Path(part).unlink(missing_ok=True)
        name_path(exc, root)
        raise
    return target, got


def forget(sha256: str, name: str) -> None:
    """Drop a cached file (one that came as pinned but cannot be used), and its folder when empty."""
    target = cached(sha256, name)
    target.unlink(missing_ok=True)
    _drop_if_empty(target.parent)


def _stream(url: str, out: BinaryIO, ca_cert: Path | None) -> str:
    """Copy url into out (https only, also through redirects; within DEADLINE); return the sha256 of what came."""
    try:
        return _hashed(net.stream(url, deadline=DEADLINE, ca_cert=ca_cert), out)
    except net.FetchFailed as exc:
        raise DownloadFailed(str(exc)) from None


def _hashed(chunks: Iterable[bytes], out: BinaryIO | None = None) -> str:
    """The sha256 of chunks, each also written to out when there is one."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
    return digest.hexdigest()


def _chunks(path: Path, field: str | None = None) -> Iterator[bytes]:
    with open_regular(path, field=field) as fh:
        while chunk := fh.read(CHUNK):
            yield chunk


def sha256_of(path: Path) -> str:
    return _hashed(_chunks(path))


def take_local(path: Path, sha256: str, name: str) -> Path:
    """A local file pinned by hash, copied into the cache and hashed as copied: a later edit changes no build."""
    return _keep(sha256, name, str(path), lambda out: _hashed(_chunks(path, "vllm.path"), out))
