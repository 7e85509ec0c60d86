"""Cluster stage input: which Docker endpoints are the nodes, how to reach them, and the registry.

A cluster file (``cluster.yaml``) names the nodes and their endpoints, the ssh options and the
registry; the command line may name nodes too, by cluster name or by endpoint. Everything is
checked here, before any node is contacted, so bad input stops the command with one line and
nothing done. :func:`run_docker` is the one way a command reaches a node's engine: the docker CLI
with ``-H`` for unix:// and tcp://, and ``ssh … docker`` for ssh:// (never prompting, time-limited);
:func:`run_dockers` runs several in one ssh session, and :func:`pull` runs `docker pull` on a
terminal, stopped when it shows no progress for the stall limit.
"""

from __future__ import annotations

import ipaddress
import os
import pty
import re
import selectors
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Iterable, TypeVar

from pydantic import AfterValidator, Field, ValidationError, model_validator

from ..build import dockercli
from ..build.dockercli import last_line
from ..errors import ConfigError, DistributeError, SparkforgeError
from ..imageref import ImageRef
from ..net import is_loopback
from ..recipe.config import read_yaml, validation_error
from ..recipe.schema import NAME_RE, Strict
from ..registry import Client as RegistryClient
from ..registry import Endpoint as RegistryEndpoint
from ..registry import RegistryError

# ssh://[user@]host[:port], tcp://host:port, unix:///absolute/path.sock
_HOST = r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?"
_SSH_RE = re.compile(rf"^ssh://(?P<user>[A-Za-z0-9._-]+@)?(?P<host>{_HOST})(:(?P<port>[0-9]{{1,5}}))?$")
_TCP_RE = re.compile(rf"^tcp://{_HOST}:[0-9]{{1,5}}$")
_UNIX_RE = re.compile(r"^unix:///[A-Za-z0-9._/-]+$")
REGISTRY_RE = re.compile(rf"^{_HOST}(:[0-9]{{1,5}})?$")
LISTEN_RE = re.compile(r"^[0-9.]+:[0-9]{1,5}$")

CONTROL_TIMEOUT = 30.0  # seconds for one control command on a node (inspect, tag, version)
TRANSFER_TIMEOUT = 3600.0  # seconds a whole pull, push or docker save may take
STALL_TIMEOUT = 60.0  # seconds a node's docker load (stream mode) may take no data before it is dropped
# Seconds a node's docker pull may print nothing before it is stopped. Longer than a load's: on the
# containerd image store, docker prints nothing while it unpacks a layer (18 s for a 1.5 GB image on
# the test cluster, three nodes sharing two cores), and a DGX image has layers of several GB.
PULL_STALL_TIMEOUT = 300.0
T = TypeVar("T")

ENDPOINT_HELP = "ssh://[user@]host[:port], tcp://host:port or unix:///path/to/docker.sock"


class NodeFailure(DistributeError):
    """A per-node failure; its one-line message goes into the node's row, not out of the command."""


def is_endpoint(value: str) -> bool:
    return bool(_SSH_RE.match(value) or _TCP_RE.match(value) or _UNIX_RE.match(value))


def _endpoint(value: str) -> str:
    if not is_endpoint(value):
        raise ValueError(f"{value!r} is not a Docker endpoint ({ENDPOINT_HELP})")
    return value


def _registry(value: str) -> str:
    if not REGISTRY_RE.match(value):
        raise ValueError(f"{value!r} is not a registry address HOST:PORT (e.g. 10.0.0.1:5000)")
    return value


def _listen(value: str) -> str:
    host, _, port = value.rpartition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"{value!r} is not an address to listen on, IPv4:PORT (e.g. 0.0.0.0:5000)") from None
    if not LISTEN_RE.match(value) or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not an address to listen on, IPv4:PORT (e.g. 0.0.0.0:5000)")
    return value


def _node_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a node name (lowercase letters, digits and '-')")
    return value


Endpoint = Annotated[str, AfterValidator(_endpoint)]
RegistryAddress = Annotated[str, AfterValidator(_registry)]
ListenAddress = Annotated[str, AfterValidator(_listen)]
NodeName = Annotated[str, AfterValidator(_node_name)]


