"""Origins for the tests of where a credential may go: HTTPS servers on loopback under one test CA of their own,
on 127.0.0.1 and on 127.0.0.2 (another host) and on two ports of 127.0.0.1 (another port), and a plain-HTTP one.

Each answers what a test routes to a path (a fixed answer, or a function of the request) and records every
request that reaches it with all its headers, so that a test can see which Authorization arrived where. A
plain-HTTP request that reaches an HTTPS origin's port is answered 400 and recorded too, marked `clear`: what
a client sent there travelled unencrypted.
"""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.gitserver import make_ca, read_body

OTHER_HOST = "127.0.0.2"  # a loopback address of its own: another host, as far as any client can tell


@dataclass(frozen=True)
class Asked:
    """One request as an origin received it."""

    method: str
    path: str  # with its query
    headers: dict[str, str]  # names in lower case
    body: bytes
    clear: bool  # plain HTTP on an HTTPS origin's port

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


Answer = tuple[int, dict[str, str], bytes]
Route = Answer | Callable[[Asked], Answer]


@dataclass
class Origin:
    """A running server at `url`; `routes` maps a path (without its query) to its answer, anything else is 404."""

    url: str
    routes: dict[str, Route] = field(default_factory=dict)
    asked: list[Asked] = field(default_factory=list)

    def route(self, path: str, status: int = 200, headers: dict[str, str] | None = None, body: bytes = b"") -> str:
        """Answer path with status, headers and body; returns the path's URL."""
        self.routes[path] = (status, headers or {}, body)
        return self.url + path

    def redirect(self, path: str, location: str, status: int = 302) -> str:
        return self.route(path, status, {"Location": location})

    def answer(self, asked: Asked) -> Answer:
        if asked.clear:
            return 400, {}, b"plain HTTP on an HTTPS port"
        route = self.routes.get(asked.path.partition("?")[0])
        if route is None:
            return 404, {}, b""
        return route(asked) if callable(route) else route

    def authorizations(self) -> list[str | None]:
        return [a.authorization for a in self.asked]

    def reset(self) -> None:
        self.routes.clear()
        self.asked.clear()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    origin: Origin

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _any(self) -> None:
        clear = isinstance(self.server, _Server) and self.server.tls is not None \
            and not isinstance(self.connection, ssl.SSLSocket)
        asked = Asked(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                      read_body(self.rfile, self.headers), clear)
        self.origin.asked.append(asked)
        status, headers, body = self.origin.answer(asked)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any


class _Server(http.server.ThreadingHTTPServer):
    """Speaks TLS to a client that starts a TLS handshake, and plain HTTP to one that does not."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = self.socket.accept()
        if self.tls is None:
            return sock, address
        sock.settimeout(5)
        try:
            first = sock.recv(1, socket.MSG_PEEK)
        except OSError:
            sock.close()
            raise
        if first == b"\x16":  # a TLS record: the client's hello; the handshake happens in the request's thread
            return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address
        return sock, address

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        pass  # a client that gave up (a refused certificate, a deadline) is what some tests want to see


def _start(host: str, tls: ssl.SSLContext | None) -> tuple[Origin, _Server]:
    origin = Origin("")
    server = _Server((host, 0), type("Handler", (_Handler,), {"origin": origin}))
    server.tls = tls
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    origin.url = f"{'https' if tls else 'http'}://{host}:{server.server_address[1]}"
    return origin, server


@dataclass(frozen=True)
class Origins:
    """The servers of one test: `main` (what the client is pointed at), `other_port` (same host, another port),
    `other_host` (127.0.0.2), all HTTPS under `ca`; `plain`, HTTP on 127.0.0.1."""

    ca: Path
    main: Origin
    other_port: Origin
    other_host: Origin
    plain: Origin

    def all(self) -> tuple[Origin, ...]:
        return self.main, self.other_port, self.other_host, self.plain


@contextmanager
def serve(certs: Path) -> Iterator[Origins]:
    """Start the four origins, with a test CA made in certs that signs one certificate for both addresses."""
    ca, crt, key = make_ca(certs, "127.0.0.1", OTHER_HOST)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    started = [_start("127.0.0.1", tls), _start("127.0.0.1", tls), _start(OTHER_HOST, tls), _start("127.0.0.1", None)]
    try:
        yield Origins(ca, *(origin for origin, _ in started))
    finally:
        for _, server in started:
            server.shutdown()
            server.server_close()
