"""Stream deploy: for clusters without a registry, one `docker save` on the head piped into
`docker load` on every node that needs it.

Each node has its own writer thread and bounded queue, so a slow or stalled node holds up
nobody: a node that takes nothing for the stall limit is dropped, and its load is stopped before
its input ends, so a cut stream is never committed. The nodes are checked, verified and tagged
by the same loop as in registry mode (:func:`.deploy.deploy_all`): the moving tag is set only
after the node's image is the head's.
"""

from __future__ import annotations

import contextlib
import io
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from ..build import dockercli
from ..build.dockercli import last_line
from ..inimage.contract import parse_json
from ..inimage.proc import Child
from .cluster import Node
from .nodes import STALL_TIMEOUT, TRANSFER_TIMEOUT, NodeFailure, cli_env, docker_argv, transport_error
from .deploy import CHUNK, Deployment, NodeRun, Progress, ProgressFn, deploy_all
from .images import HeadImage, record_manifest

LOAD_TIMEOUT = 900.0  # seconds a docker load may take to finish after its input ended
BUFFER_CHUNKS = 32  # chunks held per node: a short hiccup of one node does not slow the others


class TarIndex:
    """Follows the headers of a `docker save` tar stream to catch its index.json and manifest.json.

    A containerd-store node shows the manifest digest index.json names as the image ID of what it
    loaded, so the head records it as one more name of the image; a classic-store node shows the
    config digest manifest.json names, which a containerd-store head does not show of itself.
    """

    def __init__(self) -> None:
        self.header = bytearray()
        self.skip = 0  # bytes of the current member (and its padding) still to pass
        self.keep = 0  # of those, bytes of index.json or manifest.json still to keep
        self.index = bytearray()
        self.kept = b""  # the name of the member being kept
        self.manifest: str | None = None
        self.config: str | None = None  # from manifest.json: the config digest
        self.pax_size: int | None = None  # the size a PAX header gave the next member
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
        # Members over 8 GiB (big layers) carry their size in base-256 (GNU), or in a PAX header
        # before them (what Go's archive/tar, and so Docker, writes): its size= record wins.
        size = int.from_bytes(raw[1:], "big") if raw[0] & 0x80 else int(raw.strip(b"\0 ") or b"0", 8)
        kind = h[156:157]
        if kind not in (b"x", b"g") and self.pax_size is not None:
            size, self.pax_size = self.pax_size, None
        name = h[:100].split(b"\0", 1)[0]
        self.skip = (size + 511) // 512 * 512
        if kind in (b"x", b"g") and size < 1 << 20:
            self.index.clear()
            self.kept = b"pax"
            self.keep = size
        elif name in (b"index.json", b"manifest.json") and kind in (b"0", b"\0") and size < 1 << 20:
            self.index.clear()
            self.kept = name
            self.keep = size

    def _parse(self) -> None:
        if self.kept == b"pax":
            for record in bytes(self.index).split(b"\n"):  # "LEN key=value"
                key, _, value = record.partition(b" ")[2].partition(b"=")
                if key == b"size" and value.isdigit():
                    self.pax_size = int(value)
            return
        try:
            data = parse_json(bytes(self.index))
        except ValueError:
            return
        if self.kept == b"index.json" and isinstance(data, dict):
            self.manifest = saved_image_digest(data)
        elif self.kept == b"manifest.json" and isinstance(data, list) and len(data) == 1 and isinstance(data[0], dict):
            name = str(data[0].get("Config") or "")
            if name.startswith("blobs/sha256/"):
                self.config = "sha256:" + name.rpartition("/")[2]


# The annotations a saved image's index.json puts on the entry of each image it holds (containerd's and OCI's).
_NAME_KEYS = ("io.containerd.image.name", "org.opencontainers.image.ref.name")


def saved_image_digest(index: dict[str, Any]) -> str | None:
    """The digest of the one image a `docker save` of one tag holds, from its index.json; None when it is not one.

    From Docker 29.1 the index also lists the image's attestations and signatures (referrers): entries
    without an image name, which are not the image."""
    entries = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    named = [m for m in entries if any(k in (m.get("annotations") or {}) for k in _NAME_KEYS)]
    pick = named if named else entries
    digest = pick[0].get("digest") if len(pick) == 1 else None
    return digest if isinstance(digest, str) else None


class _Writer(threading.Thread):
    """Feeds one node's `docker load` from its own bounded queue, so a slow node holds up nobody."""

    def __init__(self, node: Node, proc: Child[bytes]):
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
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)  # a writer waiting on an empty queue ends now


