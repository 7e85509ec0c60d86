"""Push stage: the head puts both tags of an image in a registry, the moving tag last, by the engine or by blobs."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..build import dockercli
from ..errors import DistributeError
from ..imageref import ImageRef, is_attestation
from ..inimage.contract import parse_json
from ..registry import Client as RegistryClient, RegistryError
from .cluster import Registry
from .nodes import CONTROL_TIMEOUT, TRANSFER_TIMEOUT, one_line
from .deploy import CHUNK, Progress, ProgressFn, human_bytes
from .images import HeadImage, read_state, record_manifest, recording


@dataclass(frozen=True)
class PushResult:
    refs: tuple[str, ...]
    digest: str | None  # the manifest digest the registry stored
    layers_pushed: int
    layers_present: int
    bytes_pushed: int  # the stored sizes of the layers sent (the engine's push: 0 where the registry does not say)
    seconds: float
    sent_as_stored: tuple[tuple[str, int], ...] = ()  # (gzip or zstd, n): layers sent as the engine keeps them


def push_image(image: HeadImage, registry: Registry, progress: ProgressFn | None = None,
               state_dir: Path | None = None) -> PushResult:
    """Push the immutable tag, then the moving tag, through the engine (`docker tag`, `docker push`); the registry's
    names exist on the head only while their push runs (one the head had before is left as it was)."""
    t0 = time.monotonic()
    digest = None
    pushed: set[str] = set()  # the short IDs the engine said it pushed
    present: set[str] = set()  # and those it found in the registry already
    fulls = [f"{registry.address}/{name}" for name in (image.tag, image.moving_tag)]
    had = {ref for ref, data in dockercli.inspect_images(*fulls).items() if data is not None}
    try:
        for full in fulls:
            dockercli.run(["tag", image.image_id, full], what="docker tag")
            digest = _engine_push(full, registry, pushed, present, progress) or digest
    finally:
        for full in set(fulls) - had:
            with contextlib.suppress(dockercli.EngineError):  # the push's own outcome is what is reported
                dockercli.run(["image", "rm", full], what="docker image rm", check=False)
    n_pushed, n_present, sent = len(pushed), len(present - pushed), 0  # the moving tag's push finds what the first sent
    if digest and (layers := _layers(registry, ImageRef.parse(fulls[0]).path, digest, image.identity.layers)):
        # A containerd-store engine reports the config blob, and an attestation's blobs, as it does a layer, and
        # may name one layer by its blob digest in one line and by its diff ID in another: count layers, not names.
        went = [size for names, size in layers if names & pushed]
        n_pushed, sent = len(went), sum(went)
        n_present = len([names for names, _ in layers if names & present and not names & pushed])
    if digest:
        record_manifest(state_dir, image.tag, digest)
    return PushResult(tuple(fulls), digest, n_pushed, n_present, sent, time.monotonic() - t0)


def _engine_push(full: str, registry: Registry, pushed: set[str], present: set[str],
                 progress: ProgressFn | None) -> str | None:
    """`docker push FULL`, its layer lines counted into pushed and present; the manifest digest it printed."""
    digest: str | None = None
    said = ""  # the last line it printed
    child = dockercli.start(["push", full], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in dockercli.lines_until_stall(child, TRANSFER_TIMEOUT):
            text = one_line(line)
            said = text or said
            short, _, status = text.partition(": ")
            if status == "Pushed":
                pushed.add(short)
            elif status == "Layer already exists" or status.startswith("Mounted from "):
                present.add(short)  # "Mounted from REPO": a layer the registry had under another name
            if m := _PUSHED_DIGEST.search(text):
                digest = m.group(1)
            if progress and status:
                progress(Progress(registry.address, "push", 0, None, f"{full}: {text}"))
    except BaseException:  # Ctrl-C, SIGTERM, a failing progress callback: the push stops too
        dockercli.stop(child)
        dockercli.finish(child)
        raise
    finally:
        if child.stdout is not None:
            child.stdout.close()
    code = dockercli.finish(child, CONTROL_TIMEOUT)  # its output ended: it is exiting
    if code != 0:
        raise DistributeError(f"push of {full} failed: {said or f'exit code {code}'}"[:300], field="--registry")
    return digest


def _layers(registry: Registry, repo: str, digest: str, diff_ids: tuple[str, ...]) -> list[tuple[set[str], int]] | None:
    """Per layer, the short IDs a push may print for it (diff ID, blob digest) and its size; None when unknown."""
    client = RegistryClient(registry.endpoint)
    try:
        doc = client.manifest(repo, digest)
        listed = doc.get("manifests")
        if isinstance(listed, list):  # an index: its image manifest, not its attestations
            images = [m for m in listed if isinstance(m, dict) and isinstance(m.get("digest"), str)
                      and not is_attestation(m)]
            doc = client.manifest(repo, images[0]["digest"]) if len(images) == 1 else {}
    except RegistryError:
        return None
    blobs = [layer for layer in doc.get("layers") or [] if isinstance(layer, dict)]
    if len(blobs) != len(diff_ids) or not all(isinstance(b.get("digest"), str) for b in blobs):
        return None
    return [({d.removeprefix("sha256:")[:12], str(b["digest"]).removeprefix("sha256:")[:12]},
             int(b.get("size") or 0)) for d, b in zip(diff_ids, blobs)]


_PUSHED_DIGEST = re.compile(r": digest: (sha256:[0-9a-f]{64}) size: [0-9]+\Z")


def push_to(image: HeadImage, registry: Registry, compression: str = "zstd", progress: ProgressFn | None = None,
            state_dir: Path | None = None) -> PushResult:
    """Push both tags: gzip through the engine (any Docker), zstd or none by blobs (:func:`push_blobs`)."""
    if compression == "gzip":
        return push_image(image, registry, progress, state_dir)
    return push_blobs(image, registry, compression, progress, state_dir)


def default_route(store: dockercli.ImageStore) -> tuple[str, str]:
    """The push after which a first deploy is fastest from a head on this store (`make bench-distribute`), and why."""
    if store.containerd:
        return "gzip", ("the engine's own push: this engine's containerd image store keeps the built layers "
                        "compressed and sends them as kept")
    return "zstd", "layers zstd-compressed on every core, by blobs: this engine's classic store keeps them unpacked"


def push_by_default(image: HeadImage, registry: Registry, say: Callable[[str], None],
                    progress: ProgressFn | None = None, state_dir: Path | None = None) -> PushResult:
    """Push by the route default_route picks for the head's store, saying which and why; where the engine's own push
    fails (it does not trust the registry's CA, or cannot reach it), by blobs, which need only the cluster's CA."""
    compression, why = default_route(dockercli.image_store())
    say(f"route: {why} (`--compression` chooses another)")
    try:
        return push_to(image, registry, compression, progress, state_dir)
    except DistributeError as exc:
        if compression != "gzip":
            raise
        say(f"route: the engine's push failed ({exc.detail}); pushing by blobs instead, which needs no trust from "
            "the engine")
        return push_blobs(image, registry, "zstd", progress, state_dir)


LAYER_TYPES = {"zstd": "application/vnd.oci.image.layer.v1.tar+zstd", "none": "application/vnd.oci.image.layer.v1.tar"}
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# Seconds one send to the registry, or its answer, may wait (storing a layer of GBs takes a while once it is in).
PUSH_WINDOW = 300.0


class _SavedImage:
    """One pass over a `docker save` stream: each layer sent unless the registry holds it, the small blobs kept."""

    def __init__(self, client: RegistryClient, repo: str, compression: str, diff_ids: set[str], known: dict[str, Any]):
        self.client, self.repo, self.compression = client, repo, compression
        self.diff_ids, self.known = diff_ids, known  # the image's layers; blobs recorded at earlier pushes
        self.layers: dict[str, Layer] = {}  # blob name (hex) in the saved image -> the layer in the registry
        self.uploaded: dict[str, tuple[str, int]] = {}  # diff id -> (blob digest, size), for the state
        self.small: dict[str, bytes] = {}  # blobs that are not layers: config, manifests
        self.manifest: bytes | None = None
        self.sent = self.present = 0
        self.sent_as_stored: dict[str, int] = {}  # layers uploaded as the engine keeps them, by their compression

    def take(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> Layer | None:
        """Read one member of the saved image; the layer when it is one."""
        hexname = member.name.rpartition("/")[2]
        is_blob = member.name.startswith("blobs/sha256/") and bool(_HEX64.match(hexname))
        if not member.isfile() or not (is_blob or member.name == "manifest.json"):
            return None
        data = tar.extractfile(member)
        assert isinstance(data, io.BufferedReader)  # tarfile's ExFileObject, for every regular member: it can peek
        if not is_blob:
            self.manifest = data.read()
            return None
        stored = stored_compression(data.peek(4)[:4])
        digest = f"sha256:{hexname}"
        if stored is None and digest not in self.diff_ids:  # not a layer
            if member.size <= SMALL_BLOB:
                self.small[hexname] = data.read()
            return None
        # A compressed layer (the containerd store keeps what was built so) is sent as it is; an uncompressed one
        # is named by its diff ID, and compressed unless an earlier push recorded its blob.
        compression = "none" if stored else self.compression
        again: Any = (digest, member.size)  # a stored layer is its own blob; else one an earlier push recorded
        if not stored:
            again = (self.known.get(digest) or {}).get(compression)
        if again and self.client.blob_exists(self.repo, again[0]):
            blob, size = again[0], again[1]
            self.present += 1
        else:
            blob, size = _upload_layer(self.client, self.repo, data, compression, digest)
            self.sent += size
            if stored:
                self.sent_as_stored[stored] = self.sent_as_stored.get(stored, 0) + 1
            else:
                self.uploaded[digest] = (blob, size)
        layer = Layer(blob, size, STORED_TYPES[stored] if stored else LAYER_TYPES[compression], stored is not None)
        self.layers[hexname] = layer
        return layer


def push_blobs(image: HeadImage, registry: Registry, compression: str = "zstd",
               progress: ProgressFn | None = None, state_dir: Path | None = None) -> PushResult:
    """Push without the engine: from `docker save`, each layer the registry lacks, zstd-compressed on every core."""
    if compression not in LAYER_TYPES:
        raise DistributeError(f"unknown compression {compression!r}; choose gzip, zstd or none", field="--compression")
    if compression == "zstd" and shutil.which("zstd") is None:
        raise DistributeError("the zstd command is not installed here (package zstd); install it, or push with "
                              "--compression gzip or none", field="--compression")
    t0 = time.monotonic()
    repo = image.repository
    client = RegistryClient(registry.endpoint, transfer_deadline=TRANSFER_TIMEOUT, window=PUSH_WINDOW)
    saved = _SavedImage(client, repo, compression, set(image.identity.layers), read_state(state_dir, repo)["blobs"])
    save = dockercli.start(["save", image.tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(TRANSFER_TIMEOUT, save.kill)  # a hung save or upload is stopped, not waited on
    watchdog.daemon = True
    watchdog.start()
    try:
        with tarfile.open(fileobj=save.stdout, mode="r|") as tar:
            for member in tar:
                layer = saved.take(tar, member)
                if layer and progress:
                    progress(Progress(registry.address, "push", saved.sent, None,
                                      f"layer {layer.digest[:19]} ({human_bytes(layer.size)})"))
        if save.wait(timeout=CONTROL_TIMEOUT) != 0 or saved.manifest is None:
            said = dockercli.last_line(save.stderr.read() if save.stderr else b"", "no message")
            raise DistributeError(f"docker save {image.tag} failed: {said}", field="docker")
        config, order = saved_image(image, saved.manifest, saved.small, saved.layers)
        refs, digest = _put_manifest(image, client, repo, config, order)
    except (OSError, tarfile.TarError, RegistryError, subprocess.TimeoutExpired) as exc:
        save.kill()
        save.wait()
        raise DistributeError(f"push to {registry.address} failed: {one_line(str(exc))[:200]}", field="--registry") from None
    finally:
        watchdog.cancel()
    with recording(state_dir, repo) as data:
        for d, (blob, size) in saved.uploaded.items():
            data["blobs"].setdefault(d, {})[compression] = [blob, size]
    record_manifest(state_dir, image.tag, digest, "sha256:" + hashlib.sha256(config).hexdigest(), image.image_id)
    distinct = len({layer.digest for layer in order})  # a layer may stand twice in an image (empty ones)
    return PushResult(tuple(refs), digest, distinct - saved.present, saved.present, saved.sent,
                      time.monotonic() - t0, tuple(sorted(saved.sent_as_stored.items())))


@dataclass(frozen=True)
class Layer:
    """A layer as the registry holds it."""

    digest: str
    size: int
    media_type: str
    as_stored: bool = False  # sent as the engine keeps it (compressed), so not named by its diff ID


SMALL_BLOB = 16 << 20  # a saved image's config and manifests: JSON of a few kB, a config with a long history more
STORED_TYPES = {"gzip": "application/vnd.oci.image.layer.v1.tar+gzip", "zstd": LAYER_TYPES["zstd"]}
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")
_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}


def stored_compression(head: bytes) -> str | None:
    """gzip or zstd when a blob starts with that format's magic number; None for a plain tar or JSON."""
    return next((name for name, magic in _MAGIC.items() if head.startswith(magic)), None)


def saved_image(image: HeadImage, saved_manifest: bytes, small: dict[str, bytes],
                 layers: dict[str, Layer]) -> tuple[bytes, list[Layer]]:
    """The config and the ordered layers of the saved image, as its manifest.json names them; checked against the
    diff IDs the head's engine reports, so a push never publishes another image under this tag."""
    def fail(why: str) -> DistributeError:
        return DistributeError(f"docker save {image.tag}: {why}", field="docker")

    try:
        entries = parse_json(saved_manifest)
        entry = next((e for e in entries if image.tag in (e.get("RepoTags") or [])), entries[0])
        config_name, layer_names = entry["Config"], entry["Layers"]
        if not isinstance(config_name, str) or not isinstance(layer_names, list):
            raise TypeError
    except (ValueError, LookupError, TypeError, AttributeError):
        raise fail("its manifest.json is not the one of a saved image") from None
    config = small.get(config_name.rpartition("/")[2])
    if config is None:
        raise fail(f"the config {config_name} is not in the saved image")
    try:
        diff_ids = parse_json(config)["rootfs"]["diff_ids"]
        if not isinstance(diff_ids, list):
            raise TypeError
    except (ValueError, LookupError, TypeError):
        raise fail(f"the config {config_name} names no layers") from None
    if diff_ids != list(image.identity.layers) or len(layer_names) != len(diff_ids):
        raise fail("its layers differ from the ones the engine reports for the image (was the tag moved meanwhile?)")
    order = []
    for name, diff_id in zip(layer_names, diff_ids):
        hexname = str(name).rpartition("/")[2]
        layer = layers.get(hexname)
        if layer is None:
            raise fail(f"the layer {name} is not in the saved image")
        if not layer.as_stored and f"sha256:{hexname}" != diff_id:  # an uncompressed layer is its diff ID
            raise fail(f"the layer {name} stands where the engine reports {diff_id}")
        order.append(layer)
    return config, order


def _put_manifest(image: HeadImage, client: RegistryClient, repo: str, config: bytes,
                  layers: list[Layer]) -> tuple[list[str], str | None]:
    """Upload the config, then the manifest under the immutable tag and (last) the moving tag."""
    config_digest = client.put_blob(repo, config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size} for layer in layers],
    }, separators=(",", ":")).encode()
    digest = None
    for ref in (image.tag, image.moving_tag):
        tag = ImageRef.parse(ref).tag
        if tag is None:
            raise DistributeError(f"{ref} names no tag to push the manifest under", field="docker")
        digest = client.put_manifest(repo, tag, manifest, OCI_MANIFEST)
    return [f"{client.endpoint.host}/{ref}" for ref in (image.tag, image.moving_tag)], digest


