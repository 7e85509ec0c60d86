"""Talking to a running vLLM server (the serve tier and `launch`): wait for it, ask for greedy tokens, compare.

`vllm serve`'s OpenAI API and the torchrun server answer alike, with vLLM's `ignore_eos` and `return_token_ids`.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

# The fixed prompt of every check: greedy tokens of it are compared across servers.
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
TOKENS = 8  # tokens asked of each check
REQUEST_TIMEOUT = 300.0  # seconds one request may take (a CPU server's first request warms it up)
TINY_SEED = 0
# Where a model folder is mounted in a container, read-only, under its own name.
MOUNT_ROOT = "/models"


class ServeError(Exception):
    """A server that did not start or answered wrongly; the message is one line."""


@dataclass(frozen=True)
class Answer:
    """One answer of a server: what it generated and how long the request took."""

    kind: str  # completion | chat
    text: str
    token_ids: tuple[int, ...] | None  # None: the server did not return them
    completion_tokens: int
    finish_reason: str | None
    seconds: float

    def problem(self, asked: int) -> str | None:
        """Why this is not the answer asked for (exactly `asked` tokens, ended by the length limit), or None."""
        if self.completion_tokens != asked:
            return f"{self.kind}: {self.completion_tokens} tokens, not the {asked} asked"
        if self.token_ids is not None and len(self.token_ids) != asked:
            return f"{self.kind}: {len(self.token_ids)} token ids for {asked} tokens"
        if self.finish_reason != "length":
            return f"{self.kind}: finish reason {self.finish_reason!r}, not 'length' (ignore_eos was asked)"
        return None


@dataclass(frozen=True)
class Model:
    """The model a server loads: a folder mounted read-only into the container, or a name vLLM resolves."""

    arg: str  # what vLLM is given: the folder's place in the container, or the name
    served: str  # the name requests use
    folder: Path | None = None  # the folder on the host (or every node), None for a name

    def mount(self) -> list[str]:
        """The `docker run` options that mount the folder."""
        return ["-v", f"{self.folder}:{self.arg}:ro"] if self.folder else []


def model_of(value: str | None, cache: Path) -> Model:
    """A --model as given: an existing folder (mounted read-only), a Hugging Face name (vLLM fetches it), or
    None: the tiny model, made offline into the cache once per seed."""
    if value is None:
        from .inimage.tinymodel import make_model

        folder = make_model(cache / "models" / f"sparkforge-tiny-{TINY_SEED}", TINY_SEED)
        return Model(f"{MOUNT_ROOT}/{folder.name}", "sparkforge-tiny", folder.resolve())
    path = Path(value)
    if path.is_dir():
        folder = path.resolve()
        return Model(f"{MOUNT_ROOT}/{folder.name}", folder.name, folder)
    if path.exists() or value.startswith((".", "/", "~")):
        raise FileNotFoundError(2, "is not a model folder", value)
    return Model(value, value)


def cache_dir() -> Path:
    return Path(os.environ.get("SPARKFORGE_CACHE", Path.home() / ".cache" / "sparkforge"))


def ask(base: str, model: str, kind: str, tokens: int = TOKENS, timeout: float = REQUEST_TIMEOUT) -> Answer:
    """`tokens` greedy tokens (past any end of sequence), with their ids, of the fixed prompt or chat (kind)."""
    chat = kind == "chat"
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True}
    if chat:
        body["messages"] = CHAT
    else:
        body["prompt"] = PROMPT
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode(errors="replace").strip().replace("\n", " ")
        raise ServeError(f"{url} answered HTTP {exc.code}: {detail[:300]}") from None
    except (OSError, ValueError) as exc:
        raise ServeError(f"{url}: {exc}") from None
    seconds = time.monotonic() - t0
    if not isinstance(data, dict):
        raise ServeError(f"{url} answered {type(data).__name__}, not a JSON object")
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        ids = choice.get("token_ids")
        return Answer(kind, str(text or ""), tuple(int(t) for t in ids) if isinstance(ids, list) else None,
                      int(data["usage"]["completion_tokens"]), choice.get("finish_reason"), seconds)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServeError(f"{url} answered without {exc}: {json.dumps(data)[:200]}") from None


def wait_ready(base: str, dead: Callable[[], str | None], timeout: float, poll: float = 2.0) -> float:
    """Wait until GET /health answers 200; the seconds it took. `dead` says why the server cannot answer any
    more (its container ended), or None; asked between polls, so that a dead server fails at once."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (OSError, ValueError):
            pass
        why = dead()
        if why:
            raise ServeError(why)
        if time.monotonic() >= deadline:
            raise ServeError(f"{base}/health did not answer within {timeout:.0f} s")
        time.sleep(poll)


def log_summary(text: str, lines: int = 3) -> str:
    """A server's log in one line: the first line that names an error (most often the cause: vLLM logs the
    failure of a worker before the failures it causes), then the last lines."""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in kept if re.search(r"[A-Za-z]+(Error|Exception)\b", line)), None)
    tail = " | ".join(kept[-lines:])
    if first is None or first in kept[-lines:]:
        return tail or "an empty log"
    return f"first error: {first[:400]} ... last lines: {tail}"


def first_difference(name: str, got: Answer, want: Answer, want_name: str) -> str | None:
    """None when both answers hold the same tokens; else the first token that differs, named."""
    a, b = got.token_ids, want.token_ids
    if a is None or b is None:
        same = got.text == want.text
        return None if same else f"{name} generated {got.text!r}, {want_name} {want.text!r} (no token ids to compare)"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"{name} differs from {want_name} at token {i}: {x} against {y} ({got.text!r} against {want.text!r})"
    if len(a) != len(b):
        return f"{name} generated {len(a)} tokens, {want_name} {len(b)}"
    return None
