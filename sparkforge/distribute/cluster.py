"""Cluster stage input: the nodes (from ``cluster.yaml`` or the command line), their ssh options, the registry and
its process (scripts/registry.sh); all checked before any node is contacted, so bad input stops with one line."""

from __future__ import annotations

import contextlib
import ipaddress
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationError, model_validator

from ..inimage import proc
from ..errors import ConfigError, DistributeError, SparkforgeError
from ..net import is_loopback
from ..recipe.config import read_yaml, validation_error
from ..recipe.fields import HOST, NAME_RE, PORT, host_problem
from ..recipe.schema import Strict
from ..registry import Endpoint as RegistryEndpoint

# ssh://[user@]host[:port], tcp://host:port, unix:///absolute/path.sock; a user name as useradd takes one.
SSH_RE = re.compile(rf"\Assh://(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]*@)?(?P<host>{HOST})(:(?P<port>{PORT}))?\Z")
_TCP_RE = re.compile(rf"\Atcp://(?P<host>{HOST}):(?P<port>{PORT})\Z")
_UNIX_RE = re.compile(r"\Aunix://(?P<path>(/[A-Za-z0-9._-]+)+)\Z")
REGISTRY_RE = re.compile(rf"\A(?P<host>{HOST})(:{PORT})?\Z")
LISTEN_RE = re.compile(rf"\A[0-9.]+:{PORT}\Z")
SSH_PORT = "22"
ENDPOINT_HELP = "ssh://[user@]host[:port], tcp://host:port or unix:///path/to/docker.sock"


def _endpoint_match(value: str) -> re.Match[str] | None:
    return SSH_RE.fullmatch(value) or _TCP_RE.fullmatch(value) or _UNIX_RE.fullmatch(value)


def endpoint_problem(value: str) -> str | None:
    """Why value is not a Docker endpoint, or None when it is one."""
    m = _endpoint_match(value)
    port = re.search(r":([0-9]+)\Z", value)
    if m is None and port and _endpoint_match(value[:port.start(1)] + "1"):
        return f"{value!r} is not a Docker endpoint: port {port[1]} is not one of 1-65535 (written without leading zeros)"
    if m is None:
        return f"{value!r} is not a Docker endpoint ({ENDPOINT_HELP})"
    found = m.groupdict()
    if found.get("host") and (problem := host_problem(found["host"])):
        return f"{value!r} is not a Docker endpoint: {problem}"
    if found.get("path") and any(part in (".", "..") for part in found["path"].split("/")):
        return f"{value!r} is not a Docker endpoint: write the socket's path without '.' or '..'"
    return None


def engine_of(endpoint: str) -> tuple[str, str, str]:
    """(scheme, host or socket path, port) naming the engine an endpoint reaches, however it is spelt."""
    m = _endpoint_match(endpoint)
    if m is None:
        return ("", endpoint, "")
    found = m.groupdict()
    if "path" in found:
        return ("unix", found["path"], "")
    return (endpoint.partition("://")[0], found["host"].lower(), found.get("port") or SSH_PORT)


def _endpoint(value: str) -> str:
    if problem := endpoint_problem(value):
        raise ValueError(problem)
    return value


def _registry(value: str) -> str:
    m = REGISTRY_RE.fullmatch(value)
    problem = host_problem(m["host"]) if m else None
    if m is None or problem:
        raise ValueError(f"{value!r} is not a registry address HOST:PORT (e.g. 10.0.0.1:5000)"
                         + (f": {problem}" if problem else ""))
    return value


def _listen(value: str) -> str:
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Address(value.rpartition(":")[0])
        if LISTEN_RE.fullmatch(value):
            return value
    raise ValueError(f"{value!r} is not an address to listen on, IPv4:PORT (e.g. 0.0.0.0:5000)")


def _node_name(value: str) -> str:
    if not NAME_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a node name (lowercase letters, digits and '-')")
    return value


def _local_path(value: str) -> str:
    if not value.strip() or not value.isprintable():
        raise ValueError(f"{value!r} is not a path (no control characters or line breaks)")
    return value


