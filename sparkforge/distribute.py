"""Distribute stage: get the tagged image onto every node, and prove they all run the same one.

Two ways to move an image, both parallel over the nodes and both skipping a node that already
has the head's image ID:

- registry: the head pushes the immutable and the moving tag to a registry
  (:func:`push_image`); every node pulls the immutable tag, so only the layers it lacks move.
- stream: for clusters without a registry, one ``docker save`` on the head is piped straight
  into ``docker load`` on every node that needs it. No temp file, but always the whole image.

On a node, the moving tag is set last, and only after the image ID there equals the head's.
A node that fails keeps its moving tag on its old image, and the other nodes go on.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

from .cluster import Node
from .errors import DistributeError
from .plan import Plan

UPDATED = "updated"
CURRENT = "current"
FAILED = "failed"

CONTROL_TIMEOUT = 20.0  # seconds for one API call (ping, inspect, tag)
TRANSFER_TIMEOUT = 600.0  # seconds of silence tolerated on a pull stream
CHUNK = 1 << 20


@dataclass(frozen=True)
class HeadImage:
    """The image on the head (the engine that built it), and the two names it goes by."""

    tag: str  # immutable, e.g. sparkforge/vllm:ng17e-0123456789ab
    moving_tag: str  # e.g. sparkforge/vllm:ng17e
    image_id: str
    size: int  # uncompressed bytes, as the engine reports

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
    image_id: str | None  # where the node's moving tag points after the deploy (as last seen)
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
class PushResult:
    refs: tuple[str, ...]
    digest: str | None  # the manifest digest the registry stored
    layers_pushed: int
    layers_present: int
    bytes_pushed: int  # as the engine reports its upload progress
    seconds: float


@dataclass(frozen=True)
class NodeStatus:
    node: Node
    moving_id: str | None  # what the moving tag points to on the node
    tag_id: str | None  # what the immutable tag points to
    error: str | None = None


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
        """Every node answered and its moving tag points at one ID (the head's, when known)."""
        if not self.nodes or any(n.error or n.moving_id is None for n in self.nodes) or len(self.ids) != 1:
            return False
        return self.image is None or self.ids == {self.image.image_id}


class NodeFailure(Exception):
    """A per-node failure; its message goes into the node's row, not out of the command."""


# ------------------------------------------------------------------------------------ head


def _docker():
    import docker

    return docker


def head_image(plan: Plan) -> HeadImage:
    """The image of a plan on the head engine; it must have been built (or loaded) here."""
    docker = _docker()
    try:
        client = docker.from_env(timeout=CONTROL_TIMEOUT)
        img = client.images.get(plan.tag)
    except docker.errors.ImageNotFound:
        raise DistributeError(f"image {plan.tag} is not on this machine; build it first with "
                              f"`python build.py build {plan.variant}`", field=plan.variant) from None
    except docker.errors.DockerException as exc:
        raise DistributeError(f"cannot reach the local Docker engine: {_reason(exc)} (run scripts/docker-up.sh)",
                              field="docker") from None
    return HeadImage(plan.tag, plan.moving_tag, img.id, int(img.attrs.get("Size") or 0))


def find_head_image(plan: Plan) -> HeadImage | None:
    try:
        return head_image(plan)
    except DistributeError:
        return None


def registry_ref(registry: str, ref: str) -> str:
    return f"{registry}/{ref}"


def push_image(image: HeadImage, registry: str, progress: ProgressFn | None = None) -> PushResult:
    """Push the immutable tag, then the moving tag, to registry (HOST:PORT)."""
    docker = _docker()
    t0 = time.monotonic()
    client = docker.from_env(timeout=TRANSFER_TIMEOUT)
    refs, digest = [], None
    pushed: dict[str, int] = {}
    present: set[str] = set()
    for ref in (image.tag, image.moving_tag):
        full = registry_ref(registry, ref)
        repo, _, tag = full.rpartition(":")
        try:
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
        except docker.errors.DockerException as exc:
            raise DistributeError(f"push of {full} failed: {_reason(exc)}", field="--registry") from None
        refs.append(full)
    present -= set(pushed)  # the moving tag's push finds every layer the first push sent
    return PushResult(tuple(refs), digest, len(pushed), len(present), sum(pushed.values()),
                      time.monotonic() - t0)


# ----------------------------------------------------------------------------------- nodes


def connect(node: Node, timeout: float = CONTROL_TIMEOUT):
    """A Docker SDK client for a node, checked with a ping."""
    docker = _docker()
    try:
        client = docker.DockerClient(base_url=node.endpoint, timeout=timeout,
                                     use_ssh_client=node.endpoint.startswith("ssh://"))
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure here means: not reachable
        raise NodeFailure(f"unreachable at {node.endpoint}: {_reason(exc)}") from None
    return client


def _image_id(client, ref: str) -> str | None:
    docker = _docker()
    try:
        return client.api.inspect_image(ref)["Id"]
    except docker.errors.ImageNotFound:
        return None


def _set_tags(client, image: HeadImage) -> bool:
    """Point the immutable tag, then the moving tag, at the head's image ID. True if one moved."""
    moved = False
    for ref in (image.tag, image.moving_tag):  # the moving tag last
        if _image_id(client, ref) != image.image_id:
            repo, _, tag = ref.rpartition(":")
            client.api.tag(image.image_id, repo, tag, force=True)
            moved = True
    return moved


def _check(client, image: HeadImage) -> tuple[str | None, bool]:
    """(where the moving tag points now, whether the node already has the head's image ID)."""
    return _image_id(client, image.moving_tag), _image_id(client, image.image_id) == image.image_id


def _verify_and_tag(client, image: HeadImage, ref: str) -> None:
    got = _image_id(client, ref)
    if got != image.image_id:
        raise NodeFailure(f"{ref} on the node is {(got or 'missing')[:19]}, not the head's {image.image_id[:19]}; "
                          "moving tag left where it was")
    _set_tags(client, image)


def _run_nodes(nodes: Iterable[Node], work: Callable[[Node], NodeResult]) -> tuple[NodeResult, ...]:
    nodes = list(nodes)
    if not nodes:
        return ()
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") as pool:
        return tuple(pool.map(work, nodes))


def _failed(node: Node, t0: float, exc: BaseException, previous: str | None, moved: int,
            progress: ProgressFn) -> NodeResult:
    reason = str(exc) if isinstance(exc, NodeFailure) else _reason(exc)
    progress(Progress(node.name, FAILED, moved, None, reason))
    return NodeResult(node, FAILED, previous, moved, time.monotonic() - t0, reason, previous)


def deploy_registry(image: HeadImage, nodes: Iterable[Node], registry: str,
                    progress: ProgressFn = lambda p: None) -> Deployment:
    """Every node pulls the immutable tag from the registry in parallel; see the module docstring."""
    t0 = time.monotonic()
    source = registry_ref(registry, image.tag)

    def one(node: Node) -> NodeResult:
        start, previous, moved = time.monotonic(), None, 0
        try:
            progress(Progress(node.name, "check"))
            client = connect(node)
            previous, has = _check(client, image)
            if has:
                _set_tags(client, image)
                progress(Progress(node.name, "done", 0, 0, "already current"))
                return NodeResult(node, CURRENT, image.image_id, 0, time.monotonic() - start, None, previous)
            pull_client = connect(node, TRANSFER_TIMEOUT)

            def seen(done: int, total: int | None, detail: str) -> None:
                nonlocal moved
                moved = done
                progress(Progress(node.name, "pull", done, total, detail))

            moved = _pull(pull_client, source, seen)
            progress(Progress(node.name, "verify", moved, moved))
            _verify_and_tag(client, image, source)
            progress(Progress(node.name, "done", moved, moved, "updated"))
            return NodeResult(node, UPDATED, image.image_id, moved, time.monotonic() - start, None, previous)
        except Exception as exc:  # noqa: BLE001 - one node's failure must not stop the others
            return _failed(node, start, exc, previous, moved, progress)

    results = _run_nodes(nodes, one)
    return Deployment(image, "registry", source, results, time.monotonic() - t0)


def _pull(client, ref: str, seen: Callable[[int, int | None, str], None]) -> int:
    """Pull ref, reporting progress; the bytes are the layer bytes the engine downloaded."""
    repo, _, tag = ref.rpartition(":")
    layers: dict[str, list[int]] = {}  # layer id -> [downloaded, size]
    present = 0
    try:
        events = client.api.pull(repo, tag=tag, stream=True, decode=True)
    except _docker().errors.APIError as exc:  # the engine could not even fetch the manifest
        raise NodeFailure(f"pull of {ref} failed: {_reason(exc)}") from None
    for ev in events:
        if "error" in ev:
            raise NodeFailure(f"pull of {ref} failed: {_clean(ev['error'])}")
        status, lid = ev.get("status", ""), ev.get("id")
        if not lid or lid == tag:
            continue
        if status == "Pulling fs layer":
            layers.setdefault(lid, [0, 0])
        elif status == "Already exists":
            present += 1
        elif status == "Downloading":
            detail = ev.get("progressDetail") or {}
            layer = layers.setdefault(lid, [0, 0])
            layer[0] = max(layer[0], int(detail.get("current") or 0))
            layer[1] = max(layer[1], int(detail.get("total") or 0))
        elif status in ("Download complete", "Verifying Checksum") and lid in layers:
            layers[lid][0] = max(layers[lid])
        else:
            continue
        done = sum(d for d, _ in layers.values())
        total = sum(max(d, s) for d, s in layers.values())
        complete = sum(1 for d, s in layers.values() if s and d >= s)
        seen(done, total, f"{complete}/{len(layers)} layers downloaded, {present} already there")
    return sum(d for d, _ in layers.values())


def deploy_stream(image: HeadImage, nodes: Iterable[Node], progress: ProgressFn = lambda p: None,
                  docker_cli: str = "docker") -> Deployment:
    """One `docker save` on the head, piped into `docker load` on each node that needs it."""
    t0 = time.monotonic()
    nodes = list(nodes)
    checked: dict[str, tuple[object, str | None, bool] | BaseException] = {}

    def check(node: Node) -> NodeResult:
        start = time.monotonic()
        try:
            progress(Progress(node.name, "check"))
            client = connect(node)
            previous, has = _check(client, image)
            checked[node.name] = (client, previous, has)
            if has:
                _set_tags(client, image)
                progress(Progress(node.name, "done", 0, 0, "already current"))
                return NodeResult(node, CURRENT, image.image_id, 0, time.monotonic() - start, None, previous)
        except Exception as exc:  # noqa: BLE001
            checked[node.name] = exc
            return _failed(node, start, exc, None, 0, progress)
        return NodeResult(node, "pending", previous, 0, time.monotonic() - start)

    first = {r.node.name: r for r in _run_nodes(nodes, check)}
    todo = [n for n in nodes if first[n.name].outcome == "pending"]
    streamed = _stream(image, todo, progress, docker_cli) if todo else {}

    def finish(node: Node) -> NodeResult:
        head = first[node.name]
        if head.outcome != "pending":
            return head
        client, previous, _ = checked[node.name]  # type: ignore[misc]
        moved, started, error = streamed[node.name]
        try:
            if error:
                raise NodeFailure(error)
            progress(Progress(node.name, "verify", moved, moved))
            _verify_and_tag(client, image, image.tag)
            progress(Progress(node.name, "done", moved, moved, "updated"))
            return NodeResult(node, UPDATED, image.image_id, moved, time.monotonic() - started, None, previous)
        except Exception as exc:  # noqa: BLE001
            return _failed(node, started, exc, previous, moved, progress)

    results = _run_nodes(nodes, finish)
    return Deployment(image, "stream", f"docker save {image.tag}", results, time.monotonic() - t0)


def _cli_env() -> dict[str, str]:
    # -H names the node; a DOCKER_CONTEXT would otherwise be refused next to it.
    return {k: v for k, v in os.environ.items() if k != "DOCKER_CONTEXT"}


def _stream(image: HeadImage, nodes: list[Node], progress: ProgressFn,
            docker_cli: str) -> dict[str, tuple[int, float, str | None]]:
    """Tee one `docker save` into a `docker load` per node. Returns name -> (bytes, start, error)."""
    started = time.monotonic()
    env = _cli_env()
    save = subprocess.Popen([docker_cli, "save", image.tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    loaders: dict[str, subprocess.Popen] = {}
    sent = {n.name: 0 for n in nodes}
    errors: dict[str, str] = {}
    for node in nodes:
        loaders[node.name] = subprocess.Popen([docker_cli, "-H", node.endpoint, "load", "-q"],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, env=env)
    stderr_of: dict[str, bytes] = {}

    def drain(name: str, proc: subprocess.Popen) -> None:
        # Read a loader's stderr while it runs, so a chatty one never blocks on a full pipe.
        assert proc.stderr is not None
        stderr_of[name] = proc.stderr.read()

    drains = [threading.Thread(target=drain, args=(n, p), daemon=True) for n, p in loaders.items()]
    for t in drains:
        t.start()
    save_err: list[bytes] = []
    save_drain = threading.Thread(target=lambda: save_err.append(save.stderr.read()), daemon=True)  # type: ignore
    save_drain.start()
    last = 0.0
    assert save.stdout is not None
    while True:
        chunk = save.stdout.read1(CHUNK) if hasattr(save.stdout, "read1") else save.stdout.read(CHUNK)
        if not chunk:
            break
        for name, proc in loaders.items():
            if name in errors:
                continue
            try:
                proc.stdin.write(chunk)  # type: ignore[union-attr]
                sent[name] += len(chunk)
            except (BrokenPipeError, OSError):
                errors[name] = "stream interrupted: the node's docker load stopped reading"
        now = time.monotonic()
        if now - last > 0.5:
            last = now
            for name in loaders:
                if name not in errors:
                    progress(Progress(name, "load", sent[name], image.size or None))
        if len(errors) == len(loaders):
            save.kill()
            break
    code = save.wait()
    save_drain.join(5)
    if code != 0:
        why = (b"".join(save_err).decode(errors="replace").strip().splitlines() or [f"exit code {code}"])[-1]
        # A truncated stream must never be committed: stop every load before its input ends.
        for name, proc in loaders.items():
            proc.kill()
            errors.setdefault(name, f"stream interrupted: docker save on the head failed: {_clean(why)}")
    for name, proc in loaders.items():
        try:
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
    result = {}
    for (name, proc), t in zip(loaders.items(), drains):
        code = proc.wait()
        t.join(5)
        if code != 0 and name not in errors:
            msg = stderr_of.get(name, b"").decode(errors="replace").strip().splitlines()
            errors[name] = f"docker load failed: {_clean(msg[-1] if msg else f'exit code {code}')}"
        elif code != 0:
            msg = stderr_of.get(name, b"").decode(errors="replace").strip().splitlines()
            if msg and "killed" not in errors[name]:
                errors[name] += f" ({_clean(msg[-1])})"
        result[name] = (sent[name], started, errors.get(name))
    return result


def cluster_status(plan: Plan, nodes: Iterable[Node]) -> ClusterStatus:
    """Which image each node's tags point to, compared with the head's (when it has it)."""
    image = find_head_image(plan)

    def one(node: Node) -> NodeStatus:
        try:
            client = connect(node)
            return NodeStatus(node, _image_id(client, plan.moving_tag), _image_id(client, plan.tag))
        except Exception as exc:  # noqa: BLE001
            return NodeStatus(node, None, None, str(exc) if isinstance(exc, NodeFailure) else _reason(exc))

    nodes = list(nodes)
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        found = tuple(pool.map(one, nodes))
    return ClusterStatus(image, plan.tag, plan.moving_tag, found)


# ---------------------------------------------------------------------------------- helpers


def _clean(text: str) -> str:
    return " ".join(str(text).split())


def _reason(exc: BaseException) -> str:
    """One readable line for an SDK or transport error."""
    docker = _docker()
    if isinstance(exc, docker.errors.APIError) and exc.explanation:
        return _clean(exc.explanation)
    text = _clean(str(exc)) or type(exc).__name__
    for marker in ("Connection refused", "No such file or directory", "timed out", "Connection aborted",
                   "Connection reset", "Name or service not known", "Remote end closed"):
        if marker in text:
            return f"{marker.lower()} ({type(exc).__name__})"
    return text[:300]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"