class StreamLoad:
    """One `docker save` on the head, teed into a `docker load` on every node that lacks the image.

    The stream starts once every node was checked (each one either moves or is skipped), and runs
    on the deploy's calling thread; each moving node's thread waits for its own load to end.
    """

    mode = "stream"

    def __init__(self, image: HeadImage, stall: float = STALL_TIMEOUT, state_dir: Path | None = None):
        self.image = image
        self.source = f"docker save {image.tag}"
        self.ref = image.tag  # `docker load` names the image by the tag it was saved under
        self.stall = stall
        self.state_dir = state_dir
        self._order: dict[str, int] = {}
        self._waiting = 0  # nodes not yet checked
        self._todo: list[Node] = []
        self._arrivals = threading.Condition()
        self._ended = threading.Event()  # the stream is over, for every node
        self._loads: dict[str, Load] = {}

    def prepare(self, nodes: list[Node]) -> None:
        self._order = {node.name: i for i, node in enumerate(nodes)}
        self._waiting = len(nodes)

    def skip(self, node: Node) -> None:
        self._arrive(None)

    def move(self, node: Node, run: NodeRun, progress: ProgressFn) -> None:
        self._arrive(node)
        self._ended.wait()
        load = self._loads.get(node.name) or Load(0, run.start, "stream stopped on the head before it ended")
        run.start, run.moved = load.started, load.sent  # its time is the stream's, as a pull's is the node's
        if load.error:
            raise NodeFailure(load.error)

    def _arrive(self, node: Node | None) -> None:
        with self._arrivals:
            if node is not None:
                self._todo.append(node)
            self._waiting -= 1
            self._arrivals.notify_all()

    def serve(self, progress: ProgressFn) -> None:
        try:
            with self._arrivals:
                while self._waiting > 0:
                    self._arrivals.wait(0.5)
                todo = sorted(self._todo, key=lambda n: self._order[n.name])
            if not todo:
                return
            loads, saved = _stream(self.image, todo, progress, self.stall)
            if saved is not None:
                self._learn(saved)
            self._loads = loads  # only now: a node verifies against every name the save gave the image
        finally:
            self._ended.set()  # also on Ctrl-C: the nodes' threads end, failed

    def _learn(self, saved: TarIndex) -> None:
        """Record the names the saved tarball gives the image, which the nodes that loaded it show."""
        if not (saved.manifest or saved.config):
            return
        record_manifest(self.state_dir, self.image.tag, saved.manifest, saved.config, self.image.image_id)
        identity = self.image.identity
        self.image = replace(self.image, identity=replace(
            identity, config=saved.config or identity.config,
            manifests=identity.manifests | ({saved.manifest} if saved.manifest else set())))


def deploy_stream(image: HeadImage, nodes: Iterable[Node], progress: ProgressFn = lambda p: None,
                  state_dir: Path | None = None,
                  stall_timeout: float = STALL_TIMEOUT) -> Deployment:
    """One `docker save` on the head, piped into `docker load` on each node that needs it."""
    return deploy_all(nodes, StreamLoad(image, stall_timeout, state_dir), progress, state_dir)


@dataclass(frozen=True)
class Load:
    """How one node's `docker load` ended."""

    sent: int  # bytes it took
    started: float  # time.monotonic() when the stream began
    error: str | None


def _stream(image: HeadImage, nodes: list[Node], progress: ProgressFn,
            stall: float) -> tuple[dict[str, Load], TarIndex | None]:
    """Tee one `docker save` into a `docker load` per node, one writer thread each.

    Returns each node's Load, and what the saved tarball says of itself (its manifest and config
    digests) when the save finished.
    """
    started = time.monotonic()
    # The head's save: the engine the build used, DOCKER_HOST or DOCKER_CONTEXT included.
    save = dockercli.start(["save", image.tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # A save that hangs would hold every node: it gets as long as a whole transfer, then is stopped.
    watchdog = threading.Timer(TRANSFER_TIMEOUT, save.kill)
    watchdog.daemon = True
    watchdog.start()
    writers = _start_loads(nodes)
    save_err: list[bytes] = []
    save_stderr = save.stderr
    assert save_stderr is not None  # a pipe, as asked
    save_drain = threading.Thread(target=lambda: save_err.append(save_stderr.read()), daemon=True)
    save_drain.start()
    index = _pump(save, writers, image, progress, stall)
    code = save.wait()
    watchdog.cancel()
    save_drain.join(5)
    if code != 0:
        why = last_line(b"".join(save_err), "no message") if save_err and save_err[0] else f"exit code {code}"
        for w in writers:
            w.drop(f"stream interrupted: docker save on the head failed: {why}")
    for w in writers:
        w.offer(None, stall)  # end of input: the load may commit now
    return _end_loads(writers, started), index if code == 0 else None


def _start_loads(nodes: list[Node]) -> list[_Writer]:
    """A `docker load` per node, each fed by its own writer thread."""
    env = cli_env()  # for the nodes' loads, which name their engine with -H
    writers = []
    for node in nodes:
        # Tracked: Ctrl-C or SIGTERM on the head stops every load (a node keeps its old image).
        proc = dockercli.spawn(docker_argv(node, "load", "-q"), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env=env)
        writers.append(_Writer(node, proc))
    for w in writers:
        w.start()
        w.drain.start()
    return writers


def _pump(save: Child[bytes], writers: list[_Writer], image: HeadImage, progress: ProgressFn,
          stall: float) -> TarIndex:
    """Hand each chunk of the save to every live writer until the save ends or no node is left."""
    index, last = TarIndex(), 0.0
    assert isinstance(save.stdout, io.BufferedReader)  # a pipe, buffered as Popen makes it by default
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
    return index


def _end_loads(writers: list[_Writer], started: float) -> dict[str, Load]:
    """Wait for every load to commit (or fail), within one deadline for them all."""
    loads = {}
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
            w.error = f"docker load failed: {transport_error(w.node, rc, w.stderr.decode(errors='replace')) or last_line(w.stderr, 'no message')}"
        loads[w.node.name] = Load(w.sent, started, w.error)
    return loads