def _upload_layer(client: RegistryClient, repo: str, data: IO[bytes], compression: str,
                  diff_id: str) -> tuple[str, int]:
    """Stream one layer to the registry (one PATCH, chunked), compressing on the way; (its blob digest, size)."""
    size = 0
    hasher = hashlib.sha256()
    read, zstd = data.read, None
    if compression != "none":
        # zstd on every core; a thread feeds it the layer while this one uploads what comes out.
        zstd = dockercli.spawn(["zstd", "-T0", "-3", "-q", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        zstd_in, zstd_out = zstd.stdin, zstd.stdout
        assert zstd_in is not None and isinstance(zstd_out, io.BufferedReader)  # pipes, buffered by default
        read = zstd_out.read1

        def feed() -> None:
            try:
                shutil.copyfileobj(data, zstd_in, CHUNK)
            finally:
                zstd_in.close()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()

    def chunks() -> Iterator[bytes]:
        nonlocal size
        while block := read(CHUNK):
            if zstd is not None:  # only a compressed layer needs its digest computed
                hasher.update(block)
            size += len(block)
            yield block

    after = client.send_chunks(repo, client.start_upload(repo), chunks())
    if zstd is not None:
        feeder.join()
        if zstd.wait(timeout=CONTROL_TIMEOUT) != 0:
            raise DistributeError(f"zstd failed on layer {diff_id[:19]}", field="--compression")
    digest = diff_id if compression == "none" else "sha256:" + hasher.hexdigest()
    client.finish_upload(repo, after, digest)
    return digest, size
