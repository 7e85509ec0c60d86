"""Tests of the product's own time limits that measure the limit, not the machine's load.

Whatever the call waits on never ends by itself (a server that drips or holds the connection until the
test is over, a patcher that loops), so only the call's own limit can end the wait. A test asserts which
limit it reports, exactly, and that at least that long went by (a lower bound, which load cannot break).
The guard is no measure of the limit: it only turns a limit that never fires into a failure instead of a
hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
GUARD = 120.0  # seconds: far beyond any limit a test sets, so that no load reaches it


def ended(call: Callable[[], T], guard: float = GUARD) -> tuple[T | BaseException, float]:
    """Run call on a thread of its own: what it returned or raised, and the seconds it took. Fails when it is
    still running after `guard` seconds."""
    done: list[T | BaseException] = []

    def run() -> None:
        try:
            done.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which asserts its exact type
            done.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(guard)
    seconds = time.monotonic() - started
    if not done:
        raise AssertionError(f"still waiting after {guard:.0f} s: its own limit never ended the wait")
    return done[0], seconds


def gives_up(call: Callable[[], object], guard: float = GUARD) -> tuple[BaseException, float]:
    """Run call, which must end by raising: the exception and the seconds it took (see ended)."""
    outcome, seconds = ended(call, guard)
    if not isinstance(outcome, BaseException):
        raise AssertionError(f"returned {outcome!r} instead of giving up")
    return outcome, seconds
