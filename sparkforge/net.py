"""The one way sparkforge reads a URL: a time limit on the whole transfer, never from https to http.

A timer shuts the socket at the overall deadline (a per-read timeout alone lets a server that drips a byte now
and then hold a command for ever). Only http(s) URLs without a user or password are opened, never from https to
http, redirects included; credentials go only to their own origin, and no message shows a URL's password.
"""

from __future__ import annotations

import contextlib
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
from typing import IO
from collections.abc import Callable, Iterable, Iterator

from .errors import mask_secrets, mask_url

READ_TIMEOUT = 60.0  # seconds without a byte before a transfer is given up
HEADERS_TIME = 120.0  # seconds to connect and read the status line and headers
MIN_RATE = 1024  # bytes a body must bring in every READ_TIMEOUT seconds: a server dripping a byte now and then fails
CHUNK = 1 << 20
MAX_REDIRECTS = 10
SCHEMES = {"http": 80, "https": 443}  # the schemes ever opened, with their default ports
CREDENTIALS = ("authorization", "cookie")  # headers that go to one origin only


class FetchFailed(Exception):
    """The URL could not be read whole within its time (network, TLS, HTTP status, deadline)."""


def is_loopback(address: str) -> bool:
    """Whether HOST or HOST:PORT (or [IPv6]:PORT) is this machine: localhost or a loopback IP."""
    name = (address.rsplit(":", 1)[0] if address.count(":") == 1 else address).strip("[]")
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an absolute URL, spelled so that two spellings of one origin compare equal
    (lower case, IDN as ASCII, short IP form, default port filled in); ValueError without a host or port."""
    parts = urllib.parse.urlsplit(url)
    scheme, host, port = parts.scheme.lower(), parts.hostname or "", parts.port
    if not host or port == 0:
        raise ValueError(f"{mask_url(url)} names no host or port 0")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            host = host.encode("idna").decode("ascii").lower()
        except UnicodeError:
            pass  # not a name IDNA can spell: compared as written
    return scheme, host, port or SCHEMES.get(scheme, 0)


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs name one scheme, host and port (see origin); a URL without a host is no origin."""
    try:
        return origin(a) == origin(b)
    except ValueError:
        return False


def join(base: str, ref: str) -> str:
    """ref read relative to base; one urllib cannot parse is returned as it is, for `refusal` to refuse.
    The fragment stays: a `#` in a password would otherwise cut the URL before its `@` and unmask it."""
    try:
        return urllib.parse.urljoin(base, ref)
    except ValueError:
        return ref


