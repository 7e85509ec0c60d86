"""A unix socket that takes every connection and never answers: a Docker engine that hangs.

It counts what connects, so a test can tell a command that waited out one limit and gave up from one
that kept trying.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path


class Wedged:
    """The socket's `docker -H` address, and how many connections it has taken so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(64)
        self._server.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return f"unix://{self.path}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._server.accept()[0]
            except OSError:  # the accept's own time-out: look at the stop flag again
                continue
            self._held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._held:
            conn.close()
        self._server.close()


@contextlib.contextmanager
def wedged(path: Path) -> Iterator[Wedged]:
    """A wedged engine's socket at path, for the block."""
    engine = Wedged(path)
    try:
        yield engine
    finally:
        engine.close()
