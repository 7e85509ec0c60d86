"""What sparkforge reads from a `docker pull` drawn on a terminal: layers, bytes done, and its last line."""

from __future__ import annotations

from sparkforge.distribute.nodes import PullLog

UP, DOWN, CLEAR = b"\x1b[1A", b"\x1b[1B", b"\x1b[2K"


def redraw(layer: bytes, status: bytes, line: bool = False) -> bytes:
    """One status of a layer as docker draws it on a terminal: up to the layer's line, then a status with
    a progress part (cleared and rewritten in place) or a plain line (written right after the cursor move)."""
    if line:
        return UP + layer + b": " + status + b"\r\n" + DOWN
    return UP + CLEAR + b"\r" + layer + b": " + status + b" \r" + DOWN


def test_layers_and_bytes_are_counted_across_redraws_and_split_reads() -> None:
    log = PullLog({"aaaaaaaaaaaa": 1000, "bbbbbbbbbbbb": 50, "cccccccccccc": 70})
    stream = b"".join([
        b"testvllm-0123: Pulling from sparkforge-test/vllm\r\n",
        b"\r\n", redraw(b"aaaaaaaaaaaa", b"Pulling fs layer", line=True),
        b"\r\n", redraw(b"cccccccccccc", b"Already exists"),
        # From Docker 29.1 a pull also fetches the image's attestation manifest and signatures, and reports their
        # blobs like layers: not a layer of the image (not in the registry's manifest), not counted.
        b"\r\n", redraw(b"dddddddddddd", b"Already exists"),
        redraw(b"aaaaaaaaaaaa", b"Downloading  [=====>      ]  512kB/1MB"),
        redraw(b"aaaaaaaaaaaa", b"Download complete"),
        redraw(b"bbbbbbbbbbbb", b"Download complete"),  # never announced as fetched: not counted
        redraw(b"aaaaaaaaaaaa", b"Extracting  [==>   ]  2MB/4MB"),
    ])
    changes = [log.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)]  # split mid-line and mid-escape
    assert any(changes)
    assert log.fetching == {"aaaaaaaaaaaa"} and log.present == 1 and log.done == 1000
    assert log.detail == "1 layers to download, 1 already there"
    assert "Extracting" in log.last


def test_progress_alone_is_no_layer_change_and_the_error_is_the_last_line() -> None:
    log = PullLog({})
    assert log.feed(redraw(b"aaaaaaaaaaaa", b"Downloading  1MB/4MB")) is False
    log.feed(b"Error response from daemon: Get \"https://10.0.0.1:5443/v2/\": connection refused\r\n")
    assert log.last.endswith("connection refused") and log.last.startswith("Error response from daemon")
    log.feed(b"unexpected EOF")  # no newline at the end
    assert log.last == "unexpected EOF"


def test_the_manifest_digest_the_pull_ended_with_is_kept() -> None:
    digest = "sha256:" + "7e" * 32
    log = PullLog({"aaaaaaaaaaaa": 1000})
    assert log.digest == ""
    log.feed(redraw(b"aaaaaaaaaaaa", b"Pull complete", line=True) + b"Digest: " + digest.encode()[:20])
    assert log.digest == ""  # not yet a whole line
    log.feed(digest.encode()[20:] + b"\r\nStatus: Downloaded newer image for r/x:1\r\n")
    assert log.digest == digest
    log.feed(b"Digest: sha256:not-hex\r\n")  # not a digest: the one before stays
    assert log.digest == digest
