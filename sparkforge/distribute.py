"""Distribute stage: get the tagged image onto every node, and prove they all run the same one.

Two ways to move an image, both parallel over the nodes and both skipping a node that already
has the head's image:

- registry: the head pushes the immutable and the moving tag to a registry
  (:func:`push_image`); every node pulls the immutable tag, so only the layers it lacks move.
- stream: for clusters without a registry, one ``docker save`` on the head is piped into
  ``docker load`` on every node that needs it, one writer per node (:mod:`.stream`).

"The same image" is decided by what every image store agrees on (:func:`same_image`): the
ordered layer diff IDs, and the config digest or a manifest digest recorded on the head. An
image ID alone is not enough: the classic store's ID is the config digest, the containerd
store's is the manifest digest. On a node, the moving tag is set last, only after the image
there is the head's; a node that fails keeps its moving tag on its old image.
"""

from __future__ import annotations

import json
import shutil
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from .cluster import (CONTROL_TIMEOUT, Node, NodeFailure, Registry, _clean, _last_line, cli_env, docker_argv,
                      layer_sizes, ping, pull, registry_context, run_docker, run_nodes, transport_error)
from . import dockercli
from .errors import DistributeError
from .plan import PROJECT_ROOT, Plan

UPDATED = "updated"
CURRENT = "current"
FAILED = "failed"

TRANSFER_TIMEOUT = 3600.0  # seconds a whole push may take
STATE_DIR = PROJECT_ROOT / "build" / "distribute"

__all__ = ["NodeFailure"]


@dataclass(frozen=True)
class ImageIdentity:
    """What names one image on every image store: config digest, manifest digests, layer diff IDs."""

    config: str | None  # the config digest (the image ID on a classic-store engine)
    manifests: frozenset[str]  # manifest digests it is known by: registry pushes, docker save
    layers: tuple[str, ...]  # RootFS.Layers, in order


@dataclass(frozen=True)
class NodeImage:
    """One image as an engine's `docker image inspect` shows it."""

    id: str
    digests: frozenset[str]  # the digest part of each RepoDigests entry
    layers: tuple[str, ...]

    @classmethod
    def from_inspect(cls, data: dict) -> "NodeImage":
        digests = frozenset(d.rpartition("@")[2] for d in data.get("RepoDigests") or [] if "@" in d)
        return cls(data["Id"], digests, tuple((data.get("RootFS") or {}).get("Layers") or ()))


def same_image(head: ImageIdentity, node: NodeImage) -> bool:
    """True when a node's image is the head's, on either image store; never by image ID alone."""
    if not head.layers or node.layers != head.layers:
        return False
    if head.config is not None and node.id == head.config:  # classic store: the ID is the config digest
        return True
    # containerd store: the ID is a manifest digest (pulled: the registry's; loaded: the tarball's)
    return node.id in head.manifests or bool(node.digests & head.manifests)


@dataclass(frozen=True)
class HeadImage:
    """The image on the head (the engine that built it), the two names it goes by, and its identity."""

    tag: str  # immutable, e.g. sparkforge/vllm:ng17e-0123456789ab
    moving_tag: str  # e.g. sparkforge/vllm:ng17e
    image_id: str
    size: int  # uncompressed bytes, as the engine reports
    identity: ImageIdentity

    @property
    def repository(self) -> str:
        return self.tag.rpartition(":")[0]


@dataclass(frozen=True)
class Progress:
    """One progress report of one node, sent from that node's worker thread."""

    node: str
    phase: str  # check, pull, load, verify, done, failed
    done: int = 0  # bytes moved so far
    total: int | None = None  # bytes to move, when known
    detail: str = ""


ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class NodeResult:
    """What a deploy did on one node."""

    node: Node
    outcome: str  # updated, current or failed
    image_id: str | None  # the node's own ID of the image its moving tag points to after the deploy
    bytes_moved: int
    seconds: float
    error: str | None = None
    previous_id: str | None = None  # where the moving tag pointed before


@dataclass(frozen=True)
class Deployment:
    image: HeadImage
    mode: str  # registry or stream
    source: str  # the registry reference pulled, or "docker save"
    results: tuple[NodeResult, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.outcome != FAILED for r in self.results)

    @property
    def bytes_moved(self) -> int:
        return sum(r.bytes_moved for r in self.results)


