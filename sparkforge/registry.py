"""The one Registry v2 client: manifests, blobs and uploads, every request within a deadline (net.request).

A 401 with a Bearer challenge gets the anonymous token flow, once: the token is asked from the challenge's
realm (https, or http only for a plain-http registry), trusting the registry's CA, and goes only to the
registry's own origin. Every failure is one RegistryError naming the host and what was asked.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from . import net
from .errors import mask_secrets, mask_url, visible
from .inimage.contract import JsonError, parse_json

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
CALL_DEADLINE = 60.0  # seconds for one small request: a manifest, a blob check, starting an upload, a token
TRANSFER_DEADLINE = 3600.0  # seconds for one blob upload, a layer of several GB on a slow link
WINDOW = 60.0  # seconds any one send or read may wait
_DIGEST = re.compile(r"\Asha256:[0-9a-f]{64}\Z")
_TOKEN = re.compile(r"\A[\x21-\x7e]+\Z")  # what may stand in an Authorization header after "Bearer "
_ACCEPT = {"Accept": ", ".join(MANIFEST_TYPES)}


class RegistryError(Exception):
    """A registry request got no usable answer; `status` is the HTTP status when there was one."""

    def __init__(self, host: str, what: str, reason: str, status: int | None = None):
        self.status = status
        super().__init__(visible(f"{what} at {host}: {reason}", keep_newlines=False))


@dataclass(frozen=True)
class Endpoint:
    """Where a registry answers: HOST[:PORT], over http or https, trusting `ca` (a CA bundle) or the system."""

    host: str
    scheme: str = "https"
    ca: str | None = None

    @classmethod
    def of(cls, host: str, ca: str | None = None) -> Endpoint:
        """https, except plain http for a loopback registry without a CA (what a local registry serves)."""
        return cls(host, "http" if net.is_loopback(host) and not ca else "https", ca)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"


@dataclass
class Client:
    """Requests to one registry; keeps the bearer token a 401 made it fetch, for the requests after."""

    endpoint: Endpoint
    deadline: float = CALL_DEADLINE
    transfer_deadline: float = TRANSFER_DEADLINE
    window: float = WINDOW
    token: str | None = field(default=None, repr=False)

    def manifest_digest(self, repo: str, ref: str) -> str:
        """The digest of repo:ref's manifest (an index when there is one): Docker-Content-Digest on HEAD, else
        the sha256 of the manifest itself."""
        what = f"manifest {repo}:{ref}"
        path = f"/v2/{repo}/manifests/{ref}"
        digest = self._ok(what, self._send(what, "HEAD", path, headers=_ACCEPT)).headers.get("Docker-Content-Digest")
        if not digest:  # not every registry sends it on HEAD
            body = self._ok(what, self._send(what, "GET", path, headers=_ACCEPT)).body
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if not _DIGEST.match(digest):
            raise RegistryError(self.endpoint.host, what, f"answered an unexpected digest {digest[:80]!r}")
        return digest

    def manifest(self, repo: str, ref: str) -> dict[str, Any]:
        """repo:ref's manifest or index, as JSON."""
        what = f"manifest {repo}:{ref}"
        reply = self._ok(what, self._send(what, "GET", f"/v2/{repo}/manifests/{ref}", headers=_ACCEPT))
        try:
            data = parse_json(reply.body)
        except JsonError as exc:  # also a key written twice, or nesting deeper than the parser goes
            raise RegistryError(self.endpoint.host, what, f"the answer is not a JSON manifest ({exc})") from None
        if not isinstance(data, dict):
            raise RegistryError(self.endpoint.host, what, "the answer is not a JSON manifest")
        return data

    def put_manifest(self, repo: str, tag: str, body: bytes, media_type: str) -> str | None:
        """Store body as repo:tag; the digest the registry says it stored (None when it does not say)."""
        what = f"manifest upload {repo}:{tag}"
        reply = self._ok(what, self._send(what, "PUT", f"/v2/{repo}/manifests/{tag}", body,
                                          {"Content-Type": media_type}))
        return reply.headers.get("Docker-Content-Digest")

    def blob_exists(self, repo: str, digest: str) -> bool:
        what = f"blob {repo}@{digest}"
        reply = self._send(what, "HEAD", f"/v2/{repo}/blobs/{digest}")
        if reply.status == 404:
            return False
        self._ok(what, reply)
        return True

    def put_blob(self, repo: str, data: bytes) -> str:
        """Upload data as one blob in one request, unless the registry holds it already; its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self.blob_exists(repo, digest):
            self.finish_upload(repo, self.start_upload(repo), digest, data)
        return digest

    def start_upload(self, repo: str) -> str:
        """A new upload session's location, for :meth:`send_chunks` and :meth:`finish_upload`."""
        what = f"blob upload {repo}"
        reply = self._ok(what, self._send(what, "POST", f"/v2/{repo}/blobs/uploads/", b""))
        return self._location(what, reply)

    def send_chunks(self, repo: str, location: str, chunks: Iterable[bytes]) -> str:
        """Stream chunks into an upload session in one chunked PATCH; the location to go on with."""
        what = f"blob upload {repo}"
        reply = self._ok(what, self._send(what, "PATCH", location, chunks,
                                          {"Content-Type": "application/octet-stream"}, long=True))
        return self._location(what, reply)

    def finish_upload(self, repo: str, location: str, digest: str, data: bytes = b"") -> None:
        """Close an upload session with its last bytes (all of a monolithic upload's), naming the digest."""
        url = f"{location}{'&' if '?' in location else '?'}digest={urllib.parse.quote(digest)}"
        what = f"blob upload {repo}@{digest}"
        self._ok(what, self._send(what, "PUT", url, data, {"Content-Type": "application/octet-stream",
                                                           "Content-Length": str(len(data))}, long=True))

    def _send(self, what: str, method: str, path: str, body: bytes | Iterable[bytes] | None = None,
              headers: dict[str, str] | None = None, long: bool = False) -> net.Reply:
        """One request (a path on the endpoint, or a URL the registry gave); on the registry's own 401, a token and
        the request once more (not a streamed body, which cannot be sent twice)."""
        url = net.join(self.endpoint.url + "/", path)
        for attempt in (1, 2):
            sent = dict(headers or {})
            if self.token and net.same_origin(url, self.endpoint.url):
                sent["Authorization"] = f"Bearer {self.token}"
            try:
                reply = net.request(method, url, deadline=self.transfer_deadline if long else self.deadline,
                                    body=body, headers=sent, window=self.window, ca_cert=self._ca)
            except net.FetchFailed as exc:
                raise RegistryError(self.endpoint.host, what, _after_url(str(exc), url)) from None
            if (reply.status != 401 or attempt == 2 or not isinstance(body, (bytes, type(None)))
                    or not net.same_origin(reply.url, self.endpoint.url)):
                return reply
            self.token = self._fetch_token(what, reply.headers.get("WWW-Authenticate", ""))
        raise AssertionError("unreachable")

    @property
    def _ca(self) -> Path | None:
        return Path(self.endpoint.ca) if self.endpoint.ca else None

    def _fetch_token(self, what: str, challenge: str) -> str:
        """An anonymous token for the scope a 401 asks for (the Docker token flow), from the challenge's realm."""
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", None)
        if not realm or not challenge.lower().startswith("bearer"):
            raise RegistryError(self.endpoint.host, what, "asks for authentication this tool does not do "
                                f"({mask_secrets(challenge)[:60]})", 401)
        shown = mask_url(realm)
        why = net.refusal(realm, after=self.endpoint.url)
        if why:
            raise RegistryError(self.endpoint.host, what, f"its token realm {shown} {why}; refused", 401)
        query = urllib.parse.urlencode({k: v for k, v in params.items() if k in ("service", "scope")})
        url = f"{realm}{'&' if '?' in realm else '?'}{query}"
        try:
            reply = net.request("GET", url, deadline=self.deadline, window=self.window, ca_cert=self._ca, limit=1 << 20)
            body = parse_json(reply.body) if reply.status == 200 else None
        except (net.FetchFailed, ValueError) as exc:
            raise RegistryError(self.endpoint.host, what, f"cannot get a token from {shown}: "
                                f"{_after_url(str(exc), url)}", 401) from None
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not isinstance(token, str) or not _TOKEN.match(token):
            why = f"HTTP {reply.status}" if reply.status != 200 else "no token in its answer"
            raise RegistryError(self.endpoint.host, what, f"cannot get a token from {shown}: {why}", 401)
        return token

    def _ok(self, what: str, reply: net.Reply) -> net.Reply:
        """reply when its status is a success; else the RegistryError saying which status."""
        if 200 <= reply.status < 300:
            return reply
        if reply.status == 401 and not net.same_origin(reply.url, self.endpoint.url):
            reason = f"HTTP 401 from {mask_url(reply.url)}, another origin, which the registry's token never goes to"
        elif reply.status == 401 and self.token:
            reason = "refused the token it issued"
        else:  # with the first error of a registry's JSON error body, `{"errors": [{"code", "message"}]}`
            try:
                first = parse_json(reply.body)["errors"][0]
                text = mask_secrets(" ".join(str(first.get(k) or "") for k in ("code", "message")).strip())
            except (ValueError, LookupError, TypeError, AttributeError):
                text = ""
            # Masked before it is cut: a cut URL would hide its '@'.
            reason = f"HTTP {reply.status}" + (f" ({text[:200]})" if text else "")
        raise RegistryError(self.endpoint.host, what, reason, reply.status)

    def _location(self, what: str, reply: net.Reply) -> str:
        """The upload location an answer names, made absolute; refused where `net.refusal` says (on another
        origin it is used, without the token)."""
        location = reply.headers.get("Location")
        if not location:
            raise RegistryError(self.endpoint.host, what, f"HTTP {reply.status} without a Location to upload to")
        url = net.join(reply.url, location)
        why = net.refusal(url, after=self.endpoint.url)
        if why:
            raise RegistryError(self.endpoint.host, what, f"its upload location {mask_url(url)} {why}; refused")
        return urllib.parse.urldefrag(url).url  # the digest is added as a query, which must not land in a fragment


def _after_url(message: str, url: str) -> str:
    """net's message without the URL it starts with: the RegistryError names host and request already."""
    head = mask_url(url) + ": "
    return message[len(head):] if message.startswith(head) else message
