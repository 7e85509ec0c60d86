"""Reaching a node's engine: the one way every command runs docker on a node, time-limited, and its pulls."""

from __future__ import annotations

import os
import pty
import re
import selectors
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TypeVar
from collections.abc import Callable, Iterable

from ..build import dockercli
from ..errors import DistributeError
from ..imageref import ImageRef
from ..inimage.proc import CommandError, TimedOut, run
from ..recipe.fields import DIGEST_RE
from ..registry import Client as RegistryClient, RegistryError
from .cluster import SSH_RE, Node, Registry

CONTROL_TIMEOUT = 30.0  # seconds for one control command on a node (inspect, tag, version)
TRANSFER_TIMEOUT = 3600.0  # seconds a whole pull, push or docker save may take
STALL_TIMEOUT = 60.0  # seconds a node's docker load (stream mode) may take no data before it is dropped
# Seconds a node's docker pull may print nothing before it is stopped. Longer than a load's: on the containerd store
# docker prints nothing while it unpacks a layer (18 s for 1.5 GB on the test cluster), and DGX layers are GBs.
PULL_STALL_TIMEOUT = 300.0
T = TypeVar("T")


class NodeFailure(DistributeError):
    """A per-node failure; its one-line message goes into the node's row, not out of the command."""


def ssh_argv(node: Node, tty: bool = False) -> list[str]:
    """The ssh command that runs one command on an ssh:// node: no prompt, host keys checked; with tty, on a terminal
    of the node, which hangs it up when the connection ends."""
    m = SSH_RE.fullmatch(node.endpoint)
    if m is None:
        raise NodeFailure(f"{node.endpoint} is not an ssh:// endpoint")
    o = node.ssh
    # BatchMode: a host-key or password prompt from several threads would fight for one terminal.
    # LogLevel=ERROR: no "Connection to … closed." after a command on a terminal; errors still show.
    argv = ["ssh", *(["-tt", "-o", "LogLevel=ERROR"] if tty else ["-T"]), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={o.connect_timeout}", "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]
    if o.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={o.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null"]
    if o.identity_file:
        argv += ["-i", o.identity_file, "-o", "IdentitiesOnly=yes"]
    if m.group("port"):
        argv += ["-p", m.group("port")]
    if m.group("user"):
        argv += ["-l", m.group("user")[:-1]]
    return argv + ["--", m.group("host")]


def docker_argv(node: Node, *args: str, tty: bool = False) -> list[str]:
    """The command that runs `docker ARGS` against a node's engine (on a terminal of the node: tty)."""
    if node.endpoint.startswith("ssh://"):
        # ssh hands the words to the remote shell as one line: quote each.
        return ssh_argv(node, tty) + ["docker " + shlex.join(args)]
    return ["docker", "-H", node.endpoint, *args]


def cli_env() -> dict[str, str]:
    # -H names the node; a DOCKER_HOST or DOCKER_CONTEXT would otherwise be refused next to it.
    return {k: v for k, v in os.environ.items() if k not in ("DOCKER_CONTEXT", "DOCKER_HOST")}


def run_docker(node: Node, *args: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
    """Run `docker ARGS` on a node; a timeout or a failed connection is a NodeFailure, one line."""
    return run_dockers(node, [args], timeout)


def run_dockers(node: Node, commands: list[tuple[str, ...]], timeout: float) -> subprocess.CompletedProcess[bytes]:
    """Run docker commands on a node (over ssh, in one session) while they succeed; all they printed, the last code."""
    if node.endpoint.startswith("ssh://"):
        argvs = [ssh_argv(node) + [" && ".join("docker " + shlex.join(args) for args in commands)]]
    else:
        argvs = [docker_argv(node, *args) for args in commands]
    out, err = b"", b""
    for argv, args in zip(argvs, commands):
        try:
            done = run(argv, capture_output=True, timeout=timeout, env=cli_env(), stdin=subprocess.DEVNULL)
        except TimedOut:
            raise NodeFailure(f"`docker {args[0]}` on {node.endpoint} gave no answer within {timeout:.0f}s") from None
        except CommandError as exc:
            raise NodeFailure(exc.why) from None
        if reason := transport_error(node, done.returncode, done.stderr.decode(errors="replace")):
            raise NodeFailure(reason)
        out, err = out + done.stdout, err + done.stderr
        if done.returncode != 0:
            break
    return subprocess.CompletedProcess(done.args, done.returncode, out, err)


def transport_error(node: Node, code: int, stderr: str) -> str | None:
    """One line when the node itself could not be reached (not when a docker command failed)."""
    text = " ".join(stderr.split())
    ssh = node.endpoint.startswith("ssh://")
    host = node.endpoint.partition("://")[2]
    if ssh and code == 255:
        if "Host key verification failed" in text or "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
            return (f"host key of {host} is unknown or changed: check it and add it to known_hosts "
                    f"(ssh-keyscan), sparkforge never accepts one blindly")
        if "Permission denied" in text:
            return f"ssh to {host} refused the login (key auth; check the key and authorized_keys)"
        for marker in ("Connection refused", "timed out", "No route to host", "Could not resolve",
                       "Network is unreachable", "Connection closed", "Connection reset"):
            if marker in text:
                return f"unreachable at {node.endpoint}: {marker.lower()}"
        return f"ssh to {host} failed: {text[-200:] or 'exit code 255'}"
    if ssh and code == 127:
        return f"no docker CLI on {host} (the node needs docker in the ssh user's PATH)"
    if any(words in text for words in _NO_PERMISSION):
        return (f"no permission to use the Docker engine at {node.endpoint} (the node's user must be in its "
                "docker group)")
    if any(words in text for words in _NO_ENGINE):
        return f"unreachable at {node.endpoint}: the Docker engine does not answer"
    return None


# What the docker CLI says when it cannot reach its engine (moby client/request.go, client/errors.go), by release.
_NO_PERMISSION = (
    "permission denied while trying to connect to the Docker daemon socket",  # up to 28
    "permission denied while trying to connect to the docker API at",  # 29
)
_NO_ENGINE = (
    "Cannot connect to the Docker daemon",  # every release: refused, timed out
    "error during connect",  # up to 28
    "failed to connect to the docker API at",  # 29: no socket at the path, or a host that does not resolve
)


def run_nodes(nodes: Iterable[Node], work: Callable[[Node], T],
              head: Callable[[], None] = lambda: None) -> tuple[T, ...]:
    """Run work on every node at once, one thread each, while head() runs on this thread (so that Ctrl-C or
    SIGTERM stops it where it is); results in node order."""
    nodes = list(nodes)
    with ThreadPoolExecutor(max_workers=max(1, len(nodes)), thread_name_prefix="node") as pool:
        try:
            futures = [pool.submit(work, node) for node in nodes]
            head()
            return tuple(f.result() for f in futures)
        except BaseException as exc:
            # Ctrl-C, SIGTERM or a failure here: the nodes' pulls and loads end now (each keeps its tags), before the
            # pool waits for their threads; on Ctrl-C or SIGTERM, so does any a thread starts from now on.
            dockercli.stop_all(exiting=not isinstance(exc, Exception))
            raise


class PullLog:
    """What a `docker pull` printed so far on its terminal (`ID: status` lines): the layers it fetches, bytes done."""

    _ESCAPE = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes  # compressed size of each layer, by the short ID docker prints
        self.fetching: set[str] = set()
        self.present = 0
        self.done = 0  # registry sizes of the layers downloaded so far
        self.digest = ""  # the manifest digest the pull ended with ("Digest: sha256:…")
        self.lines: list[str] = []  # the last lines: docker's error, when it fails
        self._partial = b""

    def feed(self, data: bytes) -> bool:
        """Take more output; True when a layer started, was found present or finished downloading."""
        parts = re.split(rb"[\r\n]+", self._partial + data)
        self._partial = parts.pop()
        changed = False
        for raw in parts:
            text = self._ESCAPE.sub(b"", raw).decode(errors="replace").strip()
            if not text:
                continue
            self.lines = (self.lines + [text])[-5:]
            short, _, status = text.partition(": ")
            if short == "Digest" and DIGEST_RE.fullmatch(status):
                self.digest = status
                continue
            if status == "Pulling fs layer":
                self.fetching.add(short)
            elif status == "Already exists" and (not self.sizes or short in self.sizes):
                # From Docker 29.1 a pull also fetches the image's attestations and signatures, and says
                # "Already exists" of their blobs too: only the image's own layers are counted.
                self.present += 1
            elif status == "Download complete" and short in self.fetching:
                self.done += self.sizes.get(short, 0)
            else:
                continue
            changed = True
        return changed

    @property
    def detail(self) -> str:
        return f"{len(self.fetching)} layers to download, {self.present} already there"

    @property
    def last(self) -> str:
        """The last line printed, also one the pull did not end with a newline."""
        tail = self._ESCAPE.sub(b"", self._partial).decode(errors="replace").strip()
        return tail or (self.lines[-1] if self.lines else "")


def pull(node: Node, ref: str, sizes: dict[str, int], seen: Callable[[int, str], None],
         stall: float = PULL_STALL_TIMEOUT) -> tuple[int, str]:
    """`docker pull` on a node's terminal: the registry sizes of the layers downloaded, and the manifest digest (or "").
    One that prints nothing for `stall` s is stopped: the terminal hangs up, so the engine drops the pull."""
    argv = docker_argv(node, "pull", ref, tty=True)
    terminal = None
    out: IO[bytes] | int  # the child's output: its stdout pipe over ssh, else the local terminal
    err: IO[bytes] | None
    try:
        if node.endpoint.startswith("ssh://"):
            # stdin stays open until the end: an early end of input is no reason for the pull to stop.
            proc = dockercli.spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=cli_env())
            assert proc.stdout is not None  # a pipe, as asked
            out, err = proc.stdout, proc.stderr
        else:
            terminal, child = pty.openpty()
            try:
                proc = dockercli.spawn(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=cli_env())
            finally:
                os.close(child)
            out, err = terminal, None
    except OSError as exc:
        if terminal is not None:
            os.close(terminal)
        raise NodeFailure(f"cannot run {argv[0]}: {exc.strerror}") from None
    log, stderr, why = PullLog(sizes), b"", None
    deadline = time.monotonic() + TRANSFER_TIMEOUT
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_READ)
        if err is not None:
            sel.register(err, selectors.EVENT_READ)
        last = time.monotonic()
        while sel.get_map():
            now = time.monotonic()
            if now - last > stall:
                why = f"stalled: no progress for {stall:.0f}s"
            elif now > deadline:
                why = f"did not finish within {TRANSFER_TIMEOUT:.0f}s"
            if why:
                proc.kill()  # over ssh: the node's terminal hangs up and its docker pull ends
                break
            for key, _ in sel.select(timeout=1.0):
                try:
                    data = os.read(key.fd, 65536)
                except OSError:  # EIO: the child on the local terminal has exited
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                elif key.fileobj is err:
                    stderr = (stderr + data)[-4096:]
                else:
                    last = time.monotonic()
                    if log.feed(data):
                        seen(log.done, log.detail)
    try:
        code = dockercli.finish(proc, timeout=dockercli.EXIT_GRACE)
    except dockercli.EngineError:  # its output ended, yet it ran on: it was stopped
        code, why = -1, why or f"did not end within {dockercli.EXIT_GRACE:.0f}s of its output"
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    if terminal is not None:
        os.close(terminal)
    if why:
        raise NodeFailure(f"pull of {ref} {why}")
    if code != 0:
        said = stderr.decode(errors="replace")
        reason = transport_error(node, code, "\n".join([said, *log.lines, log.last]))
        raise NodeFailure(f"pull of {ref} failed: {reason or log.last or dockercli.last_line(said, 'no message')}")
    return log.done, log.digest


def layer_sizes(registry: Registry, tag: str) -> dict[str, int]:
    """Compressed size of each layer of tag in the registry, by the short ID `docker pull` prints; {} when unknown,
    as they are for the progress and byte counts only (a pull reports a registry that does not answer itself)."""
    ref = ImageRef.parse(tag)
    if ref.tag is None:
        return {}
    client = RegistryClient(registry.endpoint, deadline=CONTROL_TIMEOUT, window=CONTROL_TIMEOUT)
    try:
        manifest = client.manifest(ref.repository, ref.tag)
        if "manifests" in manifest:  # an index: the first linux manifest
            pick = next((m for m in manifest["manifests"]
                         if (m.get("platform") or {}).get("os", "linux") == "linux"), None)
            manifest = client.manifest(ref.repository, pick["digest"]) if pick else {}
        return {layer["digest"].partition(":")[2][:12]: int(layer["size"]) for layer in manifest.get("layers", [])}
    except (RegistryError, LookupError, TypeError, ValueError, AttributeError):
        return {}


def one_line(text: str) -> str:
    """A daemon's or a registry's message as one line: every run of whitespace becomes one space."""
    return " ".join(str(text).split())
