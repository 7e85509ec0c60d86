"""The one way sparkforge reads a URL: a time limit on the whole transfer, never from https to http.

A per-read timeout alone lets a server that sends one byte every 20 s hold a command for ever, so
every transfer also has an overall deadline: a timer shuts the connection's socket when it passes,
which ends a read or send blocked anywhere (status line, headers or body). A redirect may not leave
https, and no message repeats the user and password of a URL (errors.mask_secrets). `stream` and `get`
read a URL; `request` sends one request of any method (the Registry v2 client, sparkforge/registry.py).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .errors import mask_secrets

READ_TIMEOUT = 60.0  # seconds without a byte before a transfer is given up
HEADERS_TIME = 120.0  # seconds to connect and read the status line and headers
MIN_RATE = 1024  # bytes a body must bring in every READ_TIMEOUT seconds: a server dripping a byte now and then fails
CHUNK = 1 << 20


class FetchFailed(Exception):
    """The URL could not be read whole within its time (network, TLS, HTTP status, deadline)."""


def is_loopback(address: str) -> bool:
    """Whether HOST or HOST:PORT (or [IPv6]:PORT) is this machine: localhost or a loopback IP."""
    name = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def tls_context(ca_cert: Path | None) -> ssl.SSLContext:
    """The system's trust store, or the bundle given with --ca-cert instead of it."""
    return ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)


