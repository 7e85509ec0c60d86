"""Push stage of distribution: the head puts both tags of an image in a registry.

Two ways: the engine's own push (gzip on one core, any Docker; :func:`push_image`), or by blobs
(:func:`push_blobs`): one `docker save`, each layer compressed with zstd on every core (or not at
all) and streamed to the registry, then the manifest under the immutable tag and, last, the
moving tag. Either way the manifest digest the registry stored is recorded on the head, as one
more name of the image (:func:`.distribute.record_manifest`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import dockercli
from .cluster import CONTROL_TIMEOUT, Registry, _clean, registry_context
from .dockercli import last_line
from .distribute import (CHUNK, TRANSFER_TIMEOUT, HeadImage, Progress, ProgressFn, _update_state, human_bytes,
                         read_state, record_manifest, registry_ref)
from .errors import DistributeError


@dataclass(frozen=True)
class PushResult:
    refs: tuple[str, ...]
    digest: str | None  # the manifest digest the registry stored
    layers_pushed: int
    layers_present: int
    bytes_pushed: int  # as the engine reports its upload progress
    seconds: float


def push_image(image: HeadImage, registry: str, progress: ProgressFn | None = None,
               state_dir: Path | None = None) -> PushResult:
    """Push the immutable tag, then the moving tag, to registry (HOST:PORT); record the manifest digest."""
    import docker

    t0 = time.monotonic()
    refs, digest = [], None
    pushed: dict[str, int] = {}
    present: set[str] = set()
    try:
        client = docker.from_env(timeout=TRANSFER_TIMEOUT)
        for ref in (image.tag, image.moving_tag):
            full = registry_ref(registry, ref)
            repo, _, tag = full.rpartition(":")
            client.api.tag(image.image_id, repo, tag, force=True)
            for ev in client.api.push(repo, tag=tag, stream=True, decode=True):
                if "error" in ev:
                    raise DistributeError(f"push of {full} failed: {_clean(ev['error'])}", field="--registry")
                status, lid = ev.get("status", ""), ev.get("id")
                if status == "Pushing" and lid:
                    detail = ev.get("progressDetail") or {}
                    pushed[lid] = max(pushed.get(lid, 0), int(detail.get("current") or 0))
                elif status in ("Layer already exists", "Mounted from") and lid:
                    present.add(lid)
                aux = ev.get("aux") or {}
                if aux.get("Digest"):
                    digest = aux["Digest"]
                if progress and status:
                    progress(Progress(registry, "push", sum(pushed.values()), None, f"{ref}: {status}"))
            refs.append(full)
    except docker.errors.DockerException as exc:
        raise DistributeError(f"push to {registry} failed: {_sdk_reason(exc)}", field="--registry") from None
    present -= set(pushed)  # the moving tag's push finds every layer the first push sent
    if digest:
        record_manifest(state_dir, image.tag, digest)
    return PushResult(tuple(refs), digest, len(pushed), len(present), sum(pushed.values()),
                      time.monotonic() - t0)


def _sdk_reason(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    text = _clean(explanation or str(exc)) or type(exc).__name__
    for marker in ("Connection refused", "timed out", "certificate", "Connection reset"):
        if marker in text:
            return f"{marker.lower()}: {text[:200]}"
    return text[:300]


def push_to(image: HeadImage, registry: Registry, compression: str = "zstd", progress: ProgressFn | None = None,
            state_dir: Path | None = None) -> PushResult:
    """Push both tags: gzip through the engine (any Docker), zstd or none by blobs (:func:`push_blobs`)."""
    if compression == "gzip":
        return push_image(image, registry.address, progress, state_dir)
    return push_blobs(image, registry, compression, progress, state_dir)

# ------------------------------------------------------------------- push by blobs (zstd or none)

LAYER_TYPES = {"zstd": "application/vnd.oci.image.layer.v1.tar+zstd", "none": "application/vnd.oci.image.layer.v1.tar"}
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def push_blobs(image: HeadImage, registry: Registry, compression: str = "zstd",
               progress: ProgressFn | None = None, state_dir: Path | None = None) -> PushResult:
    """Push without the engine: `docker save`, layers compressed with zstd on every core (or not at all).

    The engine's own push gzips on one core, which bounds a cold deploy. Here each layer of the
    saved image is compressed by `zstd -T0` and streamed to the registry; a layer the registry
    already holds (by the digest recorded for it at an earlier push) is not sent again.
    """
    import hashlib
    import tarfile

    if compression not in LAYER_TYPES:
        raise DistributeError(f"unknown compression {compression!r}; choose gzip, zstd or none", field="--compression")
    if compression == "zstd" and shutil.which("zstd") is None:
        raise DistributeError("the zstd command is not installed here (package zstd); install it, or push with "
                              "--compression gzip or none", field="--compression")
    t0 = time.monotonic()
    repo = image.repository
    config_hex = image.image_id.partition(":")[2]
    diff_ids = set(image.identity.layers)
    known = read_state(state_dir, repo).setdefault("blobs", {})
    pushed: dict[str, tuple[str, int]] = {}  # diff id -> (blob digest, size)
    sent = present = 0
    config: bytes | None = None
    save = dockercli.track(subprocess.Popen(["docker", "save", image.tag], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE))
    watchdog = threading.Timer(TRANSFER_TIMEOUT, save.kill)  # a hung save or upload is stopped, not waited on
    watchdog.daemon = True
    watchdog.start()
    try:
        with tarfile.open(fileobj=save.stdout, mode="r|") as tar:
            for member in tar:
                hexname = member.name.rpartition("/")[2]
                if not member.isfile() or not member.name.startswith("blobs/sha256/"):
                    continue
                if hexname == config_hex:
                    config = tar.extractfile(member).read()  # type: ignore[union-attr]
                    continue
                diff_id = f"sha256:{hexname}"
                if diff_id not in diff_ids:
                    continue
                again = (known.get(diff_id) or {}).get(compression)
                if again and _blob_exists(registry, repo, again[0]):
                    pushed[diff_id] = (again[0], again[1])
                    present += 1
                    continue
                data = tar.extractfile(member)
                digest, size = _upload_layer(registry, repo, data, compression, diff_id, hashlib.sha256())
                pushed[diff_id] = (digest, size)
                sent += size
                if progress:
                    progress(Progress(registry.address, "push", sent, None, f"layer {digest[:19]} ({human_bytes(size)})"))
        code = save.wait(timeout=CONTROL_TIMEOUT)
    except (OSError, tarfile.TarError, urllib.error.URLError, subprocess.TimeoutExpired) as exc:
        save.kill()
        save.wait()
        raise DistributeError(f"push to {registry.address} failed: {_clean(str(exc))[:200]}", field="--registry") from None
    finally:
        watchdog.cancel()
    if code != 0 or config is None:
        raise DistributeError(f"docker save {image.tag} failed: {last_line(save.stderr.read() if save.stderr else b'', 'no message')}",
                              field="docker")
    try:
        refs, digest = _put_manifest(image, registry, repo, config, [pushed[d] for d in image.identity.layers],
                                     compression)
    except (OSError, urllib.error.URLError) as exc:
        raise DistributeError(f"push to {registry.address} failed: {_clean(str(exc))[:200]}",
                              field="--registry") from None

    def remember(data: dict) -> None:
        blobs = data.setdefault("blobs", {})
        for d, (blob, size) in pushed.items():
            blobs.setdefault(d, {})[compression] = [blob, size]

    _update_state(state_dir, repo, remember)
    if digest:
        record_manifest(state_dir, image.tag, digest)
    return PushResult(tuple(refs), digest, len(pushed) - present, present, sent, time.monotonic() - t0)


def _put_manifest(image: HeadImage, registry: Registry, repo: str, config: bytes, layers: list[tuple[str, int]],
                  compression: str) -> tuple[list[str], str | None]:
    """Upload the config, then the manifest under the immutable tag and (last) the moving tag."""
    config_digest = _put_blob(registry, repo, config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": LAYER_TYPES[compression], "digest": blob, "size": size} for blob, size in layers],
    }, separators=(",", ":")).encode()
    refs, digest = [], None
    for ref in (image.tag, image.moving_tag):
        digest = _request(registry, "PUT", f"/v2/{repo}/manifests/{ref.rpartition(':')[2]}", manifest,
                          {"Content-Type": OCI_MANIFEST}).headers.get("Docker-Content-Digest")
        refs.append(registry_ref(registry.address, ref))
    return refs, digest


def _request(registry: Registry, method: str, url: str, body=None, headers: dict | None = None):
    full = url if url.startswith("http") else f"{registry.url}{url}"
    req = urllib.request.Request(full, data=body, method=method, headers=headers or {})
    return urllib.request.urlopen(req, timeout=TRANSFER_TIMEOUT, context=registry_context(registry))


def _blob_exists(registry: Registry, repo: str, digest: str) -> bool:
    try:
        return _request(registry, "HEAD", f"/v2/{repo}/blobs/{digest}").status == 200
    except urllib.error.HTTPError:
        return False


def _start_upload(registry: Registry, repo: str) -> str:
    location = _request(registry, "POST", f"/v2/{repo}/blobs/uploads/", b"").headers["Location"]
    return location if location.startswith("http") else f"{registry.url}{location}"


def _finish(location: str, digest: str) -> str:
    return f"{location}{'&' if '?' in location else '?'}digest={digest}"


def _put_blob(registry: Registry, repo: str, data: bytes) -> str:
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if not _blob_exists(registry, repo, digest):
        _request(registry, "PUT", _finish(_start_upload(registry, repo), digest), data,
                 {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))})
    return digest


def _upload_layer(registry: Registry, repo: str, data, compression: str, diff_id: str, hasher) -> tuple[str, int]:
    """Stream one layer to the registry (one PATCH, chunked), compressing on the way; (digest, size)."""
    size = 0
    if compression == "none":
        def chunks():
            nonlocal size
            while block := data.read(CHUNK):
                size += len(block)
                yield block
        zstd = None
        source = chunks()
    else:
        # zstd on every core; a thread feeds it the layer while this one uploads what comes out.
        zstd = dockercli.track(subprocess.Popen(["zstd", "-T0", "-3", "-q", "-c"], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE))

        def feed() -> None:
            try:
                while block := data.read(CHUNK):
                    zstd.stdin.write(block)  # type: ignore[union-attr]
            finally:
                zstd.stdin.close()  # type: ignore[union-attr]

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()

        def compressed():
            nonlocal size
            while block := zstd.stdout.read1(CHUNK):  # type: ignore[union-attr]
                hasher.update(block)
                size += len(block)
                yield block
        source = compressed()
    location = _start_upload(registry, repo)
    resp = _request(registry, "PATCH", location, source, {"Content-Type": "application/octet-stream"})
    if zstd is not None:
        feeder.join()
        if zstd.wait(timeout=CONTROL_TIMEOUT) != 0:
            raise DistributeError(f"zstd failed on layer {diff_id[:19]}", field="--compression")
    digest = diff_id if compression == "none" else "sha256:" + hasher.hexdigest()
    after = resp.headers["Location"]
    after = after if after.startswith("http") else f"{registry.url}{after}"
    _request(registry, "PUT", _finish(after, digest), b"", {"Content-Length": "0"})
    return digest, size