@dataclass(frozen=True)
class NodeStatus:
    node: Node
    moving_id: str | None  # the node's own ID of what the moving tag points to
    tag_id: str | None  # the node's own ID of what the immutable tag points to
    error: str | None = None
    current: bool = False  # the moving tag points to the head's image (by identity)
    tag_current: bool = False  # the immutable tag does


@dataclass(frozen=True)
class ClusterStatus:
    image: HeadImage | None  # None when the head does not have the image
    tag: str
    moving_tag: str
    nodes: tuple[NodeStatus, ...]

    @property
    def ids(self) -> set[str | None]:
        return {n.moving_id for n in self.nodes}

    @property
    def all_match(self) -> bool:
        """Every node answered and its moving tag points to the head's image (or, without it, one ID)."""
        if not self.nodes or any(n.error or n.moving_id is None for n in self.nodes):
            return False
        if self.image is None:
            return len(self.ids) == 1
        return all(n.current for n in self.nodes)


# ----------------------------------------------------------------------------- the record


def _state_file(state_dir: Path | None, repository: str) -> Path:
    return (state_dir or STATE_DIR) / (repository.replace("/", "_") + ".json")


def read_state(state_dir: Path | None, repository: str) -> dict:
    """The head's record of a repository: manifest digests per tag, and deploys per node."""
    path = _state_file(state_dir, repository)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"manifests": {}, "deploys": {}}
    except (OSError, ValueError) as exc:
        raise DistributeError(f"unreadable deploy record: {exc}", path=path) from None
    data.setdefault("manifests", {})
    data.setdefault("deploys", {})
    return data