class NodeSpec(Strict):
    endpoint: Endpoint


class SshSpec(Strict):
    """How ssh:// nodes are reached; host keys are always checked."""

    known_hosts: str | None = None
    identity_file: str | None = None
    connect_timeout: int = Field(10, ge=1, le=120)


class TlsSpec(Strict):
    """The registry's certificate and key, and the CA that signed it (what nodes trust)."""

    cert: str
    key: str
    ca: str


class RegistrySpec(Strict):
    """Where the registry listens, the address nodes pull from, and how it is secured."""

    address: RegistryAddress
    listen: ListenAddress | None = None
    tls: TlsSpec | None = None
    insecure: bool = False

    @model_validator(mode="after")
    def _one_way(self) -> "RegistrySpec":
        if self.tls is not None and self.insecure:
            raise ValueError("give either tls: or insecure: true, not both")
        if self.tls is None and not self.insecure and not is_loopback(self.address):
            raise ValueError(f"{self.address} is not a loopback address: give tls: (cert, key, ca) or mark it "
                             "insecure: true (plain HTTP; every node lists it in insecure-registries)")
        return self


class ClusterFile(Strict):
    """The schema of cluster.yaml."""

    registry: RegistryAddress | RegistrySpec | None = None
    ssh: SshSpec | None = None
    nodes: dict[NodeName, NodeSpec] = Field(min_length=1)


@dataclass(frozen=True)
class SshOptions:
    """The ssh options of every ssh:// node of a cluster."""

    known_hosts: str | None = None  # None: the user's ~/.ssh/known_hosts
    identity_file: str | None = None  # None: the user's keys and agent
    connect_timeout: int = 10


@dataclass(frozen=True)
class Node:
    """One Docker engine of the cluster."""

    name: str
    endpoint: str
    ssh: SshOptions = field(default_factory=SshOptions)


@dataclass(frozen=True)
class Registry:
    """The registry of a cluster, with paths resolved against the cluster file's folder."""

    address: str  # HOST:PORT, what the head pushes to and nodes pull from
    listen: str  # IPv4:PORT the registry binds
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    insecure: bool = False

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def endpoint(self) -> RegistryEndpoint:
        """Where the head reaches it: https trusting the cluster's CA, or plain http without TLS."""
        return RegistryEndpoint(self.address, "https" if self.ca else "http", self.ca)


@dataclass(frozen=True)
class Cluster:
    """The nodes to act on, and the registry they pull from (None: no registry)."""

    nodes: tuple[Node, ...]
    registry: str | None
    source: str | None = None  # the cluster file, when one was read
    registry_spec: Registry | None = None


def load_cluster_file(path: Path) -> ClusterFile:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError("a cluster file must be a YAML mapping with `nodes:` (see cluster.example.yaml)",
                          path=path)
    try:
        spec = ClusterFile.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path) from None
    for fld, value in _file_fields(spec):
        if not _resolve(path, value).is_file():
            raise ConfigError(f"file not found: {_resolve(path, value)}", path=path, field=fld)
    return spec


def _file_fields(spec: ClusterFile) -> list[tuple[str, str]]:
    found = []
    if spec.ssh is not None:
        found += [(f"ssh.{k}", v) for k, v in (("known_hosts", spec.ssh.known_hosts),
                                                 ("identity_file", spec.ssh.identity_file)) if v]
    if isinstance(spec.registry, RegistrySpec) and spec.registry.tls is not None:
        tls = spec.registry.tls
        found += [("registry.tls.cert", tls.cert), ("registry.tls.key", tls.key), ("registry.tls.ca", tls.ca)]
    return found