def _known_hosts(value: str) -> str:
    if any(ch.isspace() for ch in _local_path(value)):  # ssh splits UserKnownHostsFile at whitespace
        raise ValueError(f"{value!r}: ssh would read a path with a space as several files; move the file")
    return value


RegistryAddress = Annotated[str, AfterValidator(_registry)]
LocalPath = Annotated[str, AfterValidator(_local_path)]


class NodeSpec(Strict):
    endpoint: Annotated[str, AfterValidator(_endpoint)]


class SshSpec(Strict):
    """How ssh:// nodes are reached; host keys are always checked."""

    known_hosts: Annotated[str, AfterValidator(_known_hosts)] | None = None
    identity_file: LocalPath | None = None
    connect_timeout: int = Field(10, ge=1, le=120)


class TlsSpec(Strict):
    """The registry's certificate and key, and the CA that signed it (what nodes trust)."""

    cert: LocalPath
    key: LocalPath
    ca: LocalPath


class RegistrySpec(Strict):
    """Where the registry listens, the address nodes pull from, and how it is secured."""

    address: RegistryAddress
    listen: Annotated[str, AfterValidator(_listen)] | None = None
    tls: TlsSpec | None = None
    insecure: bool = False

    @model_validator(mode="after")
    def _one_way(self) -> RegistrySpec:
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
    nodes: dict[Annotated[str, AfterValidator(_node_name)], NodeSpec] = Field(min_length=1)


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
    registry_spec: Registry | None = None


def load_cluster_file(path: Path) -> ClusterFile:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError("a cluster file must be a YAML mapping with `nodes:` (see cluster.example.yaml)", path=path)
    try:
        spec = ClusterFile.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path, data) from None
    engines: dict[tuple[str, str, str], str] = {}
    for name, node in spec.nodes.items():
        if (other := engines.setdefault(engine_of(node.endpoint), name)) != name:
            raise ConfigError(f"{node.endpoint} reaches the engine of node {other} ({spec.nodes[other].endpoint}); "
                              "list each engine once", path=path, field=f"nodes.{name}.endpoint")
    ssh, tls = spec.ssh, spec.registry.tls if isinstance(spec.registry, RegistrySpec) else None
    files = {"ssh.known_hosts": ssh and ssh.known_hosts, "ssh.identity_file": ssh and ssh.identity_file}
    if tls is not None:
        files |= {"registry.tls.cert": tls.cert, "registry.tls.key": tls.key, "registry.tls.ca": tls.ca}
    for fld, value in files.items():
        if value and not _resolve(path, value).is_file():
            raise ConfigError(f"file not found: {_resolve(path, value)}", path=path, field=fld)
    return spec


