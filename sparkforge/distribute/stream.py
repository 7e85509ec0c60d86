"""Stream deploy: one `docker save` on the head piped into `docker load` on every node that needs it.

A node that takes nothing for the stall limit is dropped, and its load is stopped before its input ends, so a
cut stream is never committed; the moving tag is set only once the node's image is the head's (deploy_all).
"""

from __future__ import annotations

import contextlib
import io
import queue
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from ..build import dockercli
from ..inimage.contract import parse_json
from ..inimage.proc import Child
from .cluster import Node
from .nodes import STALL_TIMEOUT, TRANSFER_TIMEOUT, NodeFailure, cli_env, docker_argv, transport_error
from .deploy import CHUNK, Deployment, NodeRun, Progress, ProgressFn, Transfer, deploy_all
from .images import HeadImage, record_manifest

LOAD_TIMEOUT = 900.0  # seconds a docker load may take to finish after its input ended
BUFFER_CHUNKS = 32  # chunks held per node: a short hiccup of one node does not slow the others


class TarIndex:
    """Follows the headers of a `docker save` tar stream to catch the manifest digest its index.json names (a
    containerd-store node's image ID) and the config digest its manifest.json names (a classic-store node's)."""

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
            else:
                take = min(512 - len(self.header), n - i)
                self.header += chunk[i:i + take]
                if len(self.header) == 512:
                    self._member(bytes(self.header))
                    self.header.clear()
            i += take

    def _member(self, h: bytes) -> None:
        if not h.strip(b"\0"):
            self.ended = True
            return
        raw = h[124:136]
        # Members over 8 GiB carry their size in base-256 (GNU), or in a PAX header before them (Go's, so Docker's).
        size = int.from_bytes(raw[1:], "big") if raw[0] & 0x80 else int(raw.strip(b"\0 ") or b"0", 8)
        kind = h[156:157]
        pax = kind in (b"x", b"g")
        if not pax and self.pax_size is not None:
            size, self.pax_size = self.pax_size, None
        name = h[:100].split(b"\0", 1)[0]
        self.skip = (size + 511) // 512 * 512
        if size < 1 << 20 and (pax or (name in (b"index.json", b"manifest.json") and kind in (b"0", b"\0"))):
            self.index.clear()
            self.kept, self.keep = (b"pax" if pax else name), size

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
    """The digest of the one image a `docker save` of one tag holds, from its index.json; None when it is not one
    (from Docker 29.1 the index also lists attestations and signatures: entries without an image name)."""
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
        self.started = self.last = time.monotonic()  # when the stream began, and when the node last took a chunk
        self.error: str | None = None
        self.stderr = b""
        self.drain = threading.Thread(target=self._read_stderr, daemon=True)
        self.drain.start()

    def _read_stderr(self) -> None:
        # Read the loader's stderr while it runs, so a chatty one never blocks on a full pipe.
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def run(self) -> None:
        assert self.proc.stdin is not None
        try:
            while (chunk := self.queue.get()) is not None:
                self.proc.stdin.write(chunk)
                self.sent += len(chunk)
                self.last = time.monotonic()
            self.proc.stdin.close()
        except (OSError, ValueError):
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


