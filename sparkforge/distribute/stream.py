"""Stream deploy: for clusters without a registry, one `docker save` on the head piped into
`docker load` on every node that needs it.

Each node has its own writer thread and bounded queue, so a slow or stalled node holds up
nobody: a node that takes nothing for the stall limit is dropped, and its load is stopped before
its input ends, so a cut stream is never committed. The moving tag is set as in registry mode,
only after the node's image is the head's (:func:`.distribute.verify_and_tag`).
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from ..build import dockercli
from ..build.dockercli import last_line
from ..errors import DistributeError
from .cluster import STALL_TIMEOUT, Node, NodeFailure, cli_env, docker_argv, run_nodes, transport_error
from .deploy import (
    CHUNK,
    CURRENT,
    TRANSFER_TIMEOUT,
    UPDATED,
    Deployment,
    HeadImage,
    NodeResult,
    Progress,
    ProgressFn,
    check_node,
    failed,
    record_deploy,
    record_manifest,
    set_tags,
    verify_and_tag,
)

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
            data = json.loads(bytes(self.index))
        except ValueError:
            return
        if self.kept == b"index.json" and isinstance(data, dict):
            manifests = data.get("manifests") or []
            if len(manifests) == 1 and isinstance(manifests[0], dict):
                self.manifest = manifests[0].get("digest")
        elif self.kept == b"manifest.json" and isinstance(data, list) and len(data) == 1 and isinstance(data[0], dict):
            name = str(data[0].get("Config") or "")
            if name.startswith("blobs/sha256/"):
                self.config = "sha256:" + name.rpartition("/")[2]


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
    streamed, saved = _stream(image, todo, progress, stall_timeout) if todo else ({}, None)
    if saved is not None and (saved.manifest or saved.config):
        record_manifest(state_dir, image.tag, saved.manifest, saved.config, image.image_id)
        image = replace(image, identity=replace(
            image.identity, config=saved.config or image.identity.config,
            manifests=image.identity.manifests | ({saved.manifest} if saved.manifest else set())))

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


def _stream(image: HeadImage, nodes: list[Node], progress: ProgressFn,
            stall: float) -> tuple[dict[str, tuple[int, float, str | None]], TarIndex | None]:
    """Tee one `docker save` into a `docker load` per node, one writer thread each.

    Returns name -> (bytes, start, error), and what the saved tarball says of itself (its manifest
    and config digests) when the save finished.
    """
    started = time.monotonic()
    env = cli_env()  # for the nodes' loads, which name their engine with -H
    try:  # the head's save: the engine the build used, DOCKER_HOST or DOCKER_CONTEXT included
        save = dockercli.track(subprocess.Popen(["docker", "save", image.tag], stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE))
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
    index, last = TarIndex(), 0.0
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
        why = last_line(b"".join(save_err), "no message") if save_err and save_err[0] else f"exit code {code}"
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
            w.error = f"docker load failed: {transport_error(w.node, rc, w.stderr.decode(errors='replace')) or last_line(w.stderr, 'no message')}"
        result[w.node.name] = (w.sent, started, w.error)
    return result, index if code == 0 else None

