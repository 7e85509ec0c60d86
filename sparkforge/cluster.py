"""Cluster stage input: which Docker endpoints are the nodes, and which registry they pull from.

A cluster file (``cluster.yaml``) names the nodes and their endpoints; the command line may
name nodes too, by cluster name or by endpoint. Everything is checked here, before any node
is contacted, so bad input stops the command with one line and nothing done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationError

from .config import NAME_RE, Strict, _validation_error, read_yaml
from .errors import ConfigError

# ssh://[user@]host[:port], tcp://host:port, unix:///absolute/path.sock
_HOST = r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?"
_SSH_RE = re.compile(rf"^ssh://([A-Za-z0-9._-]+@)?{_HOST}(:[0-9]{{1,5}})?$")
_TCP_RE = re.compile(rf"^tcp://{_HOST}:[0-9]{{1,5}}$")
_UNIX_RE = re.compile(r"^unix:///[A-Za-z0-9._/-]+$")
REGISTRY_RE = re.compile(rf"^{_HOST}(:[0-9]{{1,5}})?$")

ENDPOINT_HELP = "ssh://[user@]host[:port], tcp://host:port or unix:///path/to/docker.sock"


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


def _node_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a node name (lowercase letters, digits and '-')")
    return value


Endpoint = Annotated[str, AfterValidator(_endpoint)]
RegistryAddress = Annotated[str, AfterValidator(_registry)]
NodeName = Annotated[str, AfterValidator(_node_name)]


class NodeSpec(Strict):
    endpoint: Endpoint


class ClusterFile(Strict):
    """The schema of cluster.yaml."""

    registry: RegistryAddress | None = None
    nodes: dict[NodeName, NodeSpec] = Field(min_length=1)


@dataclass(frozen=True)
class Node:
    """One Docker engine of the cluster."""

    name: str
    endpoint: str


@dataclass(frozen=True)
class Cluster:
    """The nodes to act on, and the registry they pull from (None: no registry)."""

    nodes: tuple[Node, ...]
    registry: str | None
    source: str | None = None  # the cluster file, when one was read


def load_cluster_file(path: Path) -> ClusterFile:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError("a cluster file must be a YAML mapping with `nodes:` (see cluster.example.yaml)",
                          path=path)
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, path) from None


def check_registry(value: str, source: str = "--registry") -> str:
    try:
        return _registry(value)
    except ValueError as exc:
        raise ConfigError(str(exc), field=source) from None


def resolve_cluster(cluster_file: Path | None, nodes: list[str] | None, registry: str | None) -> Cluster:
    """The nodes and registry to use, from the cluster file and the command line.

    `nodes` entries are node names from the cluster file or endpoints; commas separate several.
    Without `nodes`, every node of the cluster file is used. `registry` overrides the file's.
    """
    spec = load_cluster_file(cluster_file) if cluster_file is not None else None
    known = {name: Node(name, s.endpoint) for name, s in (spec.nodes.items() if spec else ())}
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
            chosen.append(Node(_name_of(entry), entry))
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
    reg = check_registry(registry) if registry else (spec.registry if spec else None)
    return Cluster(tuple(seen.values()), reg, str(cluster_file) if cluster_file else None)


def _name_of(endpoint: str) -> str:
    """A readable name for a node given by endpoint: its host, or its socket's folder."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "unix":
        parts = [p for p in rest.split("/") if p]
        return parts[-2] if len(parts) >= 2 else rest
    host = rest.rpartition("@")[2]
    return host if scheme == "ssh" else host.replace(":", "-")
