"""A file server over HTTPS on loopback, with a certificate from a test CA (gitserver.make_ca).

It serves what a test puts at a path (a patch, a wheel, an HTML page) and any file below an
optional folder, answers 404 for anything else, and counts the requests of each path, so that a
test can see that a file was downloaded once. `bundle` makes the full CA bundle (the system's plus
the test CA) that a build needs to reach both PyPI and this server.
"""

from __future__ import annotations

import http.server
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.gitserver import serve_https
from tests.support.paths import CA

SYSTEM_CA = Path(CA)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_state: FileServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        state = self.server_state
        path = self.path.partition("?")[0]
        state.requests[path] += 1
        body = state.files.get(path)
        if body is None and state.root is not None:
            candidate = (state.root / path.lstrip("/")).resolve()
            if candidate.is_file() and candidate.is_relative_to(state.root.resolve()):
                body = candidate.read_bytes()
        if body is None:
            self.send_response(404, "Not Found")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@dataclass
class FileServer:
    """A running HTTPS file server at `url`, trusted through the test CA `ca`."""

    url: str
    ca: Path
    root: Path | None
    files: dict[str, bytes] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)
    _server: http.server.ThreadingHTTPServer | None = None

    def put(self, path: str, body: bytes) -> str:
        """Serve body at path (e.g. "/patches/x.diff"); returns its URL."""
        self.files[path] = body
        return self.url + path

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start(certs: Path, root: Path | None = None, host: str = "127.0.0.1") -> FileServer:
    """Serve over HTTPS on a free port of host; certificates are made in certs."""
    state = FileServer("", Path(), root)
    state._server, state.url, state.ca = serve_https(type("Handler", (_Handler,), {"server_state": state}), certs, host)
    return state


def bundle(ca: Path, out: Path) -> Path:
    """A full CA bundle: the system's trusted CAs and the test CA, as --ca-cert takes it."""
    out.write_bytes(SYSTEM_CA.read_bytes() + b"\n" + ca.read_bytes())
    return out


def closed_port(host: str = "127.0.0.1") -> int:
    """A port on host where nothing listens (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # (host, port) of an AF_INET socket
        return port
