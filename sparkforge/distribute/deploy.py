"""The deploy loop: check, move (:class:`Transfer`), verify and tag the head's image on every node at once; the
moving tag is set last, only after a node's image is the head's, so a node that fails keeps it on its old image."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from collections.abc import Callable, Iterable

from ..build.dockercli import last_line
from ..errors import DistributeError
from ..imageref import ImageRef
from ..net import time_left
from ..recipe.plan import Plan
from .cluster import Node, Registry
from .images import HeadImage, image_on_head, inspect, read_state, recording, same_image
from .nodes import (CONTROL_TIMEOUT, PULL_STALL_TIMEOUT, NodeFailure, layer_sizes, one_line, pull, run_dockers,
                    run_nodes)


class Outcome(str, Enum):
    """What a deploy did on one node."""

    UPDATED = "updated"  # the image moved to the node, and its tags point to it now
    CURRENT = "current"  # the node had the image already; its tags point to it now
    FAILED = "failed"  # the node keeps its moving tag where it was

    def __str__(self) -> str:
        return self.value


UPDATED, CURRENT, FAILED = Outcome.UPDATED, Outcome.CURRENT, Outcome.FAILED

CHUNK = 1 << 20  # bytes read at a time from a docker save


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
    outcome: Outcome
    image_id: str | None  # the node's own ID of the image its moving tag points to after the deploy
    bytes_moved: int
    seconds: float
    error: str | None = None
    previous_id: str | None = None  # where the moving tag pointed before


@dataclass(frozen=True)
class Deployment:
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

    @property
    def tag_state(self) -> str | None:
        """Where the immutable tag points: "yes" (the head's or the moving tag's image), "other", "no", or None."""
        if self.error:
            return None
        if self.tag_current or (self.tag_id and self.tag_id == self.moving_id):
            return "yes"
        return "other" if self.tag_id else "no"


@dataclass(frozen=True)
class ClusterStatus:
    image: HeadImage | None  # None when the head does not have the image
    tag: str  # the build the nodes are compared with: the one the last deploy set, else the plan's
    moving_tag: str
    nodes: tuple[NodeStatus, ...]
    newest: str = ""  # the plan's own tag, when it is not the one compared with

    @property
    def ids(self) -> set[str]:
        """The images the nodes that answered hold under the moving tag."""
        return {n.moving_id for n in self.nodes if n.moving_id and not n.error}

    @property
    def all_match(self) -> bool:
        """Every node answered and its moving tag points to the head's image (or, without it, one ID)."""
        if not self.nodes or any(n.error or n.moving_id is None for n in self.nodes):
            return False
        return len(self.ids) == 1 if self.image is None else all(n.current for n in self.nodes)


def set_tags(node: Node, source: str, image: HeadImage, *then: tuple[str, ...]) -> str:
    """Point the immutable tag, then (last) the moving tag, at source on the node and run `then`; what that printed."""
    proc = run_dockers(node, [("tag", source, image.tag), ("tag", source, image.moving_tag), *then],
                       timeout=CONTROL_TIMEOUT)
    if proc.returncode != 0:
        raise NodeFailure(f"tagging {image.tag}, then {image.moving_tag}, failed: "
                          f"{last_line(proc.stderr, 'no message')}")
    return proc.stdout.decode(errors="replace")


def verify_and_tag(node: Node, image: HeadImage, ref: str, digest: str = "") -> str:
    """Check that ref on the node is the head's image, then move the tags to it; the node's ID of it. A pull's digest
    that the head pushed names its image by content (the engine checked every blob): then one call tags ref@digest."""
    if digest in image.identity.manifests:
        pulled = f"{ImageRef.parse(ref).repository}@{digest}"
        said = set_tags(node, pulled, image, ("image", "inspect", "--format", "{{.Id}}", pulled)).split()
        if not said:
            raise NodeFailure(f"{pulled} on the node gave no image ID after its tags were set")
        return said[-1]
    got = inspect(node, ref)[ref]
    if got is None or not same_image(image.identity, got):
        shown = got.id[:19] if got else "missing"
        raise NodeFailure(f"{ref} on the node is {shown}, not the head's image {image.image_id[:19]} "
                          "(layers or digests differ); moving tag left where it was")
    set_tags(node, got.id, image)
    return got.id


class Transfer:
    """One way of moving the head's image to the nodes that lack it, each node checked, moved (or skipped), tagged."""

    mode: str  # registry or stream
    source: str  # what the nodes take the image from, for the record and the report
    ref: str  # the reference the image has on a node once moved: what is verified there
    image: HeadImage  # as the nodes are to show it (a stream learns its names from its save)

    def prepare(self, nodes: list[Node]) -> None:
        """The head's work before any node is checked."""

    def move(self, node: Node, run: NodeRun, progress: ProgressFn) -> None:
        """Bring the image to a node, keeping run.moved up to date; raises when it did not arrive."""

    def skip(self, node: Node) -> None:
        """Say that a node will not move (it is current, or it failed first)."""

    def serve(self, progress: ProgressFn) -> None:
        """The head's side of the move, on the calling thread while the nodes' threads run."""


@dataclass
class NodeRun:
    """One node's deploy while it runs: what becomes its NodeResult."""

    node: Node
    start: float  # time.monotonic() its time counts from
    previous: str | None = None  # where the moving tag pointed before
    moved: int = 0  # bytes moved so far
    digest: str = ""  # the manifest digest the node's pull ended with (registry)

    def result(self, outcome: Outcome, image_id: str | None, error: str | None = None) -> NodeResult:
        return NodeResult(self.node, outcome, image_id, self.moved, time.monotonic() - self.start, error, self.previous)


