"""One file out of a wheel on the package index, kept in the cache: the tests of the kernel reader
need torch's libtorch_cuda.so (461 MB), not its 454 MB wheel each run.

The zip's central directory and the member's bytes are fetched with HTTP range requests where the
server answers them (PyPI's file host does); elsewhere the wheel is streamed once to a temporary
file and only the member is kept. The member is checked against the sha256 the wheel's own RECORD
gives it, and its CRC-32, before it is renamed into place under
`~/.cache/sparkforge/wheel-members/<wheel file name>/`.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import tempfile
import urllib.request
import zipfile
from pathlib import Path
from typing import BinaryIO

from sparkforge.recipe import sources
from tests.support.once import one_at_a_time

CHUNK = 16 << 20
TIMEOUT = 120


def _range(url: str, start: int, end: int) -> bytes | None:
    """Bytes start..end-1 of url, or None when the server does not answer ranges."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        if response.status != 206:
            return None
        data: bytes = response.read()
    if len(data) != end - start:
        raise OSError(f"{url}: asked for {end - start} bytes, got {len(data)}")
    return data


def _size(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=TIMEOUT) as response:
        return int(response.headers["Content-Length"])


class _Remote(io.RawIOBase):
    """A wheel on the index as a seekable file, read by range requests (for zipfile)."""

    def __init__(self, url: str) -> None:
        self.url, self.size, self.pos = url, _size(url), 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.size - self.pos, CHUNK)
        if n <= 0:
            return 0
        data = _range(self.url, self.pos, self.pos + n)
        if data is None:
            raise OSError(f"{self.url} does not answer range requests")
        buffer[:n] = data
        self.pos += n
        return n


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str:
    """The sha256 (hex) the wheel's RECORD gives member."""
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    for row in csv.reader(io.TextIOWrapper(wheel.open(record), encoding="utf-8")):
        if row and row[0] == member:
            algorithm, _, digest = row[1].partition("=")
            assert algorithm == "sha256", row
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise KeyError(f"{member} is not in the wheel's RECORD")


def _copy(wheel: zipfile.ZipFile, member: str, target: Path) -> None:
    """member of wheel to target, checked against RECORD, written whole or not at all."""
    want = _record_sha256(wheel, member)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, wheel.open(member) as src:  # zipfile checks the CRC-32
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != want:
            raise OSError(f"{member}: sha256 {digest.hexdigest()}, the wheel's RECORD says {want}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _stream_whole(url: str, sha256: str | None, out: BinaryIO) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        while chunk := response.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    if sha256 and digest.hexdigest() != sha256:
        raise OSError(f"{url}: sha256 {digest.hexdigest()}, the index says {sha256}")


def wheel_member(project: str, filename: str, member: str) -> Path:
    """The file member of the wheel filename of project on the index, from the cache when it is there."""
    target = sources.cache_dir() / "wheel-members" / filename / Path(member).name
    if target.is_file():
        return target
    with one_at_a_time(f"wheel-member-{hashlib.sha256((filename + member).encode()).hexdigest()[:16]}"):
        if target.is_file():
            return target
        links = dict(sources.project_files(project))
        url, _, fragment = links[filename].partition("#")
        assert url.startswith("https://"), url
        try:
            with zipfile.ZipFile(io.BufferedReader(_Remote(url), CHUNK)) as wheel:
                _copy(wheel, member, target)
        except OSError as exc:
            if "range requests" not in str(exc):
                raise
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=target.parent) as whole:
                _stream_whole(url, fragment.removeprefix("sha256=") or None, whole)
                with zipfile.ZipFile(whole) as wheel:
                    _copy(wheel, member, target)
    return target