class _HttpsOnlyRedirect(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only when it stays on https (or the first URL was plain http already)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = urllib.parse.urljoin(req.full_url, newurl)
        if urllib.parse.urlsplit(req.full_url).scheme == "https" and urllib.parse.urlsplit(new).scheme != "https":
            raise FetchFailed(f"redirected to {mask_secrets(new)}, which leaves https; refused")
        return super().redirect_request(req, fp, code, msg, headers, new)


class _Watch:
    """The sockets of one transfer, shut when its deadline passes."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.expired = False
        self.lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.socks:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _handlers(watch: _Watch, context: ssl.SSLContext) -> list[urllib.request.BaseHandler]:
    class Http(http.client.HTTPConnection):
        def connect(self):
            super().connect()
            watch.add(self.sock)

    class Https(http.client.HTTPSConnection):
        def connect(self):
            super().connect()
            watch.add(self.sock)

    class HttpHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(Http, req)

    class HttpsHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(Https, req, context=context)

    return [HttpHandler(), HttpsHandler(context=context), _HttpsOnlyRedirect()]


def stream(url: str, *, deadline: float, ca_cert: Path | None = None, window: float = READ_TIMEOUT,
           progress: Callable[[int, int | None], None] = lambda done, total: None) -> Iterator[bytes]:
    """The body of url in chunks, all of it within `deadline` seconds: the headers within HEADERS_TIME,
    and at least MIN_RATE bytes in every `window` seconds of the body (no read waits longer than window).

    Raises FetchFailed with one line saying why; the URL in it has its user and password masked."""
    shown = _shown(url)
    watch = _Watch()
    start = time.monotonic()
    timer = threading.Timer(min(deadline, HEADERS_TIME), watch.expire)
    timer.daemon = True
    request = urllib.request.Request(url, headers={"User-Agent": "sparkforge"})
    timer.start()
    try:
        opener = urllib.request.build_opener(*_handlers(watch, tls_context(ca_cert)))
        with opener.open(request, timeout=window) as resp:
            timer.cancel()
            timer = threading.Timer(max(0.0, deadline - (time.monotonic() - start)), watch.expire)
            timer.daemon = True
            timer.start()
            total = int(resp.headers.get("Content-Length") or 0) or None
            done = 0
            window_start, window_bytes = time.monotonic(), 0
            while True:
                chunk = resp.read1(CHUNK) if hasattr(resp, "read1") else resp.read(CHUNK)
                if watch.expired:
                    raise TimeoutError
                if not chunk:
                    break
                done += len(chunk)
                window_bytes += len(chunk)
                now = time.monotonic()
                if now - window_start >= window:
                    if window_bytes < MIN_RATE:
                        raise FetchFailed(f"{shown}: {window_bytes} bytes in {now - window_start:.0f}s, too slow to "
                                          "be a working server; given up")
                    window_start, window_bytes = now, 0
                progress(done, total)
                yield chunk
            if total is not None and done < total:
                raise FetchFailed(f"{shown}: the connection ended after {done} of {total} bytes")
    except FetchFailed:
        raise
    except urllib.error.HTTPError as exc:
        raise FetchFailed(f"{shown}: HTTP {exc.code} {exc.reason}") from None
    except _FAILURES as exc:
        raise FetchFailed(f"{shown}: {_reason(exc, watch, deadline, window)}") from None
    finally:
        timer.cancel()


def get(url: str, *, deadline: float, ca_cert: Path | None = None, limit: int = 64 << 20,
        window: float = READ_TIMEOUT) -> bytes:
    """The whole body of url (at most `limit` bytes), within deadline seconds (see stream)."""
    body = bytearray()
    for chunk in stream(url, deadline=deadline, ca_cert=ca_cert, window=window):
        body += chunk
        if len(body) > limit:
            raise FetchFailed(f"{mask_secrets(url)}: more than {limit} bytes")
    return bytes(body)


@dataclass(frozen=True)
class Reply:
    """What a server answered to one request, whatever its status."""

    status: int
    headers: Message
    body: bytes


def request(method: str, url: str, *, deadline: float, body: bytes | Iterable[bytes] | None = None,
            headers: dict[str, str] | None = None, ca_cert: Path | None = None, window: float = READ_TIMEOUT,
            limit: int = 64 << 20) -> Reply:
    """One HTTP request of any method, sent and answered whole within `deadline` seconds, no send or read
    waiting longer than `window`. body may be an iterable of chunks (sent chunked, for a stream of unknown
    length). An HTTP error status is a Reply too, for the caller to read (a 401's challenge, a 404);
    a failure to get any answer raises FetchFailed with one line, as stream does."""
    shown = _shown(url)
    watch = _Watch()
    timer = threading.Timer(deadline, watch.expire)
    timer.daemon = True
    req = urllib.request.Request(url, data=body, method=method, headers={"User-Agent": "sparkforge", **(headers or {})})
    timer.start()
    try:
        opener = urllib.request.build_opener(*_handlers(watch, tls_context(ca_cert)))
        try:
            resp = opener.open(req, timeout=window)
        except urllib.error.HTTPError as exc:
            resp = exc  # an error status is an answer: its headers and body are read as any other's
        with resp:
            data = resp.read(limit + 1)
            if watch.expired:
                raise TimeoutError
            if len(data) > limit:
                raise FetchFailed(f"{shown}: more than {limit} bytes")
            return Reply(resp.status, resp.headers, data)
    except FetchFailed:
        raise
    except _FAILURES as exc:
        raise FetchFailed(f"{shown}: {_reason(exc, watch, deadline, window, whole=True)}") from None
    finally:
        timer.cancel()


def _shown(url: str) -> str:
    """url with its user and password masked, for messages; a URL that carries either is refused here, since
    urllib would read the password as a port and print it in its error."""
    shown = mask_secrets(url)
    if "@" in urllib.parse.urlsplit(url).netloc:
        raise FetchFailed(f"{shown}: a user or password in the URL is not supported")
    return shown


# What urllib and the sockets under it raise when no answer comes (urllib's URLError is an OSError).
_FAILURES = (OSError, ssl.SSLError, http.client.HTTPException, ValueError)


def _reason(exc: object, watch: _Watch, deadline: float, window: float = READ_TIMEOUT, whole: bool = False) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason  # what went wrong under urllib: a refused connection, a timeout, a TLS error
    if watch.expired:
        return f"not complete within {deadline:.0f}s" + ("" if whole else f" (headers: {HEADERS_TIME:.0f}s)")
    if isinstance(exc, FetchFailed):
        return str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted ({exc.verify_message}); give the CA bundle with --ca-cert"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within {window:.0f}s"
    text = str(getattr(exc, "strerror", None) or exc)
    return mask_secrets(text.splitlines()[0]) if text else type(exc).__name__