class StreamLoad(Transfer):
    """One `docker save` on the head, once every node was checked, teed into a `docker load` on each that lacks it."""

    mode = "stream"

    def __init__(self, image: HeadImage, stall: float = STALL_TIMEOUT, state_dir: Path | None = None):
        self.image = image
        self.source = f"docker save {image.tag}"
        self.ref = image.tag  # `docker load` names the image by the tag it was saved under
        self.stall = stall
        self.state_dir = state_dir
        self._nodes: list[Node] = []
        self._checked = threading.Semaphore(0)  # released once per node checked: it moves, or is skipped
        self._moving: list[Node] = []  # the nodes that lack the image
        self._ended = threading.Event()  # the stream is over, for every node
        self._loads: dict[str, _Writer] = {}

    def prepare(self, nodes: list[Node]) -> None:
        self._nodes = nodes

    def skip(self, node: Node) -> None:
        self._checked.release()

    def move(self, node: Node, run: NodeRun, progress: ProgressFn) -> None:
        self._moving.append(node)
        self._checked.release()
        self._ended.wait()
        load = self._loads.get(node.name)
        if load is None:
            raise NodeFailure("stream stopped on the head before it ended")
        run.start, run.moved = load.started, load.sent  # its time is the stream's, as a pull's is the node's
        if load.error:
            raise NodeFailure(load.error)

    def serve(self, progress: ProgressFn) -> None:
        try:
            for _ in self._nodes:
                while not self._checked.acquire(timeout=0.5):
                    pass
            if not self._moving:
                return
            loads, saved = _stream(self.image, sorted(self._moving, key=self._nodes.index), progress, self.stall)
            if saved is not None and (saved.manifest or saved.config):  # names the nodes that loaded it show
                record_manifest(self.state_dir, self.image.tag, saved.manifest, saved.config, self.image.image_id)
                identity = self.image.identity
                self.image = replace(self.image, identity=replace(
                    identity, config=saved.config or identity.config,
                    manifests=identity.manifests | ({saved.manifest} if saved.manifest else set())))
            # Only now: a node verifies against every name the save gave the image.
            self._loads = {w.node.name: w for w in loads}
        finally:
            self._ended.set()  # also on Ctrl-C: the nodes' threads end, failed


def deploy_stream(image: HeadImage, nodes: Iterable[Node], progress: ProgressFn = lambda p: None,
                  state_dir: Path | None = None, stall_timeout: float = STALL_TIMEOUT) -> Deployment:
    """One `docker save` on the head, piped into `docker load` on each node that needs it."""
    return deploy_all(nodes, StreamLoad(image, stall_timeout, state_dir), progress, state_dir)


def _stream(image: HeadImage, nodes: list[Node], progress: ProgressFn,
            stall: float) -> tuple[list[_Writer], TarIndex | None]:
    """Tee one `docker save` into a `docker load` per node; the ended writers, and the TarIndex (None: save failed)."""
    # The head's save: the engine the build used, DOCKER_HOST or DOCKER_CONTEXT included.
    save = dockercli.start(["save", image.tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # A save that hangs would hold every node: it gets as long as a whole transfer, then is stopped.
    watchdog = threading.Timer(TRANSFER_TIMEOUT, save.kill)
    watchdog.daemon = True
    watchdog.start()
    writers = []
    for node in nodes:
        # Tracked: Ctrl-C or SIGTERM on the head stops every load (a node keeps its old image); -H names its engine.
        load = dockercli.spawn(docker_argv(node, "load", "-q"), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env=cli_env())
        writers.append(_Writer(node, load))
        writers[-1].start()
    save_err: list[bytes] = []
    drain = threading.Thread(target=lambda: save_err.append(save.stderr.read() if save.stderr else b""), daemon=True)
    drain.start()
    index, last = TarIndex(), 0.0
    assert isinstance(save.stdout, io.BufferedReader)  # a pipe, buffered as Popen makes it by default
    while chunk := save.stdout.read1(CHUNK):  # each chunk to every live writer, until no node is left
        index.feed(chunk)
        for w in writers:
            if w.error is None:
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
    drain.join(5)
    if code != 0:
        why = dockercli.last_line(b"".join(save_err), "no message") if save_err and save_err[0] else f"exit code {code}"
        for w in writers:
            w.drop(f"stream interrupted: docker save on the head failed: {why}")
    for w in writers:
        w.offer(None, stall)  # end of input: the load may commit now
    deadline = time.monotonic() + LOAD_TIMEOUT  # one deadline for every load to commit (or fail)
    for w in writers:
        try:
            rc = w.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.drop(f"docker load did not finish within {LOAD_TIMEOUT:.0f}s")
            rc = w.proc.wait()
        w.join(10)
        w.drain.join(10)
        if rc != 0 and w.error is None:
            reason = transport_error(w.node, rc, w.stderr.decode(errors="replace"))
            w.error = f"docker load failed: {reason or dockercli.last_line(w.stderr, 'no message')}"
    return writers, index if code == 0 else None
