"""A git server over HTTPS on loopback, configured as GitHub is, for the git-source builds.

`git http-backend` answers the smart HTTP protocol; a threaded HTTPS server in front of it uses a
certificate from a test CA made here, which the builds get as `--ca-cert` (a BuildKit secret).
The repositories allow partial clones (`uploadpack.allowFilter`) and fetching any commit by its
SHA (`uploadpack.allowAnySHA1InWant`), as GitHub does.
"""

from __future__ import annotations

import email.message
import http.server
import io
import os
import shutil
import socket
import ssl
import subprocess
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkforge.recipe import sources

GIT_ENV = {"GIT_AUTHOR_NAME": "sparkforge tests", "GIT_AUTHOR_EMAIL": "tests@sparkforge.invalid",
           "GIT_COMMITTER_NAME": "sparkforge tests", "GIT_COMMITTER_EMAIL": "tests@sparkforge.invalid",
           "GIT_AUTHOR_DATE": "2026-03-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-03-01T00:00:00Z",
           "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}


def git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **GIT_ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def make_ca(folder: Path, host: str = "127.0.0.1", *others: str) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) for `host` (and the `others`: one certificate for
    several loopback addresses or names), made with openssl."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    key, csr, crt, ext = folder / "server.key", folder / "server.csr", folder / "server.crt", folder / "ext.cnf"

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=sparkforge test CA",
            "-keyout", str(ca_key), "-out", str(ca_crt))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={host}", "-keyout", str(key), "-out", str(csr))
    names = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in (host, *others))
    ext.write_text(f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "2", "-extfile", str(ext), "-out", str(crt))
    return ca_crt, crt, key


def init_repo(bare_root: Path, name: str, tree: Path, tag: str | None = None, message: str = "import") -> str:
    """Commit `tree` as the only commit of a new bare repository `name`.git; returns the commit.
    With `tag`, an annotated tag points at it (so its object differs from the commit)."""
    work = bare_root / f".work-{name}"
    shutil.copytree(tree, work, symlinks=True)
    git(work, "init", "--quiet", "--initial-branch=main")
    git(work, "add", "--all", "--force")
    git(work, "commit", "--quiet", "--no-verify", "-m", message)
    commit = git(work, "rev-parse", "HEAD")
    if tag:
        git(work, "tag", "--annotate", "-m", f"release {tag}", tag)
    bare = bare_root / f"{name}.git"
    git(bare_root, "clone", "--quiet", "--bare", str(work), str(bare))
    # Packed, as a hosted repository is: from loose objects, every fetch would make its pack afresh (delta
    # search and compression of every object, 40 s for vLLM's tree on one idle core).
    git(bare, "repack", "-a", "-d", "--quiet")
    for key, value in (("uploadpack.allowFilter", "true"), ("uploadpack.allowAnySHA1InWant", "true"),
                       ("http.receivepack", "false")):
        git(bare, "config", key, value)
    shutil.rmtree(work)
    return commit


def add_commit(bare: Path, path: str, text: str, message: str) -> str:
    """A new commit on main of a bare repository that changes one file; returns it."""
    work = bare.parent / f".work-{bare.stem}-add"
    git(bare.parent, "clone", "--quiet", str(bare), str(work))
    (work / path).parent.mkdir(parents=True, exist_ok=True)
    (work / path).write_text(text)
    git(work, "add", path)
    git(work, "commit", "--quiet", "-m", message)
    git(work, "push", "--quiet", "origin", "main")
    commit = git(work, "rev-parse", "HEAD")
    shutil.rmtree(work)
    return commit


def extract_sdist(archive: Path, dest: Path) -> Path:
    """The whole tree of an sdist (its single top folder), extracted into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tf:
        sources.extract_files(tf, dest, strip_top=False)
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top


def read_body(rfile: io.BufferedIOBase, headers: email.message.Message) -> bytes:
    """The body of a request to one of the test servers: chunked, or as long as its Content-Length says."""
    if headers.get("Transfer-Encoding", "").lower() == "chunked":
        data = bytearray()
        while size := int(rfile.readline().split(b";")[0].strip() or b"0", 16):
            data += rfile.read(size)
            rfile.readline()
        rfile.readline()
        return bytes(data)
    return rfile.read(int(headers.get("Content-Length") or 0))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _cgi(self) -> None:
        path, _, query = self.path.partition("?")
        body = read_body(self.rfile, self.headers) if self.command == "POST" else b""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": "/nonexistent",
        }
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        proc = subprocess.run(["git", "http-backend"], input=body, capture_output=True, env=env)
        head, _, payload = proc.stdout.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.decode("latin-1").split("\r\n"):
            if not line:
                continue
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            else:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = _cgi
    do_POST = _cgi


@dataclass
class GitServer:
    """A running HTTPS git server: repositories live in `root`, reached at `url`/NAME.git."""

    root: Path
    url: str
    ca: Path
    _server: http.server.ThreadingHTTPServer

    def repo_url(self, name: str) -> str:
        return f"{self.url}/{name}.git"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _TLSServer(http.server.ThreadingHTTPServer):
    """A threading HTTPS server for many clients at once (a run's builds and tests fetch together): a long listen
    queue, and each TLS handshake in its request's own thread, so that a slow client holds up no other."""

    request_queue_size = 128
    daemon_threads = True
    HANDSHAKE_TIMEOUT = 60.0

    def finish_request(self, request: socket.socket | tuple[bytes, socket.socket],
                       client_address: Any) -> None:  # runs in the request's thread
        assert isinstance(request, ssl.SSLSocket)  # accepted on the socket serve_https wraps
        request.settimeout(self.HANDSHAKE_TIMEOUT)
        request.do_handshake()
        request.settimeout(None)
        super().finish_request(request, client_address)


def serve_https(handler: type, certs: Path, host: str = "127.0.0.1") -> tuple[http.server.ThreadingHTTPServer, str, Path]:
    """Run handler over HTTPS on a free port of host, in a thread: (the server, its URL, the test CA made in certs)."""
    ca, crt, key = make_ca(certs, host)
    server = _TLSServer((host, 0), handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"https://{host}:{server.server_address[1]}", ca


def start(root: Path, certs: Path, host: str = "127.0.0.1") -> GitServer:
    """Serve every bare repository under root over HTTPS on a free port of host."""
    server, url, ca = serve_https(type("Handler", (_Handler,), {"root": root}), certs, host)
    return GitServer(root, url, ca, server)
