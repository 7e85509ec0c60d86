"""The Registry v2 client against real HTTP servers on loopback: token flow, push and read, deadlines, errors."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from sparkforge.distribute.cluster import Registry
from sparkforge.distribute.nodes import layer_sizes
from sparkforge.recipe.resolve import Unreachable, registry_digest
from sparkforge.registry import MANIFEST_TYPES, Client, Endpoint, RegistryError
from tests.support import drip
from tests.support.limits import gives_up
from tests.support.gitserver import read_body

TOKEN = "t0k"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class _Store(http.server.BaseHTTPRequestHandler):
    """A small registry: blobs and manifests in memory, uploads by POST, chunked PATCH and PUT; with
    `auth`, every /v2 request needs the bearer token that /token hands out (the Docker token flow)."""

    protocol_version = "HTTP/1.1"
    auth = False
    digest_on_head = True
    blobs: dict[str, bytes]
    manifests: dict[str, bytes]
    uploads: dict[str, bytearray]
    seen: list[tuple[str, str, str | None, str | None]]  # method, path, Accept, Authorization

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _body(self) -> bytes:
        return read_body(self.rfile, self.headers)

    def _allowed(self) -> bool:
        cls = type(self)
        cls.seen.append((self.command, self.path, self.headers.get("Accept"), self.headers.get("Authorization")))
        if not cls.auth or self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        host = f"127.0.0.1:{self.server.server_address[1]}"
        self._answer(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
            "WWW-Authenticate": f'Bearer realm="http://{host}/token",service="reg",scope="repository:team/app:pull"'})
        return False

    def do_GET(self) -> None:
        if self.path.startswith("/token"):
            return self._answer(200, json.dumps({"token": TOKEN}).encode())
        self.do_HEAD()

    def do_HEAD(self) -> None:
        if not self._allowed():
            return
        cls = type(self)
        kind, _, name = self.path.removeprefix("/v2/team/app/").partition("/")
        if kind == "blobs" and name in cls.blobs:
            return self._answer(200, cls.blobs[name], {"Docker-Content-Digest": name})
        if kind == "manifests" and name in cls.manifests:
            body = cls.manifests[name]
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            head = {"Content-Type": OCI_MANIFEST, **({"Docker-Content-Digest": digest} if cls.digest_on_head else {})}
            return self._answer(200, body, head)
        self._answer(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}')

    def do_POST(self) -> None:
        self._body()
        if self._allowed():
            session = f"u{len(type(self).uploads)}"
            type(self).uploads[session] = bytearray()
            self._answer(202, headers={"Location": f"/v2/team/app/blobs/uploads/{session}?_state=x"})

    def do_PATCH(self) -> None:
        data = self._body()
        if self._allowed():
            session = self.path.split("?")[0].rsplit("/", 1)[1]
            type(self).uploads[session] += data
            self._answer(202, headers={"Location": f"/v2/team/app/blobs/uploads/{session}?_state=y"})

    def do_PUT(self) -> None:
        data = self._body()
        if not self._allowed():
            return
        cls, path, _, query = type(self), *self.path.partition("?")
        if "/manifests/" in path:
            cls.manifests[path.rsplit("/", 1)[1]] = data
            return self._answer(201, headers={"Docker-Content-Digest": "sha256:" + hashlib.sha256(data).hexdigest()})
        whole = bytes(cls.uploads.pop(path.rsplit("/", 1)[1])) + data
        digest = dict(p.split("=", 1) for p in query.split("&"))["digest"].replace("%3A", ":")
        if digest != "sha256:" + hashlib.sha256(whole).hexdigest():
            return self._answer(400, b'{"errors":[{"code":"DIGEST_INVALID","message":"digest did not match"}]}')
        cls.blobs[digest] = whole
        self._answer(201, headers={"Docker-Content-Digest": digest})


def _serve(handler: type[http.server.BaseHTTPRequestHandler], **state) -> Iterator[str]:
    cls = type("Handler", (handler,), {"blobs": {}, "manifests": {}, "uploads": {}, "seen": [], **state})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), cls)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", cls
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def store() -> Iterator[tuple[str, type[_Store]]]:
    yield from _serve(_Store)


@pytest.fixture
def locked_store() -> Iterator[tuple[str, type[_Store]]]:
    yield from _serve(_Store, auth=True, digest_on_head=False)


def test_endpoint_is_plain_http_only_for_a_loopback_registry_without_a_ca() -> None:
    assert Endpoint.of("127.0.0.1:5000").url == "http://127.0.0.1:5000"
    assert Endpoint.of("localhost:5000").url == "http://localhost:5000"
    assert Endpoint.of("nvcr.io").url == "https://nvcr.io"
    assert Endpoint.of("127.0.0.1:5000", ca="/ca.crt").url == "https://127.0.0.1:5000"
    assert Registry("10.0.0.1:5000", "", ca="/ca.crt").endpoint == Endpoint("10.0.0.1:5000", "https", "/ca.crt")
    assert Registry("10.0.0.1:5000", "").endpoint.url == "http://10.0.0.1:5000"


def test_push_and_read_back_a_chunked_layer_a_monolithic_config_and_a_manifest(store) -> None:
    host, cls = store
    client = Client(Endpoint.of(host))
    layer = [b"x" * 70000, b"", b"y" * 5]
    digest = "sha256:" + hashlib.sha256(b"".join(layer)).hexdigest()
    assert not client.blob_exists("team/app", digest)
    after = client.send_chunks("team/app", client.start_upload("team/app"), iter(layer))
    assert after.startswith(f"http://{host}/v2/team/app/blobs/uploads/")
    client.finish_upload("team/app", after, digest)
    assert client.blob_exists("team/app", digest) and cls.blobs[digest] == b"".join(layer)
    config = b'{"rootfs": {"diff_ids": []}}'
    config_digest = client.put_blob("team/app", config)
    assert cls.blobs[config_digest] == config
    posts = sum(1 for s in cls.seen if s[0] == "POST")
    assert client.put_blob("team/app", config) == config_digest  # held already: no second upload
    assert sum(1 for s in cls.seen if s[0] == "POST") == posts
    manifest = json.dumps({"schemaVersion": 2, "layers": [{"digest": digest, "size": 70005}]}).encode()
    stored = client.put_manifest("team/app", "1.0", manifest, OCI_MANIFEST)
    assert stored == "sha256:" + hashlib.sha256(manifest).hexdigest()
    assert client.manifest_digest("team/app", "1.0") == stored
    assert client.manifest("team/app", "1.0")["layers"][0]["size"] == 70005
    assert layer_sizes(Registry(host, ""), "team/app:1.0") == {digest[7:19]: 70005}
    assert all(MANIFEST_TYPES[0] in (s[2] or "") for s in cls.seen if "/manifests/" in s[1] and s[0] != "PUT")


def test_a_wrong_digest_at_the_end_of_an_upload_is_one_line_with_the_registry_s_reason(store) -> None:
    host, _ = store
    client = Client(Endpoint.of(host))
    location = client.send_chunks("team/app", client.start_upload("team/app"), iter([b"abc"]))
    with pytest.raises(RegistryError) as err:
        client.finish_upload("team/app", location, "sha256:" + "0" * 64)
    assert err.value.status == 400
    assert str(err.value) == (f"blob upload team/app@sha256:{'0' * 64} at {host}: HTTP 400 "
                              "(DIGEST_INVALID digest did not match)")


def test_the_token_flow_runs_once_and_a_head_without_digest_hashes_the_manifest(locked_store) -> None:
    host, cls = locked_store
    body = b'{"schemaVersion": 2, "manifests": []}'
    cls.manifests["1.0"] = body
    client = Client(Endpoint.of(host))
    assert client.manifest_digest("team/app", "1.0") == "sha256:" + hashlib.sha256(body).hexdigest()
    assert client.manifest("team/app", "1.0") == json.loads(body)
    asked = [s for s in cls.seen if s[1].startswith("/v2/")]
    assert [s[3] for s in asked] == [None, f"Bearer {TOKEN}", f"Bearer {TOKEN}", f"Bearer {TOKEN}"]
    assert [s[0] for s in asked] == ["HEAD", "HEAD", "GET", "GET"]  # no Docker-Content-Digest on HEAD: GET, hash
    with pytest.raises(RegistryError, match=rf"^manifest team/app:2.0 at {host}: HTTP 404 \(MANIFEST_UNKNOWN"):
        client.manifest("team/app", "2.0")
    # the recipe stage maps the client's errors to its own, as it always has
    assert registry_digest(f"{host}/team/app", "1.0") == "sha256:" + hashlib.sha256(body).hexdigest()
    with pytest.raises(Unreachable, match=rf"^{host} has no team/app:2.0$"):
        registry_digest(f"{host}/team/app", "2.0")


class _Refuses(_Store):
    """Hands out a token and then refuses it; or asks for Basic authentication."""

    basic = False

    def _allowed(self) -> bool:
        type(self).seen.append((self.command, self.path, None, self.headers.get("Authorization")))
        host = f"127.0.0.1:{self.server.server_address[1]}"
        challenge = 'Basic realm="reg"' if self.basic else f'Bearer realm="http://{host}/token",service="reg"'
        self._answer(401, headers={"WWW-Authenticate": challenge})
        return False


@pytest.mark.parametrize("basic, reason", [
    (False, "refused the token it issued"),
    (True, 'asks for authentication this tool does not do (Basic realm="reg")'),
])
def test_a_refused_token_or_another_kind_of_authentication_is_one_line(basic: bool, reason: str) -> None:
    for host, cls in _serve(_Refuses, basic=basic):
        with pytest.raises(RegistryError) as err:
            Client(Endpoint.of(host)).manifest("team/app", "1.0")
        assert str(err.value) == f"manifest team/app:1.0 at {host}: {reason}"
        assert err.value.status == 401
        assert len(cls.seen) == (1 if basic else 2)  # one retry with the token, never a loop


def test_a_registry_that_drips_bytes_is_given_up_at_the_deadline() -> None:
    with drip.serve(every=0.2, byte=b"{") as url:  # never silent for the window, never done before the guard
        host = url.removeprefix("http://")
        client = Client(Endpoint.of(host), deadline=1.0, window=0.5)
        err, seconds = gives_up(lambda: client.manifest("team/app", "1.0"))
    assert type(err) is RegistryError, err
    assert str(err) == f"manifest team/app:1.0 at {host}: not complete within 1s"
    assert seconds >= 1.0


def test_a_registry_that_is_not_there_is_one_line_naming_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: the connection is refused
        with pytest.raises(RegistryError) as err:
            Client(Endpoint.of(host)).blob_exists("team/app", "sha256:" + "a" * 64)
        assert str(err.value).startswith(f"blob team/app@sha256:{'a' * 64} at {host}: ")
        assert "refused" in str(err.value).lower() and "\n" not in str(err.value)
        assert err.value.status is None
        assert layer_sizes(Registry(host, ""), "team/app:1.0") == {}  # sizes are progress only


def test_a_ca_file_that_is_no_certificate_is_one_line_and_no_deploy_stops_on_it(tmp_path) -> None:
    bad = tmp_path / "ca.crt"
    bad.write_text("not a certificate\n")
    with pytest.raises(RegistryError) as err:
        Client(Endpoint("registry.lan:5443", "https", str(bad))).blob_exists("team/app", "sha256:" + "a" * 64)
    assert "registry.lan:5443" in str(err.value) and "\n" not in str(err.value)
    assert layer_sizes(Registry("registry.lan:5443", "", ca=str(bad)), "team/app:1.0") == {}  # progress only


class _Deaf(_Store):
    """Starts an upload, then reads nothing of the PATCH that should bring the layer, until the test is over."""

    over: threading.Event

    def do_PATCH(self) -> None:
        self.over.wait()


@pytest.mark.parametrize("window, transfer_deadline, reason", [
    (1.0, 60.0, "no answer within 1s"),  # a send blocked for the window
    (60.0, 2.0, "not complete within 2s"),  # the whole transfer's deadline, every send quick enough
], ids=["window", "deadline"])
def test_a_registry_that_stops_reading_an_upload_is_given_up_in_time(window: float, transfer_deadline: float,
                                                                     reason: str) -> None:
    def endless() -> Iterator[bytes]:
        while True:
            yield b"z" * (1 << 20)

    over = threading.Event()
    try:
        for host, _ in _serve(_Deaf, over=over):
            client = Client(Endpoint.of(host), deadline=60.0, transfer_deadline=transfer_deadline, window=window)
            location = client.start_upload("team/app")
            err, seconds = gives_up(lambda client=client, location=location: client.send_chunks(
                "team/app", location, endless()))
            over.set()
    finally:
        over.set()
    assert type(err) is RegistryError, err
    assert str(err) == f"blob upload team/app at {host}: {reason}"
    assert seconds >= min(window, transfer_deadline)