def deploy_all(nodes: Iterable[Node], transfer: Transfer, progress: ProgressFn = lambda p: None,
               state_dir: Path | None = None) -> Deployment:
    """Put the head's image on every node in parallel, moved by transfer; record who runs it now."""
    t0 = time.monotonic()
    nodes = list(nodes)
    transfer.prepare(nodes)
    results = run_nodes(nodes, lambda node: deploy_node(node, transfer, progress), lambda: transfer.serve(progress))
    image, now = transfer.image, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ran = [r for r in results if r.outcome != FAILED]
    with recording(state_dir, image.repository) as data:  # per node that now runs it, the tag deployed and when
        for r in ran:
            past = data["deploys"].setdefault(r.node.name, [])
            if not past or past[-1]["tag"] != image.tag:
                past.append({"tag": image.tag, "at": now})
        if ran:  # the build the moving tag stands for now, rollbacks included: what status compares with
            data["deployed"][image.moving_tag] = image.tag
    return Deployment(transfer.mode, transfer.source, results, time.monotonic() - t0)


def deploy_node(node: Node, transfer: Transfer, progress: ProgressFn) -> NodeResult:
    """Check a node, move the image when it lacks it, verify and tag; a failure stays this node's."""
    run, told = NodeRun(node, time.monotonic()), False  # told: the transfer heard whether this node moves
    try:
        progress(Progress(node.name, "check"))
        image = transfer.image
        found = inspect(node, image.moving_tag, image.tag, runs=image)  # also refuses a node of another architecture
        have = next((i for i in found.values() if i is not None and same_image(image.identity, i)), None)
        before = found[image.moving_tag]
        run.previous = before.id if before else None
        told = True
        if have is not None:
            transfer.skip(node)
            set_tags(node, have.id, transfer.image)
            progress(Progress(node.name, "done", 0, 0, "already current"))
            return run.result(CURRENT, have.id)
        transfer.move(node, run, progress)
        progress(Progress(node.name, "verify", run.moved, run.moved))
        got = verify_and_tag(node, transfer.image, transfer.ref, run.digest)
        progress(Progress(node.name, "done", run.moved, run.moved, "updated"))
        return run.result(UPDATED, got)
    except Exception as exc:  # noqa: BLE001 - one node's failure must not stop the others
        if not told:
            transfer.skip(node)
        reason = str(exc) if isinstance(exc, DistributeError) else one_line(f"{type(exc).__name__}: {exc}")
        progress(Progress(node.name, FAILED.value, run.moved, None, reason))
        return run.result(FAILED, run.previous, reason)


class RegistryPull(Transfer):
    """Every node that lacks the image pulls its immutable tag; one that prints nothing for `stall` s fails alone."""

    mode = "registry"

    def __init__(self, image: HeadImage, registry: str | Registry, stall: float = PULL_STALL_TIMEOUT):
        self.registry = registry if isinstance(registry, Registry) else Registry(registry, "")
        self.image = image
        self.source = self.ref = f"{self.registry.address}/{image.tag}"
        self.stall = stall
        self.sizes: dict[str, int] = {}

    def prepare(self, nodes: list[Node]) -> None:
        self.sizes = layer_sizes(self.registry, self.image.tag)

    def move(self, node: Node, run: NodeRun, progress: ProgressFn) -> None:
        total = sum(self.sizes.values()) or None

        def seen(done: int, detail: str) -> None:
            run.moved = done
            progress(Progress(node.name, "pull", done, total, detail))

        run.moved, run.digest = pull(node, self.source, self.sizes, seen, self.stall)


def deploy_registry(image: HeadImage, nodes: Iterable[Node], registry: str | Registry,
                    progress: ProgressFn = lambda p: None, state_dir: Path | None = None,
                    stall_timeout: float = PULL_STALL_TIMEOUT) -> Deployment:
    """Every node pulls the immutable tag from the registry in parallel."""
    return deploy_all(nodes, RegistryPull(image, registry, stall_timeout), progress, state_dir)


def cluster_status(plan: Plan, nodes: Iterable[Node], state_dir: Path | None = None) -> ClusterStatus:
    """Which image each node's tags point to, compared with the build the last deploy set, else the plan's."""
    tag = read_state(state_dir, ImageRef.parse(plan.moving_tag).repository)["deployed"].get(plan.moving_tag) or plan.tag
    image = image_on_head(tag, plan.moving_tag, state_dir)

    def one(node: Node) -> NodeStatus:
        try:
            # a node of another architecture cannot run the head's image, whatever its tags say
            found = inspect(node, plan.moving_tag, tag, runs=image)
            moving, tagged = found[plan.moving_tag], found[tag]
        except DistributeError as exc:
            return NodeStatus(node, None, None, str(exc))
        ident = image.identity if image else None
        return NodeStatus(node, moving.id if moving else None, tagged.id if tagged else None, None,
                          bool(ident and moving and same_image(ident, moving)),
                          bool(ident and tagged and same_image(ident, tagged)))

    return ClusterStatus(image, tag, plan.moving_tag, run_nodes(nodes, one), "" if tag == plan.tag else plan.tag)


def moved_said(done: int, total: int | None, seconds: float, since: int = 0) -> str:
    """How far a transfer has got: bytes, of the total, the rate since `since` bytes over `seconds`, the time left."""
    said = human_bytes(done) + (f" / {human_bytes(total)}" if total else "")
    rate = (done - since) / seconds if seconds > 0 else 0.0
    if rate <= 0:
        return said
    said += f" at {human_bytes(int(rate))}/s"
    if total and total > done:
        said += f", {time_left((total - done) / rate)}"
    return said


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