def _resolve(cluster_file: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (cluster_file.parent / p)


def registry_of(spec: ClusterFile, path: Path) -> Registry | None:
    """The registry a cluster file names, with its defaults filled in."""
    reg = spec.registry
    if reg is None:
        return None
    if isinstance(reg, str):
        reg = RegistrySpec(address=reg, insecure=not is_loopback(reg))
    port = reg.address.rpartition(":")[2] if ":" in reg.address else "5000"
    listen = reg.listen or f"{'127.0.0.1' if is_loopback(reg.address) else '0.0.0.0'}:{port}"
    if reg.tls is None:
        return Registry(reg.address, listen, insecure=reg.insecure)
    tls = reg.tls
    return Registry(reg.address, listen, str(_resolve(path, tls.cert)), str(_resolve(path, tls.key)),
                    str(_resolve(path, tls.ca)))


def check_registry(value: str, source: str = "--registry") -> str:
    try:
        return _registry(value)
    except ValueError as exc:
        raise ConfigError(str(exc), field=source) from None


def push_registry(address: str | None, cluster_file: Path | None) -> Registry:
    """The registry `push` sends to: the address given, else the cluster file's registry (with its TLS)."""
    spec = registry_of(load_cluster_file(cluster_file), cluster_file) if cluster_file is not None and not address else None
    if address:
        target = check_registry(address)
    elif spec is not None:
        target = spec.address
    else:
        raise SparkforgeError("no registry: pass --registry HOST:PORT or set registry: in the cluster file "
                              "(make registry starts one on 127.0.0.1:5000)", field="--registry")
    return spec if spec is not None and spec.address == target else Registry(target, "")


LOCAL_REGISTRY = Registry("127.0.0.1:5000", "127.0.0.1:5000")  # `registry` without a cluster file's registry


def registry_to_run(cluster_file: Path | None) -> Registry:
    """The registry the `registry` verb starts, stops or checks: the cluster file's, else LOCAL_REGISTRY."""
    reg = registry_of(load_cluster_file(cluster_file), cluster_file) if cluster_file is not None else None
    return reg or LOCAL_REGISTRY


def resolve_cluster(cluster_file: Path | None, nodes: list[str] | None, registry: str | None) -> Cluster:
    """The nodes and registry to use, from the cluster file and the command line.

    `nodes` entries are node names from the cluster file or endpoints; commas separate several.
    Without `nodes`, every node of the cluster file is used. `registry` overrides the file's.
    """
    spec = load_cluster_file(cluster_file) if cluster_file is not None else None
    ssh = SshOptions()
    if spec is not None and spec.ssh is not None and cluster_file is not None:
        s = spec.ssh
        ssh = SshOptions(str(_resolve(cluster_file, s.known_hosts)) if s.known_hosts else None,
                         str(_resolve(cluster_file, s.identity_file)) if s.identity_file else None,
                         s.connect_timeout)
    known = {name: Node(name, s.endpoint, ssh) for name, s in (spec.nodes.items() if spec else ())}
    wanted = [part.strip() for entry in (nodes or []) for part in entry.split(",") if part.strip()]
    chosen: list[Node] = []
    if not wanted:
        if spec is None:
            raise ConfigError("no nodes: name them with --nodes (names or endpoints), or write a cluster "
                              "file (see cluster.example.yaml) and pass --cluster FILE", field="--nodes")
        chosen = list(known.values())
    for entry in wanted:
        if entry in known:
            chosen.append(known[entry])
        elif is_endpoint(entry):
            chosen.append(Node(_name_of(entry), entry, ssh))
        elif "://" in entry:
            raise ConfigError(f"{entry!r} is not a Docker endpoint ({ENDPOINT_HELP})", field="--nodes")
        else:
            names = ", ".join(sorted(known)) or "none: no cluster file was read"
            raise ConfigError(f"unknown node {entry!r} (known nodes: {names})",
                              path=cluster_file, field="--nodes")
    seen: dict[str, Node] = {}
    for node in chosen:
        if node.name in seen and seen[node.name].endpoint != node.endpoint:
            raise ConfigError(f"two nodes are named {node.name!r}; name them in a cluster file", field="--nodes")
        if any(n.endpoint == node.endpoint and n.name != node.name for n in seen.values()):
            raise ConfigError(f"endpoint {node.endpoint} is given twice under two names", field="--nodes")
        seen[node.name] = node
    reg_spec = registry_of(spec, cluster_file) if spec is not None and cluster_file is not None else None
    if registry:
        address = check_registry(registry)
        if reg_spec is None or reg_spec.address != address:
            reg_spec = Registry(address, f"127.0.0.1:{address.rpartition(':')[2]}")
    return Cluster(tuple(seen.values()), reg_spec.address if reg_spec else None,
                   str(cluster_file) if cluster_file else None, reg_spec)


def _name_of(endpoint: str) -> str:
    """A readable name for a node given by endpoint: its host, or its socket's folder."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "unix":
        parts = [p for p in rest.split("/") if p]
        return parts[-2] if len(parts) >= 2 else rest
    host = rest.rpartition("@")[2]
    return host if scheme == "ssh" else host.replace(":", "-")


# ------------------------------------------------------------------------- reaching a node


def ssh_argv(node: Node, tty: bool = False) -> list[str]:
    """The ssh command that runs one command on an ssh:// node: no prompt, host keys checked.

    tty: the command runs on a terminal of the node, which hangs it up when the connection ends.
    """
    m = _SSH_RE.match(node.endpoint)
    if m is None:
        raise NodeFailure(f"{node.endpoint} is not an ssh:// endpoint")
    o = node.ssh
    # BatchMode: a host-key or password prompt from several threads would fight for one terminal.
    # LogLevel=ERROR: no "Connection to … closed." after a command on a terminal; errors still show.
    argv = ["ssh", *(["-tt", "-o", "LogLevel=ERROR"] if tty else ["-T"]), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={o.connect_timeout}", "-o", "ServerAliveInterval=10",
            "-o", "ServerAliveCountMax=3"]
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
        return ssh_argv(node, tty) + ["docker " + " ".join(shlex.quote(a) for a in args)]
    return ["docker", "-H", node.endpoint, *args]


def cli_env() -> dict[str, str]:
    # -H names the node; a DOCKER_HOST or DOCKER_CONTEXT would otherwise be refused next to it.
    return {k: v for k, v in os.environ.items() if k not in ("DOCKER_CONTEXT", "DOCKER_HOST")}


def run_docker(node: Node, *args: str, timeout: float, input: bytes | None = None) -> subprocess.CompletedProcess:
    """Run `docker ARGS` on a node; a timeout or a failed connection is a NodeFailure, one line."""
    return _run_on(node, docker_argv(node, *args), args[0], timeout, input)


def run_dockers(node: Node, commands: list[tuple[str, ...]], timeout: float) -> subprocess.CompletedProcess:
    """Run docker commands on a node, each only after the one before succeeded; over ssh, in one session.

    Returns the last command run: the first that failed, or the last of all.
    """
    if node.endpoint.startswith("ssh://"):
        line = " && ".join("docker " + " ".join(shlex.quote(a) for a in args) for args in commands)
        return _run_on(node, ssh_argv(node) + [line], commands[0][0], timeout)
    for args in commands:
        proc = run_docker(node, *args, timeout=timeout)
        if proc.returncode != 0:
            break
    return proc


def _run_on(node: Node, argv: list[str], verb: str, timeout: float,
            input: bytes | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout, env=cli_env(),
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NodeFailure(f"`docker {verb}` on {node.endpoint} gave no answer within {timeout:.0f}s") from None
    except OSError as exc:
        raise NodeFailure(f"cannot run {argv[0]}: {exc.strerror}") from None
    reason = transport_error(node, proc.returncode, proc.stderr.decode(errors="replace"))
    if reason:
        raise NodeFailure(reason)
    return proc


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
    if "Cannot connect to the Docker daemon" in text or "error during connect" in text:
        return f"unreachable at {node.endpoint}: the Docker engine does not answer"
    return None


def run_nodes(nodes: Iterable[Node], work: Callable[[Node], T]) -> tuple[T, ...]:
    """Run work on every node at once, one thread each; results in the order of nodes."""
    nodes = list(nodes)
    if not nodes:
        return ()
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="node") as pool:
        return tuple(pool.map(work, nodes))


class PullLog:
    """What a `docker pull` printed so far, read from its terminal: the layers it fetches, the bytes done.

    On a terminal docker redraws its lines in place (cursor moves, carriage returns); each piece
    between them is one status line, `ID: status`.
    """

    _ESCAPE = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes  # compressed size of each layer, by the short ID docker prints
        self.fetching: set[str] = set()
        self.present = 0
        self.done = 0  # registry sizes of the layers downloaded so far
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
            if status == "Pulling fs layer":
                self.fetching.add(short)
            elif status == "Already exists":
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
         stall: float = PULL_STALL_TIMEOUT) -> int:
    """`docker pull` on a node; the bytes are the registry sizes of the layers it downloaded.

    The pull runs on a terminal (ssh -tt, or a pseudo-terminal here for a local engine), so docker
    prints its byte progress as the layers download and extract. A pull that prints nothing for
    `stall` seconds is stopped: the terminal hangs up, the docker CLI exits and the engine drops
    the pull, so the node keeps what it had.
    """
    argv = docker_argv(node, "pull", ref, tty=True)
    terminal = None
    try:
        if node.endpoint.startswith("ssh://"):
            # stdin stays open until the end: an early end of input is no reason for the pull to stop.
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=cli_env())
            out, err = proc.stdout, proc.stderr
        else:
            terminal, child = pty.openpty()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=cli_env(),
                                        start_new_session=True)
            finally:
                os.close(child)
            out, err = terminal, None
    except OSError as exc:
        if terminal is not None:
            os.close(terminal)
        raise NodeFailure(f"cannot run {argv[0]}: {exc.strerror}") from None
    dockercli.track(proc)  # Ctrl-C or SIGTERM on the head stops it: the node keeps what it had
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
    code = dockercli.finish(proc)
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
        raise NodeFailure(f"pull of {ref} failed: {reason or log.last or last_line(said, 'no message')}")
    return log.done


def layer_sizes(registry: Registry, tag: str) -> dict[str, int]:
    """Compressed size of each layer of tag in the registry, by the short ID `docker pull` prints."""
    ref = ImageRef.parse(tag)
    client = RegistryClient(registry.endpoint, deadline=CONTROL_TIMEOUT, window=CONTROL_TIMEOUT)
    try:
        manifest = client.manifest(ref.repository, ref.tag)
        if "manifests" in manifest:  # an index: the first linux manifest
            pick = next((m for m in manifest["manifests"]
                         if (m.get("platform") or {}).get("os", "linux") == "linux"), None)
            manifest = client.manifest(ref.repository, pick["digest"]) if pick else {}
        return {layer["digest"].partition(":")[2][:12]: int(layer["size"]) for layer in manifest.get("layers", [])}
    except (RegistryError, LookupError, TypeError, ValueError, AttributeError):
        # Sizes are for the progress and the byte counts only: a registry that does not answer here
        # is reported by the pulls themselves, so this never fails a deploy.
        return {}


def one_line(text: str) -> str:
    """A daemon's or a registry's message as one line: every run of whitespace becomes one space."""
    return " ".join(str(text).split())


# ------------------------------------------------------------------------ the registry process

REGISTRY_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "registry.sh"


def registry_command(action: str, reg: Registry) -> list[str]:
    """The scripts/registry.sh line that starts, stops or checks a cluster's registry."""
    argv = ["bash", str(REGISTRY_SCRIPT), action, reg.listen]
    if reg.cert and reg.key:
        argv += ["--cert", reg.cert, "--key", reg.key]
    if reg.ca:
        argv += ["--ca", reg.ca]
    return argv + ["--address", reg.address]


def run_registry(action: str, reg: Registry, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run scripts/registry.sh for a cluster's registry; a hang is one DistributeError line."""
    if action not in ("start", "stop", "status"):
        raise ConfigError(f"unknown action {action!r}; choose start, stop or status", field="registry")
    try:
        return subprocess.run(registry_command(action, reg), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DistributeError(f"scripts/registry.sh {action} gave no answer within {timeout:.0f}s",
                              field="registry") from None
