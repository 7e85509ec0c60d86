"""A plain HTTP server on loopback that never finishes an answer: it sends it one byte at a time, never
silent long enough for a read timeout, so that only a client's deadline for the whole answer ends the wait.

A GET of /headers drips the status line and headers themselves; any other path gets its headers at once
(Content-Length: 1000) and then the body, `byte` after `byte`.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIZE = 1000  # the body's Content-Length; at a byte every few tenths of a second, far longer than any test waits


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    byte: bytes
    every: float

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        try:
            if self.path.startswith("/headers"):
                self._drip(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 100)
            self.send_response(200)
            self.send_header("Content-Length", str(SIZE))
            self.end_headers()
            self._drip(self.byte * SIZE)
        except OSError:  # the client gave up
            pass

    def _drip(self, data: bytes) -> None:
        for i in range(len(data)):
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(self.every)


@contextmanager
def serve(every: float, byte: bytes = b"x") -> Iterator[str]:
    """A dripping server on a free port of 127.0.0.1, sending one byte every `every` seconds: its URL."""
    handler = type("Handler", (_Handler,), {"byte": byte, "every": every})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