def _resolve(cluster_file: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (cluster_file.parent / p)


def registry_of(path: Path | None, spec: ClusterFile | None = None) -> Registry | None:
    """The registry a cluster file (its spec, when read already) names, with its defaults filled in."""
    reg = (spec or load_cluster_file(path)).registry if path is not None else None
    if path is None or reg is None:
        return None
    if isinstance(reg, str):
        reg = RegistrySpec(address=reg, insecure=not is_loopback(reg))
    port = reg.address.rpartition(":")[2] if ":" in reg.address else "5000"
    listen = reg.listen or f"{'127.0.0.1' if is_loopback(reg.address) else '0.0.0.0'}:{port}"
    tls = [str(_resolve(path, f)) for f in (reg.tls.cert, reg.tls.key, reg.tls.ca)] if reg.tls else []
    return Registry(reg.address, listen, *tls)


def check_registry(value: str) -> str:
    try:
        return _registry(value)
    except ValueError as exc:
        raise ConfigError(str(exc), field="--registry") from None


def push_registry(address: str | None, cluster_file: Path | None) -> Registry:
    """The registry `push` sends to: the address given, else the cluster file's registry (with its TLS)."""
    if address:
        return Registry(check_registry(address), "")
    if (spec := registry_of(cluster_file)) is None:
        raise SparkforgeError("no registry: pass --registry HOST:PORT or set registry: in the cluster file "
                              "(make registry starts one on 127.0.0.1:5000)", field="--registry")
    return spec


def registry_to_run(cluster_file: Path | None) -> Registry:
    """The registry the `registry` verb starts, stops or checks: the cluster file's, else one on 127.0.0.1:5000."""
    return registry_of(cluster_file) or Registry("127.0.0.1:5000", "127.0.0.1:5000")


def resolve_cluster(cluster_file: Path | None, nodes: list[str] | None, registry: str | None) -> Cluster:
    """The nodes (names from the cluster file or endpoints, comma-separated; default all) and the registry to use."""
    spec = load_cluster_file(cluster_file) if cluster_file is not None else None
    ssh = SshOptions()
    if spec is not None and cluster_file is not None and (s := spec.ssh) is not None:
        ssh = SshOptions(str(_resolve(cluster_file, s.known_hosts)) if s.known_hosts else None,
                         str(_resolve(cluster_file, s.identity_file)) if s.identity_file else None, s.connect_timeout)
    known = {name: Node(name, s.endpoint, ssh) for name, s in (spec.nodes.items() if spec else ())}
    wanted = [part.strip() for entry in (nodes or []) for part in entry.split(",") if part.strip()]
    if not wanted and spec is None:
        raise ConfigError("no nodes: name them with --nodes (names or endpoints), or write a cluster "
                          "file (see cluster.example.yaml) and pass --cluster FILE", field="--nodes")
    chosen = [] if wanted else list(known.values())
    for entry in wanted:
        if entry in known:
            chosen.append(known[entry])
        elif endpoint_problem(entry) is None:
            chosen.append(Node(_name_of(entry), entry, ssh))
        elif "://" in entry:
            raise ConfigError(endpoint_problem(entry) or entry, field="--nodes")
        else:
            names = ", ".join(sorted(known)) or "none: no cluster file was read"
            raise ConfigError(f"unknown node {entry!r} (known nodes: {names})", path=cluster_file, field="--nodes")
    seen: dict[str, Node] = {}
    for node in chosen:
        engine = engine_of(node.endpoint)
        if node.name in seen and engine_of(seen[node.name].endpoint) != engine:
            raise ConfigError(f"two nodes are named {node.name!r}; name them in a cluster file", field="--nodes")
        twin = next((n for n in seen.values() if engine_of(n.endpoint) == engine and n.name != node.name), None)
        if twin is not None:
            raise ConfigError(f"{node.endpoint} reaches the engine of node {twin.name} ({twin.endpoint}); name each "
                              "engine once", field="--nodes")
        seen.setdefault(node.name, node)
    reg_spec = registry_of(cluster_file, spec)
    if registry:
        address = check_registry(registry)
        if reg_spec is None or reg_spec.address != address:
            reg_spec = Registry(address, f"127.0.0.1:{address.rpartition(':')[2]}")
    return Cluster(tuple(seen.values()), reg_spec.address if reg_spec else None, reg_spec)


def _name_of(endpoint: str) -> str:
    """A readable name for a node given by endpoint, one per engine: its host (and port but 22), or socket folder."""
    scheme, host, port = engine_of(endpoint)
    if scheme == "unix":
        parts = [p for p in host.split("/") if p]
        return parts[-2] if len(parts) >= 2 else host
    return host if scheme == "ssh" and port == SSH_PORT else f"{host}-{port}"


REGISTRY_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "registry.sh"


def registry_command(action: str, reg: Registry) -> list[str]:
    """The scripts/registry.sh line that starts, stops or checks a cluster's registry."""
    argv = ["bash", str(REGISTRY_SCRIPT), action, reg.listen]
    if reg.cert and reg.key:
        argv += ["--cert", reg.cert, "--key", reg.key]
    if reg.ca:
        argv += ["--ca", reg.ca]
    return argv + ["--address", reg.address]


def run_registry(action: str, reg: Registry, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run scripts/registry.sh for a cluster's registry; a hang is one DistributeError line."""
    if action not in ("start", "stop", "status"):
        raise ConfigError(f"unknown action {action!r}; choose start, stop or status", field="registry")
    try:
        return proc.run(registry_command(action, reg), what=f"scripts/registry.sh {action}", capture_output=True,
                        text=True, timeout=timeout)
    except proc.CommandError as exc:
        raise DistributeError(str(exc), field="registry") from None
