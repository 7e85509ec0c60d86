"""A token goes only to the origin that asked for it: real HTTPS servers on loopback under a test CA of their own
(tests.support.origins) redirect a request, name an upload location or a token realm on another host, another
port, plain HTTP or another scheme, and record what reaches them. No Authorization, Cookie or password arrives
anywhere but the origin it was given for, nothing leaves https, and only http(s) is ever opened."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkforge import net
from sparkforge.recipe import download
from sparkforge.recipe.resolve import Unreachable, registry_digest
from sparkforge.registry import Client, Endpoint, RegistryError
from tests.support import origins
from tests.support.origins import Asked, Origin, Origins

CODES = (301, 302, 303, 307, 308)
SECRET = "Bearer s3cret-t0ken"
TOKEN = "t0ken-from-the-realm"
MANIFEST = b'{"schemaVersion": 2, "layers": []}'


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Origins]:
    with origins.serve(tmp_path_factory.mktemp("certs")) as started:
        yield started


@pytest.fixture
def o(servers: Origins) -> Origins:
    for origin in servers.all():
        origin.reset()
    return servers


def other(o: Origins, which: str) -> Origin:
    return {"port": o.other_port, "host": o.other_host}[which]


def get(o: Origins, url: str, method: str = "GET", body: bytes | None = None) -> net.Reply:
    return net.request(method, url, deadline=10, window=5, ca_cert=o.ca, body=body,
                       headers={"Authorization": SECRET, "Cookie": "session=s3cret"})


# ------------------------------------------------------------------ origins, pure


@pytest.mark.parametrize("a, b", [
    ("https://h", "https://h:443/x"),
    ("HTTPS://Registry.LAN/v2/", "https://registry.lan:443"),
    ("http://h/", "http://h:80"),
    ("https://[::1]/", "https://[0:0::1]:443/v2/"),
    ("https://bücher.example/", "https://xn--bcher-kva.example:443/"),
    ("https://127.0.0.1:5000", "https://127.0.0.1:05000/a?b#c"),
])
def test_two_spellings_of_one_origin_are_one_origin(a: str, b: str) -> None:
    assert net.same_origin(a, b) and net.same_origin(b, a)


@pytest.mark.parametrize("a, b", [
    ("https://h", "http://h"),
    ("https://h", "https://h:8443"),
    ("https://h", "https://h.other"),
    ("https://h", "https://h."),  # the same name to DNS, but no client need send it the token
    ("https://127.0.0.1:5000", "https://127.0.0.2:5000"),
    ("https://h/", "/relative/path"),
    ("https://h/", "file:///etc/passwd"),
])
def test_another_scheme_host_or_port_is_another_origin(a: str, b: str) -> None:
    assert not net.same_origin(a, b) and not net.same_origin(b, a)


@pytest.mark.parametrize("url, after, why", [
    ("file:///run/fifo", None, "is not http or https"),
    ("ftp://h/x", None, "is not http or https"),
    ("data:text/plain,x", None, "is not http or https"),
    ("gopher://h/x", None, "is not http or https"),
    ("//h/x", None, "is not http or https"),
    ("/token", None, "is not http or https"),
    (" https://h/x", None, "is not http or https"),
    ("https://u:p@h/x", None, "carries a user or password (not supported)"),
    ("https://tok/en@h/x", None, "carries a user or password (not supported)"),
    ("https://u:12/w@h/x", None, "carries a user or password (not supported)"),
    ("https://h/a b", None, "holds a blank or a control character"),
    ("https://h/a\r\nX-Injected: 1", None, "holds a blank or a control character"),
    ("https://h:99999/", None, "names no host or no valid port"),
    ("https://h:0/", None, "names no host or no valid port"),
    ("https://h:x/", None, "names no host or no valid port"),
    ("https:///x", None, "names no host or no valid port"),
    ("https://[::1/", None, "names no host or no valid port"),
    ("http://h/x", "https://h/", "leaves https"),
    ("HTTP://h:443/x", "HTTPS://h/", "leaves https"),
    ("https://h/x", "http://h/", None),
    ("http://h/x", "http://other/", None),
    ("https://other:8443/x", "https://h/", None),
])
def test_what_may_be_opened(url: str, after: str | None, why: str | None) -> None:
    assert net.refusal(url, after=after) == why


# ------------------------------------------------------------------ redirects: every kind, every target


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("which", ["port", "host"])
@pytest.mark.parametrize("spelled", ["absolute", "scheme-relative"])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_redirect_to_another_origin_takes_no_credential(o: Origins, code: int, which: str, spelled: str,
                                                          method: str) -> None:
    target = other(o, which)
    there = target.route("/there", body=b"there")
    o.main.redirect("/here", there if spelled == "absolute" else there.removeprefix("https:"), code)
    reply = get(o, o.main.url + "/here", method)
    assert [(a.method, a.authorization, a.headers.get("cookie")) for a in target.asked] == [(method, None, None)]
    assert o.main.authorizations() == [SECRET]
    assert (reply.status, reply.url) == (200, there)


def test_a_redirect_from_http_up_to_https_is_followed_without_the_credential(o: Origins) -> None:
    o.plain.redirect("/here", o.main.route("/there", body=b"there"), 301)
    reply = net.request("GET", o.plain.url + "/here", deadline=10, window=5, ca_cert=o.ca,
                        headers={"Authorization": SECRET})
    assert reply.body == b"there"
    assert o.plain.authorizations() == [SECRET] and o.main.authorizations() == [None]


@pytest.mark.parametrize("location", ["/there", "HTTPS://127.0.0.1:{port}/there", "https://127.0.0.1:{port}/there#x"])
def test_a_redirect_within_the_origin_keeps_the_credential(o: Origins, location: str) -> None:
    o.main.route("/there", body=b"there")
    o.main.redirect("/here", location.format(port=o.main.url.rpartition(":")[2]), 307)
    assert get(o, o.main.url + "/here").body == b"there"
    assert o.main.authorizations() == [SECRET, SECRET]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_a_redirect_of_a_request_with_a_body_is_the_answer_itself(o: Origins, code: int, method: str) -> None:
    o.main.redirect("/here", o.other_host.route("/there"), code)
    reply = get(o, o.main.url + "/here", method, body=b"layer bytes")
    assert reply.status == code
    assert o.other_host.asked == []  # neither the body nor the token went on (urllib turns a POST's 302 into a GET)


@pytest.mark.parametrize("where", ["plain", "own port over http"])
@pytest.mark.parametrize("code", CODES)
def test_a_redirect_from_https_to_http_is_refused_and_nothing_goes_there(o: Origins, where: str, code: int) -> None:
    target = o.plain.url if where == "plain" else o.main.url.replace("https:", "http:")
    o.main.redirect("/here", target + "/there", code)
    with pytest.raises(net.FetchFailed) as err:
        get(o, o.main.url + "/here")
    assert str(err.value) == (f"{o.main.url}/here: redirected to {target}/there, which leaves https; refused")
    assert o.plain.asked == [] and [a.clear for a in o.main.asked] == [False]


@pytest.mark.parametrize("location, shown, why", [
    ("https://me:hunter2@127.0.0.2:{port}/there", "https://***@127.0.0.2:{port}/there",
     "carries a user or password (not supported)"),
    ("https://me:hun/ter2@127.0.0.2:{port}/there", "https://***@127.0.0.2:{port}/there",
     "carries a user or password (not supported)"),
    ("file:///etc/passwd", "file:///etc/passwd", "is not http or https"),
    ("ftp://127.0.0.2:{port}/there", "ftp://127.0.0.2:{port}/there", "is not http or https"),
    ("data:text/plain,hello", "data:text/plain,hello", "is not http or https"),
])
def test_a_redirect_to_a_user_or_another_scheme_is_refused_in_one_line(o: Origins, location: str, shown: str,
                                                                       why: str) -> None:
    port = o.other_host.url.rpartition(":")[2]
    o.other_host.route("/there", body=b"there")
    o.main.redirect("/here", location.format(port=port))
    for call in (lambda: get(o, o.main.url + "/here"),
                 lambda: net.get(o.main.url + "/here", deadline=10, window=5, ca_cert=o.ca)):
        with pytest.raises(net.FetchFailed) as err:
            call()
        assert str(err.value) == f"{o.main.url}/here: redirected to {shown.format(port=port)}, which {why}; refused"
        assert "hunter2" not in str(err.value) and "hun/ter2" not in str(err.value)
    assert o.other_host.asked == []


def test_a_redirect_loop_ends(o: Origins) -> None:
    o.main.redirect("/here", "/there")
    o.main.redirect("/there", "/here")
    with pytest.raises(net.FetchFailed, match=r"^https://127\.0\.0\.1:\d+/here: more than 10 redirects$"):
        get(o, o.main.url + "/here")
    assert len(o.main.asked) == 11


# ------------------------------------------------------------------ downloads


def test_a_download_with_a_password_is_refused_before_anything_is_sent(o: Origins, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "cache"))
    o.main.route("/x.whl", body=b"wheel")
    url = o.main.url.replace("https://", "https://me:pa/ss#word@") + "/x.whl"
    with pytest.raises(download.DownloadFailed) as err:
        download.fetch_new(url, "x.whl", ca_cert=o.ca)
    assert "pa/ss#word" not in str(err.value) and "***@127.0.0.1" in str(err.value)
    assert [origin.asked for origin in o.all()] == [[], [], [], []]


def test_a_download_redirected_to_another_host_is_fetched_there_without_credentials(o: Origins, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setenv("SPARKFORGE_CACHE", str(tmp_path / "cache"))
    o.main.redirect("/x.whl", o.other_host.route("/x.whl", body=b"wheel"), 302)
    path, sha = download.fetch_new(o.main.url + "/x.whl", "x.whl", ca_cert=o.ca)
    assert path.read_bytes() == b"wheel"
    assert o.other_host.authorizations() == [None]
    o.main.redirect("/y.whl", o.plain.url + "/y.whl", 302)
    with pytest.raises(download.DownloadFailed, match="which leaves https; refused$"):
        download.fetch_new(o.main.url + "/y.whl", "y.whl", ca_cert=o.ca)
    assert o.plain.asked == []


# ------------------------------------------------------------------ the registry client and its token


def registry(o: Origin, realm: str | None = None, blob_at: str | None = None, upload_at: str | None = None,
             token: str = TOKEN) -> None:
    """Route a small registry onto o: every /v2/ request needs `Bearer token`, which `realm` (default o's own
    /token) hands out; a manifest is answered, a blob redirects to `blob_at`, an upload starts at `upload_at`."""
    challenge = {"WWW-Authenticate": f'Bearer realm="{realm or o.url + "/token"}",service="reg",'
                                     f'scope="repository:team/app:pull,push"'}

    def v2(asked: Asked) -> origins.Answer:
        if asked.authorization != f"Bearer {token}":
            return 401, challenge, b'{"errors": [{"code": "UNAUTHORIZED"}]}'
        if "/manifests/" in asked.path:
            return 200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, MANIFEST
        if "/blobs/uploads/" in asked.path:
            return 202, {"Location": upload_at or "/v2/team/app/blobs/uploads/u1?_state=s"}, b""
        return 307, {"Location": blob_at or "/nowhere"}, b""

    for path in ("/v2/team/app/manifests/1.0", "/v2/team/app/blobs/sha256:" + "a" * 64, "/v2/team/app/blobs/uploads/",
                 "/v2/team/app/blobs/uploads/u1"):
        o.routes[path] = v2
    o.route("/token", body=json.dumps({"token": token}).encode())


def client(o: Origins, at: Origin | None = None) -> Client:
    at = at or o.main
    host = at.url.partition("://")[2]
    return Client(Endpoint(host, at.url.partition(":")[0], str(o.ca) if at.url.startswith("https") else None),
                  deadline=10, window=5)


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("which", ["port", "host"])
def test_the_registry_s_token_stays_home_when_a_blob_is_redirected(o: Origins, code: int, which: str) -> None:
    storage = other(o, which)
    registry(o.main, blob_at=storage.route("/blob", body=b"{}"))
    o.main.routes["/v2/team/app/blobs/sha256:" + "a" * 64] = lambda asked: (
        (code, {"Location": storage.url + "/blob"}, b"") if asked.authorization == f"Bearer {TOKEN}"
        else (401, {"WWW-Authenticate": f'Bearer realm="{o.main.url}/token"'}, b""))
    assert client(o).blob_exists("team/app", "sha256:" + "a" * 64)
    assert o.main.authorizations()[-1] == f"Bearer {TOKEN}"  # the registry did get it: this test can fail
    assert storage.authorizations() == [None]


def test_an_upload_location_of_http_on_the_registry_s_own_port_is_refused(o: Origins) -> None:
    own = o.main.url.replace("https:", "http:")
    registry(o.main, upload_at=own + "/v2/team/app/blobs/uploads/u1?_state=s")
    c = client(o)
    with pytest.raises(RegistryError) as err:
        c.send_chunks("team/app", c.start_upload("team/app"), iter([b"layer"]))
    sent_in_clear = [(a.method, a.authorization, a.body) for a in o.main.asked if a.clear]
    assert sent_in_clear == []  # neither the token nor the layer went over the wire unencrypted
    assert [a.method for a in o.main.asked] == ["POST", "GET", "POST"]  # 401, the token, the POST with it
    host = o.main.url.removeprefix("https://")
    assert str(err.value) == (f"blob upload team/app at {host}: its upload location {own}/v2/team/app/blobs/uploads/"
                              "u1?_state=s leaves https; refused")


@pytest.mark.parametrize("location, why", [
    ("http://127.0.0.1:{plain}/v2/team/app/blobs/uploads/u1", "leaves https"),
    ("https://me:pw@127.0.0.2:{other}/u1", "carries a user or password (not supported)"),
    ("file:///run/fifo", "is not http or https"),
])
def test_an_upload_location_elsewhere_is_refused_when_it_leaves_https_or_carries_a_user(o: Origins, location: str,
                                                                                        why: str) -> None:
    location = location.format(plain=o.plain.url.rpartition(":")[2], other=o.other_host.url.rpartition(":")[2])
    registry(o.main, upload_at=location)
    with pytest.raises(RegistryError) as err:
        client(o).start_upload("team/app")
    assert str(err.value).endswith(f" {why}; refused") and "its upload location " in str(err.value)
    assert "pw@" not in str(err.value)
    assert o.plain.asked == [] and o.other_host.asked == []


def test_an_upload_location_on_another_host_gets_the_layer_but_not_the_token(o: Origins) -> None:
    registry(o.main, upload_at=o.other_host.url + "/upload/u1?_state=s")
    o.other_host.route("/upload/u1", 202, {"Location": "/upload/u1?_state=t"})
    c = client(o)
    after = c.send_chunks("team/app", c.start_upload("team/app"), iter([b"layer"]))
    assert after == o.other_host.url + "/upload/u1?_state=t"  # relative to the answer that named it
    assert [(a.method, a.body, a.authorization) for a in o.other_host.asked] == [("PATCH", b"layer", None)]
    assert o.main.authorizations()[-1] == f"Bearer {TOKEN}"


def test_the_token_is_asked_from_a_realm_on_another_host_trusting_the_registry_s_ca(o: Origins) -> None:
    registry(o.main, realm=o.other_host.url + "/token?account=x")
    o.other_host.route("/token", body=json.dumps({"access_token": TOKEN}).encode())
    assert client(o).manifest("team/app", "1.0") == json.loads(MANIFEST)
    (asked,) = o.other_host.asked
    assert asked.path == "/token?account=x&service=reg&scope=repository%3Ateam%2Fapp%3Apull%2Cpush"
    assert asked.authorization is None
    assert o.main.authorizations() == [None, f"Bearer {TOKEN}"]


def test_a_realm_that_redirects_elsewhere_sends_nothing_there(o: Origins) -> None:
    registry(o.main, realm=o.main.url + "/auth")
    o.main.redirect("/auth", o.other_port.route("/token", body=json.dumps({"token": TOKEN}).encode()), 307)
    assert client(o).manifest("team/app", "1.0") == json.loads(MANIFEST)
    assert o.other_port.authorizations() == [None]
    o.main.redirect("/auth", o.plain.url + "/token", 302)
    c = client(o)
    with pytest.raises(RegistryError, match=r"cannot get a token from https://127\.0\.0\.1:\d+/auth: redirected to "
                                            r"http://127\.0\.0\.1:\d+/token, which leaves https; refused$"):
        c.manifest("team/app", "1.0")
    assert o.plain.asked == []


@pytest.mark.parametrize("realm, shown, why", [
    ("http://127.0.0.1:{plain}/token", "http://127.0.0.1:{plain}/token", "leaves https"),
    ("ftp://127.0.0.1:{plain}/token", "ftp://127.0.0.1:{plain}/token", "is not http or https"),
    ("gopher://127.0.0.1:{plain}/token", "gopher://127.0.0.1:{plain}/token", "is not http or https"),
    ("/token", "/token", "is not http or https"),
    ("https://u:pa/ss@127.0.0.1:{plain}/token", "https://***@127.0.0.1:{plain}/token",
     "carries a user or password (not supported)"),
])
def test_a_realm_that_is_not_https_is_refused_in_one_line(o: Origins, realm: str, shown: str, why: str) -> None:
    plain = o.plain.url.rpartition(":")[2]
    registry(o.main, realm=realm.format(plain=plain))
    o.plain.route("/token", body=json.dumps({"token": TOKEN}).encode())
    with pytest.raises(RegistryError) as err:
        client(o).manifest("team/app", "1.0")
    host = o.main.url.removeprefix("https://")
    assert str(err.value) == (f"manifest team/app:1.0 at {host}: its token realm {shown.format(plain=plain)} {why}; "
                              "refused")
    assert err.value.status == 401 and o.plain.asked == []


def test_a_realm_of_a_fifo_is_refused_within_the_deadline_and_never_opened(o: Origins, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    registry(o.main, realm=f"file://{fifo}#")  # the query added for the token lands in the fragment
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            client(o).manifest("team/app", "1.0")
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the test reads it below
            failed.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    t0 = time.monotonic()
    asking.start()
    asking.join(8)
    if asking.is_alive():  # it opened the FIFO and waits there: let it go before failing
        with open(fifo, "wb"):
            pass
        pytest.fail("the token request opened the FIFO and waited on it")
    assert time.monotonic() - t0 < 8
    (exc,) = failed
    assert isinstance(exc, RegistryError) and str(exc).endswith(f"its token realm file://{fifo}# is not http or "
                                                                 "https; refused")


def test_a_plain_http_registry_may_name_an_http_realm(o: Origins) -> None:
    registry(o.plain)
    assert client(o, o.plain).manifest("team/app", "1.0") == json.loads(MANIFEST)
    assert o.plain.authorizations() == [None, None, f"Bearer {TOKEN}"]


def test_a_401_from_another_origin_starts_no_token_flow(o: Origins) -> None:
    registry(o.main)
    o.main.routes["/v2/team/app/manifests/2.0"] = (307, {"Location": o.other_host.url + "/m"}, b"")
    o.other_host.route("/m", 401, {"WWW-Authenticate": f'Bearer realm="{o.other_port.url}/token"'})
    with pytest.raises(RegistryError) as err:
        client(o).manifest("team/app", "2.0")
    assert str(err.value).endswith(f": HTTP 401 from {o.other_host.url}/m, another origin, which the registry's token "
                                   "never goes to")
    assert o.other_port.asked == []


@pytest.mark.parametrize("answer", [{"token": "a\r\nX-Injected: 1"}, {"token": ""}, {"token": 5}, {"tok": "x"}])
def test_a_token_that_cannot_stand_in_a_header_is_refused(o: Origins, answer: dict) -> None:
    registry(o.main)
    o.main.route("/token", body=json.dumps(answer).encode())
    with pytest.raises(RegistryError, match=r"cannot get a token from https://127\.0\.0\.1:\d+/token: no token in "
                                            r"its answer$"):
        client(o).manifest("team/app", "1.0")


def test_lock_asks_the_registry_trusting_the_ca_cert_it_was_given(tmp_path: Path) -> None:
    bundle = tmp_path / "not-a-ca.pem"
    bundle.write_text("not a certificate\n")
    with pytest.raises(Unreachable) as err:  # registry.invalid never resolves: the bundle fails first
        registry_digest("registry.invalid/team/app", "1.0", timeout=2, ca_cert=bundle)
    assert str(err.value).startswith("manifest team/app:1.0 at registry.invalid: ")
    assert "CERTIFICATE" in str(err.value).upper() and "not known" not in str(err.value)
