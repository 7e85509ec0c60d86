"""What a node must have before `launch` starts a rank there, checked inside the image on the node's network: the
model folder, the ports the rank binds, and the interface that leads to the master, which GLOO and NCCL are told
to use (a host name that resolves to another address, or to loopback, would leave the ranks unable to meet)."""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .contract import Document

SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class Preflight(Document):
    address: str | None  # this node's address on the way to the master
    ifname: str | None  # the interface that holds it
    problems: list[str] = field(default_factory=list)


def interface_of(address: str) -> str | None:
    """The name of the interface that holds an IPv4 address, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def port_problem(port: int) -> str | None:
    """Why the port cannot be bound on every address, or None; as a server binds it, a connection of a server
    stopped a moment ago, still closing, does not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            return f"port {port}: {why}"
    return None


def preflight(master: str, master_port: int, ports: list[int], model: str | None) -> Preflight:
    problems = []
    if model is not None and not (Path(model) / "config.json").is_file():
        problems.append(f"{model}: no config.json (is the model folder on this node, at the same path?)")
    problems += [p for p in (port_problem(port) for port in ports) if p]
    try:  # the local IPv4 address the kernel picks to reach the master (a UDP connect sends no packet)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(master), master_port))
            address = str(sock.getsockname()[0])
    except OSError as exc:
        problems.append(f"no route to the master {master}: {exc.strerror or exc}")
        return Preflight(None, None, problems)
    ifname = interface_of(address)
    if ifname is None:
        problems.append(f"no interface holds {address}, the address that leads to the master {master}")
    return Preflight(address, ifname, problems)