def refusal(url: str, after: str | None = None) -> str | None:
    """Why url may not be opened, as the end of a sentence (`is not http or https`), or None when it may;
    coming `after` an https URL (a redirect, a location, a realm), it may not leave https."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        return "is not http or https"
    if mask_url(url) != url:
        return "carries a user or password (not supported)"
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return "holds a blank or a control character"
    try:
        origin(url)
    except ValueError:
        return "names no host or no valid port"
    if after is not None and after.lower().startswith("https://") and scheme.lower() != "https":
        return "leaves https"
    return None


class _Refused(Exception):
    """A redirect that may not be followed; its message says where to and why."""


class _Redirects(urllib.request.BaseHandler):
    """Follows a GET's or HEAD's redirects where `refusal` allows, credentials only within one origin; a
    redirect of any other method is the answer itself (a body is never sent twice, nor to another place)."""

    def __init__(self) -> None:
        self.hops = 0

    def http_error_302(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                       headers: Message) -> object:
        location = headers.get("Location")
        if location is None or req.get_method() not in ("GET", "HEAD"):
            return None  # the next handler raises the HTTPError that stands for the 3xx answer
        new = join(req.full_url, location)
        why = refusal(new, after=req.full_url)
        if why:
            raise _Refused(f"redirected to {mask_url(new)}, which {why}; refused")
        self.hops += 1
        if self.hops > MAX_REDIRECTS:
            raise _Refused(f"more than {MAX_REDIRECTS} redirects")
        stays = same_origin(new, req.full_url)
        kept = {name: value for name, value in req.headers.items()
                if name.lower() not in ("content-length", "content-type", "proxy-authorization")
                and (stays or name.lower() not in CREDENTIALS)}
        fp.close()  # the redirect's own body is not read: it may be of any size
        return self.parent.open(urllib.request.Request(new, headers=kept, method=req.get_method(),
                                                       origin_req_host=req.origin_req_host, unverifiable=True),
                                timeout=req.timeout)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class _Watch:
    """The sockets of one transfer, shut when its deadline passes."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.expired = False
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def arm(self, seconds: float) -> None:
        """Expire in `seconds`, in place of any deadline set before."""
        self.disarm()
        self.timer = threading.Timer(seconds, self.expire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

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
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _opener(watch: _Watch, ca_cert: Path | None) -> urllib.request.OpenerDirector:
    """An opener of http and https only (urllib's default one also opens file:, ftp: and data: URLs), whose
    sockets the watch can shut. The TLS context is made on the first https URL: the system's store is slow to load."""
    contexts: list[ssl.SSLContext] = []

    class Http(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            watch.add(self.sock)

    class Https(Http, http.client.HTTPSConnection):  # Http.connect runs around TLS's, so it adds the TLS socket
        pass

    class HttpHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(Http, req)

    class HttpsHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            if not contexts:  # the system's trust store, or the bundle given with --ca-cert instead of it
                contexts.append(ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None))
            return self.do_open(Https, req, context=contexts[0])

    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(), HttpHandler(),
                    HttpsHandler(), _Redirects(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def time_left(seconds: float) -> str:
    """A wait still to come, as every progress line says it: "about 1 min 05 s left", "about 40 s left"."""
    whole = max(0, round(seconds))
    return f"about {whole // 60} min {whole % 60:02d} s left" if whole >= 60 else f"about {whole} s left"


def byte_progress(say: Callable[[str], None], label: str, every: float = 5.0,
                  clock: Callable[[], float] = time.monotonic) -> Callable[[int, int | None], None]:
    """A progress callback for stream(): a line at most every `every` seconds (bytes, total, time left), and
    after such a line one when the body is whole; a download done within `every` seconds says nothing."""
    start = clock()
    last = [start]
    said = [False]

    def show(done: int, total: int | None) -> None:
        now = clock()
        whole = total is not None and done >= total
        if now - last[0] < every and not (whole and said[0]):
            return
        last[0], said[0] = now, True
        line = f"{label}: {done / 1e6:.1f}" + (f" of {total / 1e6:.1f} MB" if total else " MB")
        if total and not whole and done:
            line += f", {time_left((now - start) * (total - done) / done)}"
        say(line)
    return show


@contextlib.contextmanager
def _transfer(url: str, deadline: float, window: float, whole: bool) -> Iterator[tuple[str, _Watch]]:
    """(url masked, its watch) for one transfer; a URL `refusal` refuses is refused before urllib could open or
    print it, and every failure inside becomes one FetchFailed line."""
    shown = mask_url(url)
    why = refusal(url)
    if why:
        raise FetchFailed(f"{shown}: the URL {why}; refused")
    watch = _Watch()
    try:
        yield shown, watch
    except _Refused as exc:
        raise FetchFailed(f"{shown}: {exc}") from None
    except urllib.error.HTTPError as exc:
        raise FetchFailed(f"{shown}: HTTP {exc.code} {exc.reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # what urllib and its sockets raise
        cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc  # what went wrong under urllib
        if watch.expired:
            why = f"not complete within {deadline:.0f}s" + ("" if whole else f" (headers: {HEADERS_TIME:.0f}s)")
        elif isinstance(cause, ssl.SSLCertVerificationError):
            why = f"TLS certificate not trusted ({cause.verify_message}); give the CA bundle with --ca-cert"
        elif isinstance(cause, TimeoutError):
            why = f"no answer within {window:.0f}s"
        else:
            text = str(getattr(cause, "strerror", None) or cause)
            why = mask_secrets(text.splitlines()[0]) if text else type(cause).__name__
        raise FetchFailed(f"{shown}: {why}") from None
    finally:
        watch.disarm()


def stream(url: str, *, deadline: float, ca_cert: Path | None = None, window: float = READ_TIMEOUT,
           progress: Callable[[int, int | None], None] = lambda done, total: None) -> Iterator[bytes]:
    """The body of url in chunks, all of it within `deadline` seconds: the headers within HEADERS_TIME, and at
    least MIN_RATE bytes in every `window` seconds of the body. Raises FetchFailed with one line saying why."""
    with _transfer(url, deadline, window, whole=False) as (shown, watch):
        start = time.monotonic()
        watch.arm(min(deadline, HEADERS_TIME))
        with _opener(watch, ca_cert).open(urllib.request.Request(url, headers={"User-Agent": "sparkforge"}),
                                          timeout=window) as resp:
            watch.arm(max(0.0, deadline - (time.monotonic() - start)))
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


def get(url: str, *, deadline: float, ca_cert: Path | None = None, limit: int = 64 << 20,
        window: float = READ_TIMEOUT) -> bytes:
    """The whole body of url (at most `limit` bytes), within deadline seconds (see stream)."""
    body = bytearray()
    for chunk in stream(url, deadline=deadline, ca_cert=ca_cert, window=window):
        body += chunk
        if len(body) > limit:
            raise FetchFailed(f"{mask_url(url)}: more than {limit} bytes")
    return bytes(body)


@dataclass(frozen=True)
class Reply:
    """What a server answered to one request, whatever its status."""

    status: int
    headers: Message
    body: bytes
    url: str  # where the answer came from: the URL asked, or the last a redirect named


def request(method: str, url: str, *, deadline: float, body: bytes | Iterable[bytes] | None = None,
            headers: dict[str, str] | None = None, ca_cert: Path | None = None, window: float = READ_TIMEOUT,
            limit: int = 64 << 20) -> Reply:
    """One HTTP request of any method, answered whole within `deadline` seconds (body may be an iterable of chunks,
    sent chunked). An HTTP error status is a Reply too (a 401's challenge, a 404); no answer raises FetchFailed."""
    with _transfer(url, deadline, window, whole=True) as (shown, watch):
        watch.arm(deadline)
        req = urllib.request.Request(url, data=body, method=method,
                                     headers={"User-Agent": "sparkforge", **(headers or {})})
        try:
            resp = _opener(watch, ca_cert).open(req, timeout=window)
        except urllib.error.HTTPError as exc:
            resp = exc  # an error status is an answer: its headers and body are read as any other's
        with resp:
            data = resp.read(limit + 1)
            if watch.expired:
                raise TimeoutError
            if len(data) > limit:
                raise FetchFailed(f"{shown}: more than {limit} bytes")
            return Reply(resp.status, resp.headers, data, getattr(resp, "url", None) or url)