def _update_state(state_dir: Path | None, repository: str, change: Callable[[dict], None]) -> None:
    path = _state_file(state_dir, repository)
    data = read_state(state_dir, repository)
    change(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # a crash never leaves half a record


def record_manifest(state_dir: Path | None, tag: str, digest: str) -> None:
    """Remember a manifest digest the image of tag is known by (from a push or a docker save)."""
    repo = tag.rpartition(":")[0]

    def add(data: dict) -> None:
        known = data["manifests"].setdefault(tag, [])
        if digest not in known:
            known.append(digest)

    _update_state(state_dir, repo, add)


def record_deploy(state_dir: Path | None, image: HeadImage, results: Iterable[NodeResult]) -> None:
    """Append, per node that now runs it, the tag deployed and when."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def add(data: dict) -> None:
        for r in results:
            if r.outcome == FAILED:
                continue
            past = data["deploys"].setdefault(r.node.name, [])
            if not past or past[-1]["tag"] != image.tag:
                past.append({"tag": image.tag, "at": now})

    _update_state(state_dir, image.repository, add)


# ------------------------------------------------------------------------------------ head


def _inspect_head(ref: str) -> dict | None:
    try:
        proc = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=CONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise DistributeError(f"the local Docker engine gave no answer within {CONTROL_TIMEOUT:.0f}s",
                              field="docker") from None
    except OSError as exc:
        raise DistributeError(f"cannot run docker: {exc.strerror}", field="docker") from None
    if proc.returncode != 0:
        text = proc.stderr.decode(errors="replace")
        if "No such image" in text:
            return None
        raise DistributeError(f"cannot reach the local Docker engine: {_clean(text)[:200]}", field="docker")
    return json.loads(proc.stdout)[0]


def head_image(plan: Plan, state_dir: Path | None = None, tag: str | None = None) -> HeadImage:
    """The image of a plan (or an older build, by its tag) on the head engine; it must be here."""
    tag = tag or plan.tag
    data = _inspect_head(tag)
    if data is None:
        raise DistributeError(f"image {tag} is not on this machine; build it first with "
                              f"`python build.py build {plan.variant}`", field=plan.variant)
    own = NodeImage.from_inspect(data)
    recorded = read_state(state_dir, tag.rpartition(":")[0])["manifests"].get(tag, [])
    # The head's ID is its config digest on the classic store, a manifest digest on containerd:
    # either way a node showing it has the same image, so it goes in both places.
    identity = ImageIdentity(own.id, frozenset(recorded) | own.digests | {own.id}, own.layers)
    return HeadImage(tag, plan.moving_tag, own.id, int(data.get("Size") or 0), identity)


@dataclass(frozen=True)
class Build:
    """One immutable tag of a variant on the head: when it was built, its vLLM and mods, where it went."""

    tag: str
    image_id: str
    created: str
    vllm: str
    mods: str
    nodes: tuple[str, ...]  # nodes whose last recorded deploy was this tag


def builds(plan: Plan, state_dir: Path | None = None) -> list[Build]:
    """The builds of a variant on the head, newest first (by creation time)."""
    repo = plan.tag.rpartition(":")[0]
    prefix = f"{repo}:{plan.variant}-"
    try:
        proc = subprocess.run(["docker", "images", repo, "--format", "{{.Repository}}:{{.Tag}}"],
                              capture_output=True, text=True, timeout=CONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise DistributeError("the local Docker engine gave no answer", field="docker") from None
    tags = [t for t in proc.stdout.split() if t.startswith(prefix) and t[len(prefix):].isalnum()]
    deploys = read_state(state_dir, repo)["deploys"]
    last = {node: past[-1]["tag"] for node, past in deploys.items() if past}
    found = []
    for tag in tags:
        data = _inspect_head(tag)
        if data is None:
            continue
        labels = (data.get("Config") or {}).get("Labels") or {}
        found.append(Build(tag, data["Id"], data.get("Created", "")[:19].replace("T", " "),
                           labels.get("org.opencontainers.image.version", "-"), labels.get("io.sparkforge.mods", "-"),
                           tuple(sorted(n for n, t in last.items() if t == tag))))
    return sorted(found, key=lambda b: b.created, reverse=True)


def rollback_tag(plan: Plan, to: str | None, previous: bool, nodes: Iterable[Node],
                 state_dir: Path | None = None) -> str:
    """The tag a `deploy --to TAG` or `--previous` goes to; refused unless it is a build on the head."""
    repo = plan.tag.rpartition(":")[0]
    if to:
        tag = to if ":" in to else f"{repo}:{to}"
        if _inspect_head(tag) is None:
            raise DistributeError(f"no build {tag} on this machine (see `python build.py history {plan.variant}`)",
                                  field="--to")
        return tag
    deploys = read_state(state_dir, repo)["deploys"]
    # The tag the nodes ran before their current one, from the head's deploy record.
    befores = set()
    for node in nodes:
        tags = [d["tag"] for d in deploys.get(node.name, [])]
        if len(tags) >= 2:
            befores.add(tags[-2])
    if len(befores) != 1:
        raise DistributeError("the nodes have no single previous deploy in the record; name one with --to TAG "
                              f"(see `python build.py history {plan.variant}`)", field="--previous")
    return befores.pop()


def find_head_image(plan: Plan, state_dir: Path | None = None) -> HeadImage | None:
    try:
        return head_image(plan, state_dir)
    except DistributeError:
        return None


def registry_ref(registry: str, ref: str) -> str:
    return f"{registry}/{ref}"


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
        raise DistributeError(f"docker save {image.tag} failed: {_last_line(save.stderr.read() if save.stderr else b'')}",
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


# ----------------------------------------------------------------------------------- nodes


def inspect(node: Node, ref: str) -> NodeImage | None:
    """The image a reference names on a node, or None when there is none."""
    proc = run_docker(node, "image", "inspect", ref, timeout=CONTROL_TIMEOUT)
    if proc.returncode != 0:
        text = proc.stderr.decode(errors="replace")
        if "No such image" in text or "not found" in text.lower():
            return None
        raise NodeFailure(f"inspect of {ref} failed: {_last_line(proc.stderr)}")
    return NodeImage.from_inspect(json.loads(proc.stdout)[0])


def set_tags(node: Node, node_id: str, image: HeadImage) -> None:
    """Point the immutable tag, then (last) the moving tag, at the node's copy of the image."""
    for ref in (image.tag, image.moving_tag):
        proc = run_docker(node, "tag", node_id, ref, timeout=CONTROL_TIMEOUT)
        if proc.returncode != 0:
            raise NodeFailure(f"tagging {ref} failed: {_last_line(proc.stderr)}")


def verify_and_tag(node: Node, image: HeadImage, ref: str) -> NodeImage:
    """Check that ref on the node is the head's image, then move the tags to it."""
    got = inspect(node, ref)
    if got is None or not same_image(image.identity, got):
        shown = got.id[:19] if got else "missing"
        raise NodeFailure(f"{ref} on the node is {shown}, not the head's image {image.image_id[:19]} "
                          "(layers or digests differ); moving tag left where it was")
    set_tags(node, got.id, image)
    return got


def check_node(node: Node, image: HeadImage) -> tuple[NodeImage | None, NodeImage | None]:
    """(the image the moving tag points to, the immutable tag's image when it is the head's)."""
    ping(node)
    previous = inspect(node, image.moving_tag)
    have = previous if previous is not None and same_image(image.identity, previous) else inspect(node, image.tag)
    return previous, have if have is not None and same_image(image.identity, have) else None


def failed(node: Node, t0: float, exc: BaseException, previous: str | None, moved: int,
           progress: ProgressFn) -> NodeResult:
    reason = str(exc) if isinstance(exc, DistributeError) else _clean(f"{type(exc).__name__}: {exc}")
    progress(Progress(node.name, FAILED, moved, None, reason))
    return NodeResult(node, FAILED, previous, moved, time.monotonic() - t0, reason, previous)


def deploy_registry(image: HeadImage, nodes: Iterable[Node], registry: str | Registry,
                    progress: ProgressFn = lambda p: None, state_dir: Path | None = None) -> Deployment:
    """Every node pulls the immutable tag from the registry in parallel; see the module docstring."""
    t0 = time.monotonic()
    reg = registry if isinstance(registry, Registry) else Registry(registry, "")
    source = registry_ref(reg.address, image.tag)
    sizes = layer_sizes(reg, image.tag)

    def one(node: Node) -> NodeResult:
        start, previous, moved = time.monotonic(), None, 0
        try:
            progress(Progress(node.name, "check"))
            before, have = check_node(node, image)
            previous = before.id if before else None
            if have is not None:
                set_tags(node, have.id, image)
                progress(Progress(node.name, "done", 0, 0, "already current"))
                return NodeResult(node, CURRENT, have.id, 0, time.monotonic() - start, None, previous)

            def seen(done: int, detail: str) -> None:
                nonlocal moved
                moved = done
                progress(Progress(node.name, "pull", done, sum(sizes.values()) or None, detail))

            moved = pull(node, source, sizes, seen)
            progress(Progress(node.name, "verify", moved, moved))
            got = verify_and_tag(node, image, source)
            progress(Progress(node.name, "done", moved, moved, "updated"))
            return NodeResult(node, UPDATED, got.id, moved, time.monotonic() - start, None, previous)
        except Exception as exc:  # noqa: BLE001 - one node's failure must not stop the others
            return failed(node, start, exc, previous, moved, progress)

    results = run_nodes(nodes, one)
    record_deploy(state_dir, image, results)
    return Deployment(image, "registry", source, results, time.monotonic() - t0)


# ---------------------------------------------------------------------------------- stream

STALL_TIMEOUT = 60.0  # seconds a node's docker load may take nothing before it is dropped
LOAD_TIMEOUT = 900.0  # seconds a docker load may take to finish after its input ended
BUFFER_CHUNKS = 32  # chunks held per node: a short hiccup of one node does not slow the others
CHUNK = 1 << 20


class _TarIndex:
    """Follows the headers of a `docker save` tar stream to catch its index.json on the way.

    A containerd-store node shows the manifest digest named there as the image ID of what it
    loaded, so the head records it as one more name of the image.
    """

    def __init__(self) -> None:
        self.header = bytearray()
        self.skip = 0  # bytes of the current member (and its padding) still to pass
        self.keep = 0  # of those, bytes of index.json still to keep
        self.index = bytearray()
        self.manifest: str | None = None
        self.ended = False

    def feed(self, chunk: bytes) -> None:
        i, n = 0, len(chunk)
        while i < n and not self.ended:
            if self.skip:
                take = min(self.skip, n - i)
                if self.keep:
                    part = chunk[i:i + min(take, self.keep)]
                    self.index += part
                    self.keep -= len(part)
                    if not self.keep:
                        self._parse()
                self.skip -= take
                i += take
                continue
            take = min(512 - len(self.header), n - i)
            self.header += chunk[i:i + take]
            i += take
            if len(self.header) == 512:
                self._member(bytes(self.header))
                self.header.clear()

    def _member(self, h: bytes) -> None:
        if not h.strip(b"\0"):
            self.ended = True
            return
        raw = h[124:136]
        # Members over 8 GiB (big layers) carry their size in base-256.
        size = int.from_bytes(raw[1:], "big") if raw[0] & 0x80 else int(raw.strip(b"\0 ") or b"0", 8)
        name = h[:100].split(b"\0", 1)[0]
        self.skip = (size + 511) // 512 * 512
        if name == b"index.json" and h[156:157] in (b"0", b"\0"):
            self.index.clear()
            self.keep = size

    def _parse(self) -> None:
        try:
            manifests = json.loads(bytes(self.index)).get("manifests") or []
        except ValueError:
            return
        if len(manifests) == 1:
            self.manifest = manifests[0].get("digest")


class _Writer(threading.Thread):
    """Feeds one node's `docker load` from its own bounded queue, so a slow node holds up nobody."""

    def __init__(self, node: Node, proc: subprocess.Popen):
        super().__init__(name=f"stream-{node.name}", daemon=True)
        self.node, self.proc = node, proc
        self.queue: queue.Queue[bytes | None] = queue.Queue(BUFFER_CHUNKS)
        self.sent = 0
        self.last = time.monotonic()  # when the node last took a chunk
        self.error: str | None = None
        self.stderr = b""
        self.drain = threading.Thread(target=self._read_stderr, daemon=True)

    def _read_stderr(self) -> None:
        # Read the loader's stderr while it runs, so a chatty one never blocks on a full pipe.
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def run(self) -> None:
        assert self.proc.stdin is not None
        while (chunk := self.queue.get()) is not None:
            try:
                self.proc.stdin.write(chunk)
            except (OSError, ValueError):
                self.error = self.error or "stream interrupted: the node's docker load stopped reading"
                return
            self.sent += len(chunk)
            self.last = time.monotonic()
        try:
            self.proc.stdin.close()
        except OSError:
            self.error = self.error or "stream interrupted: the node's docker load stopped reading"

    def offer(self, chunk: bytes | None, stall: float) -> bool:
        """Queue a chunk; False when the node is gone or took nothing for `stall` seconds."""
        while self.error is None:
            try:
                self.queue.put(chunk, timeout=0.2)
                return True
            except queue.Full:
                if self.error is None and time.monotonic() - self.last > stall:
                    self.drop(f"stalled: its docker load took no data for {stall:.0f}s; dropped, the others went on")
        return False

    def drop(self, why: str) -> None:
        """Stop this node's load before its input ends, so a cut stream is never committed."""
        self.error = self.error or why
        self.proc.kill()


def deploy_stream(image: HeadImage, nodes: Iterable[Node], progress: ProgressFn = lambda p: None,
                  state_dir: Path | None = None,
                  stall_timeout: float = STALL_TIMEOUT) -> Deployment:
    """One `docker save` on the head, piped into `docker load` on each node that needs it."""
    t0 = time.monotonic()
    nodes = list(nodes)
    checked: dict[str, str | None] = {}

    def check(node: Node) -> NodeResult:
        start = time.monotonic()
        try:
            progress(Progress(node.name, "check"))
            before, have = check_node(node, image)
            checked[node.name] = before.id if before else None
            if have is not None:
                set_tags(node, have.id, image)
                progress(Progress(node.name, "done", 0, 0, "already current"))
                return NodeResult(node, CURRENT, have.id, 0, time.monotonic() - start, None, checked[node.name])
        except Exception as exc:  # noqa: BLE001
            return failed(node, start, exc, None, 0, progress)
        return NodeResult(node, "pending", checked[node.name], 0, time.monotonic() - start)

    first = {r.node.name: r for r in run_nodes(nodes, check)}
    todo = [n for n in nodes if first[n.name].outcome == "pending"]
    streamed, manifest = _stream(image, todo, progress, stall_timeout) if todo else ({}, None)
    if manifest:
        record_manifest(state_dir, image.tag, manifest)
        image = replace(image, identity=replace(image.identity, manifests=image.identity.manifests | {manifest}))

    def finish(node: Node) -> NodeResult:
        head = first[node.name]
        if head.outcome != "pending":
            return head
        previous = checked[node.name]
        moved, started, error = streamed[node.name]
        try:
            if error:
                raise NodeFailure(error)
            progress(Progress(node.name, "verify", moved, moved))
            got = verify_and_tag(node, image, image.tag)
            progress(Progress(node.name, "done", moved, moved, "updated"))
            return NodeResult(node, UPDATED, got.id, moved, time.monotonic() - started, None, previous)
        except Exception as exc:  # noqa: BLE001
            return failed(node, started, exc, previous, moved, progress)

    results = run_nodes(nodes, finish)
    record_deploy(state_dir, image, results)
    return Deployment(image, "stream", f"docker save {image.tag}", results, time.monotonic() - t0)


def _stream(image: HeadImage, nodes: list[Node], progress: ProgressFn, stall: float) -> tuple[dict[str, tuple[int, float, str | None]], str | None]:
    """Tee one `docker save` into a `docker load` per node, one writer thread each.

    Returns name -> (bytes, start, error), and the manifest digest of the saved tarball.
    """
    started = time.monotonic()
    env = cli_env()
    try:
        save = dockercli.track(subprocess.Popen(["docker", "save", image.tag], stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, env=env))
    except OSError as exc:
        raise DistributeError(f"cannot run docker: {exc.strerror}", field="docker") from None
    # A save that hangs would hold every node: it gets as long as a whole transfer, then is stopped.
    watchdog = threading.Timer(TRANSFER_TIMEOUT, save.kill)
    watchdog.daemon = True
    watchdog.start()
    writers = []
    for node in nodes:
        # Tracked: Ctrl-C or SIGTERM on the head stops every load (a node keeps its old image).
        proc = dockercli.track(subprocess.Popen(docker_argv(node, "load", "-q"), stdin=subprocess.PIPE,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env))
        writers.append(_Writer(node, proc))
    for w in writers:
        w.start()
        w.drain.start()
    save_err: list[bytes] = []
    save_drain = threading.Thread(target=lambda: save_err.append(save.stderr.read()), daemon=True)  # type: ignore
    save_drain.start()
    index, last = _TarIndex(), 0.0
    assert save.stdout is not None
    while chunk := save.stdout.read1(CHUNK):
        index.feed(chunk)
        live = [w for w in writers if w.error is None]
        for w in live:
            w.offer(chunk, stall)
        if not any(w.error is None for w in writers):
            save.kill()
            break
        if time.monotonic() - last > 0.5:
            last = time.monotonic()
            for w in writers:
                if w.error is None:
                    progress(Progress(w.node.name, "load", w.sent, image.size or None))
    code = save.wait()
    watchdog.cancel()
    save_drain.join(5)
    if code != 0:
        why = _last_line(b"".join(save_err)) if save_err and save_err[0] else f"exit code {code}"
        for w in writers:
            w.drop(f"stream interrupted: docker save on the head failed: {why}")
    for w in writers:
        w.offer(None, stall)  # end of input: the load may commit now
    result = {}
    deadline = time.monotonic() + LOAD_TIMEOUT
    for w in writers:
        try:
            rc = w.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.drop(f"docker load did not finish within {LOAD_TIMEOUT:.0f}s")
            rc = w.proc.wait()
        w.join(10)
        w.drain.join(10)
        if rc != 0 and w.error is None:
            w.error = f"docker load failed: {transport_error(w.node, rc, w.stderr.decode(errors='replace')) or _last_line(w.stderr)}"
        result[w.node.name] = (w.sent, started, w.error)
    return result, index.manifest if code == 0 else None


def cluster_status(plan: Plan, nodes: Iterable[Node], state_dir: Path | None = None) -> ClusterStatus:
    """Which image each node's tags point to, compared with the head's (when it has it)."""
    image = find_head_image(plan, state_dir)

    def one(node: Node) -> NodeStatus:
        try:
            ping(node)
            moving, tagged = inspect(node, plan.moving_tag), inspect(node, plan.tag)
        except DistributeError as exc:
            return NodeStatus(node, None, None, str(exc))
        ident = image.identity if image else None
        return NodeStatus(node, moving.id if moving else None, tagged.id if tagged else None, None,
                          bool(ident and moving and same_image(ident, moving)),
                          bool(ident and tagged and same_image(ident, tagged)))

    return ClusterStatus(image, plan.tag, plan.moving_tag, run_nodes(nodes, one))


# ---------------------------------------------------------------------------------- helpers


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"
