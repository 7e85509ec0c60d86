#!/usr/bin/env python3
"""sparkforge serve_torchrun: multi-node tensor-parallel vLLM server launched by torchrun.

Run the same command on every node, changing only ``--node-rank``::

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 \\
        --master-addr 192.168.100.10 --master-port 29500 \\
        /opt/sparkforge/serve_torchrun.py \\
        --model Qwen/Qwen3-Coder-30B-A3B-Instruct --tensor-parallel-size 2 \\
        --host 0.0.0.0 --port 8011

Every rank builds its own vLLM ``LLMEngine`` with
``distributed_executor_backend="external_launcher"``: vLLM creates one worker per
process and joins the torch.distributed world that torchrun describes in the
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The model's
tensor-parallel all-reduces run over NCCL inside ``engine.step()``.

Next to that, this script creates its own GLOO process group, the control plane.
On every loop iteration rank 0 drains the requests its HTTP server has queued and
broadcasts them as one small JSON-able message; every rank then adds the same
requests, in the same order, under the same request ids, and calls
``engine.step()`` in lockstep. Only rank 0 answers HTTP clients; the outputs of the
other ranks are dropped. When there is nothing to do, rank 0 still broadcasts an
empty batch after a short wait, so all ranks stay in lockstep. On SIGTERM/SIGINT
rank 0 broadcasts a stop message and all ranks leave the loop together.

Rank 0 serves an OpenAI-compatible subset over plain ``http.server``:
``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat
template is applied), ``GET /v1/models`` and ``GET /health``. Responses are not
streamed. Besides the OpenAI fields, it takes two of vLLM's own server's: ``ignore_eos``
(generate exactly max_tokens) and ``return_token_ids`` (the choice's ``token_ids``).

The module imports with the standard library only; torch and vLLM are imported
inside the wiring functions, so the request handling, the queue and the lockstep
loop can be tested without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable

SERVER_NAME = "sparkforge-serve-torchrun"
CONTROL_PROTOCOL = "sparkforge-serve-torchrun/1"

logger = logging.getLogger("serve_torchrun")

# --------------------------------------------------------------------------------------
# Errors in OpenAI's shape
# --------------------------------------------------------------------------------------


class RequestError(Exception):
    """A client-visible error, rendered in OpenAI's error shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        err_type: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        if err_type is None:
            err_type = "invalid_request_error" if self.status < 500 else "server_error"
        self.err_type = err_type
        self.code = code

    def to_body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.code)


def error_body(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# --------------------------------------------------------------------------------------
# Request parsing and validation (pure)
# --------------------------------------------------------------------------------------

# Fields accepted by both endpoints. Anything else is rejected with a 400 naming it.
_COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "user", "ignore_eos",
     "return_token_ids"}
)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens"}

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})

# Defaults when neither the request nor the model's generation config sets them.
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

# Sampling keys a model's generation config may supply defaults for
# (what vLLM's ModelConfig.get_diff_sampling_param() returns).
_DEFAULTABLE_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad(param: str, message: str) -> RequestError:
    return RequestError(message, 400, param=param)


def decode_json_body(raw: bytes) -> dict:
    """Decode an HTTP body into a JSON object or raise a 400."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(f"Request body is not valid JSON: {exc}", 400) from None
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object", 400)
    return body


def _check_fields(body: dict, allowed: frozenset) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        name = unknown[0]
        raise _bad(name, f"Unsupported field '{name}': this server accepts {', '.join(sorted(allowed))}")


def _check_model(body: dict, model_names: Iterable[str] | None) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' must be a non-empty string")
    names = list(model_names or [])
    if names and model not in names:
        raise RequestError(
            f"The model '{model}' does not exist; this server serves {', '.join(names)}",
            404,
            param="model",
            code="model_not_found",
        )
    return model


def parse_sampling(body: dict, kind: str) -> dict:
    """Validate the sampling fields of a request into a plain dict.

    Only keys the client actually set (non-null) appear in the result, so that the
    model's generation-config defaults can fill the rest later.
    """
    out: dict[str, Any] = {}

    n = body.get("n")
    if n is not None:
        if not _is_int(n):
            raise _bad("n", "'n' must be an integer")
        if n != 1:
            raise _bad("n", "'n' must be 1: this server returns one choice per request")

    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise _bad("stream", "'stream' must be a boolean")
        if stream:
            raise _bad("stream", "'stream': true is not supported; responses are not streamed")

    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "'user' must be a string")

    max_field = "max_tokens"
    max_tokens = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise _bad(
                "max_completion_tokens",
                "'max_completion_tokens' and 'max_tokens' are mutually exclusive",
            )
        max_field = "max_completion_tokens"
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise _bad(max_field, f"'{max_field}' must be an integer")
        if max_tokens < 1:
            raise _bad(max_field, f"'{max_field}' must be at least 1, got {max_tokens}")
        out["max_tokens"] = max_tokens

    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature):
            raise _bad("temperature", "'temperature' must be a number")
        if not 0.0 <= float(temperature) <= 2.0:
            raise _bad("temperature", f"'temperature' must be between 0 and 2, got {temperature}")
        out["temperature"] = float(temperature)

    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p):
            raise _bad("top_p", "'top_p' must be a number")
        if not 0.0 < float(top_p) <= 1.0:
            raise _bad("top_p", f"'top_p' must be in (0, 1], got {top_p}")
        out["top_p"] = float(top_p)

    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k):
            raise _bad("top_k", "'top_k' must be an integer")
        if top_k < -1:
            raise _bad("top_k", f"'top_k' must be -1 or 0 (disabled) or a positive integer, got {top_k}")
        out["top_k"] = top_k

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "'stop' must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise _bad("stop", "'stop' must not contain empty strings")
        if stop:
            out["stop"] = list(stop)

    # vLLM's own extensions of the OpenAI API, as its server takes them: generate past the end-of-sequence token
    # (an exact number of tokens), and return the generated token ids with the text.
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise _bad("ignore_eos", "'ignore_eos' must be a boolean")
        if ignore_eos:
            out["ignore_eos"] = True
    if body.get("return_token_ids") is not None and not isinstance(body["return_token_ids"], bool):
        raise _bad("return_token_ids", "'return_token_ids' must be a boolean")

    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _bad("seed", "'seed' must be an integer")
        if not SEED_MIN <= seed <= SEED_MAX:
            raise _bad("seed", "'seed' is out of range for a 64-bit seed")
        out["seed"] = seed

    return out


def _parse_prompt(value: Any) -> dict:
    if isinstance(value, str):
        if not value:
            raise _bad("prompt", "'prompt' must not be empty")
        return {"prompt": value}
    if isinstance(value, list):
        if not value:
            raise _bad("prompt", "'prompt' must not be empty")
        if all(_is_int(t) for t in value):
            if any(t < 0 for t in value):
                raise _bad("prompt", "'prompt' token ids must be non-negative")
            return {"prompt_token_ids": list(value)}
        if len(value) == 1:
            return _parse_prompt(value[0])
        if all(isinstance(p, (str, list)) for p in value):
            raise _bad("prompt", "'prompt' must be a single prompt; batched prompts are not supported")
    raise _bad("prompt", "'prompt' must be a string or a list of token ids")


def _parse_content(index: int, content: Any) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(param, f"'{param}' parts must be objects of type 'text'; other parts are not supported")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(param, f"'{param}' must be a string or a list of text parts")


def _parse_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "'messages' must be a non-empty list")
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object")
        unknown = sorted(k for k in msg if k not in _MESSAGE_FIELDS)
        if unknown:
            raise _bad(f"messages[{i}].{unknown[0]}", f"Unsupported field 'messages[{i}].{unknown[0]}'")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise _bad(
                f"messages[{i}].role",
                f"'messages[{i}].role' must be one of {', '.join(sorted(CHAT_ROLES))}",
            )
        if "content" not in msg or msg["content"] is None:
            raise _bad(f"messages[{i}].content", f"'messages[{i}].content' is required")
        out = {"role": role, "content": _parse_content(i, msg["content"])}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad(f"messages[{i}].name", f"'messages[{i}].name' must be a string")
            out["name"] = name
        messages.append(out)
    return messages


def parse_completion_request(body: dict, model_names: Iterable[str] | None = None) -> dict:
    """Validate a /v1/completions body into a plain, JSON-able request dict."""
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object", 400)
    _check_fields(body, COMPLETION_FIELDS)
    model = _check_model(body, model_names)
    if body.get("prompt") is None:
        raise _bad("prompt", "'prompt' is required")
    prompt = _parse_prompt(body["prompt"])
    return {"kind": "completion", "model": model, "prompt": prompt, "sampling": parse_sampling(body, "completion"),
            "return_token_ids": body.get("return_token_ids") is True}


def parse_chat_request(body: dict, model_names: Iterable[str] | None = None) -> dict:
    """Validate a /v1/chat/completions body into a plain, JSON-able request dict."""
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object", 400)
    _check_fields(body, CHAT_FIELDS)
    model = _check_model(body, model_names)
    if body.get("messages") is None:
        raise _bad("messages", "'messages' is required")
    messages = _parse_messages(body["messages"])
    return {"kind": "chat", "model": model, "messages": messages, "sampling": parse_sampling(body, "chat"),
            "return_token_ids": body.get("return_token_ids") is True}


def resolve_sampling(kind: str, sampling: dict, defaults: dict | None = None) -> dict:
    """Merge the request's sampling fields over the model defaults.

    The result is the exact keyword set every rank passes to ``SamplingParams``; it is
    computed once on rank 0 and broadcast, so the ranks cannot disagree.
    """
    resolved: dict[str, Any] = {}
    for key in _DEFAULTABLE_KEYS:
        if defaults and defaults.get(key) is not None:
            resolved[key] = defaults[key]
    resolved.update(sampling)
    if "max_tokens" not in resolved:
        resolved["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" else None
    if "stop" in resolved:
        resolved["stop"] = list(resolved["stop"])
    resolved["n"] = 1
    return resolved


def prepare_prompt(request: dict, tokenizer: Any = None) -> dict:
    """Turn a parsed request into the prompt dict given to ``engine.add_request``.

    Completions pass through (``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``).
    Chat requests are rendered with the tokenizer's chat template and tokenized
    without adding special tokens again (the template already holds them).
    Runs on rank 0 only, in the engine-loop thread, so the tokenizer is never used
    from two threads at once.
    """
    kind = request.get("kind")
    if kind == "completion":
        return dict(request["prompt"])
    if kind == "chat":
        if tokenizer is None:
            raise RequestError("This model has no tokenizer, chat is unavailable", 400, param="messages")
        try:
            text = tokenizer.apply_chat_template(
                request["messages"], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # template errors are the client's messages' fault
            raise RequestError(f"Could not apply the chat template: {exc}", 400, param="messages") from None
        if not isinstance(text, str):
            raise RequestError("The chat template did not render to text", 500)
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not token_ids:
            raise RequestError("The rendered chat prompt is empty", 400, param="messages")
        return {"prompt_token_ids": [int(t) for t in token_ids]}
    raise RequestError(f"Unknown request kind {kind!r}", 500)


# --------------------------------------------------------------------------------------
# Response formatting (pure)
# --------------------------------------------------------------------------------------


def summarize_output(output: Any) -> dict:
    """Reduce a finished vLLM ``RequestOutput`` to a small plain dict."""
    choice = output.outputs[0] if getattr(output, "outputs", None) else None
    prompt_ids = getattr(output, "prompt_token_ids", None) or []
    if choice is None:
        return {"text": "", "finish_reason": "abort", "prompt_tokens": len(prompt_ids), "completion_tokens": 0}
    return {
        "text": choice.text or "",
        "finish_reason": choice.finish_reason,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(choice.token_ids or []),
        "token_ids": [int(t) for t in choice.token_ids or []],
    }


def _usage(result: dict) -> dict:
    prompt_tokens = int(result.get("prompt_tokens", 0))
    completion_tokens = int(result.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def format_completion_response(request_id: str, model: str, result: dict, created: int | None = None) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": result.get("text", ""),
                "logprobs": None,
                "finish_reason": result.get("finish_reason"),
            }
        ],
        "usage": _usage(result),
    }


def format_chat_response(request_id: str, model: str, result: dict, created: int | None = None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.get("text", "")},
                "logprobs": None,
                "finish_reason": result.get("finish_reason"),
            }
        ],
        "usage": _usage(result),
    }


def format_models_response(model_names: Iterable[str], created: int, max_model_len: int | None = None) -> dict:
    data = []
    for name in model_names:
        entry = {"id": name, "object": "model", "created": int(created), "owned_by": "sparkforge"}
        if max_model_len is not None:
            entry["max_model_len"] = int(max_model_len)
        data.append(entry)
    return {"object": "list", "data": data}


# --------------------------------------------------------------------------------------
# Request queue (rank 0: HTTP threads -> engine loop)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class PendingRequest:
    request_id: str
    request: dict
    future: concurrent.futures.Future
    arrival_time: float


class RequestQueue:
    """Thread-safe hand-off of parsed requests (and aborts) to the engine loop."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._q: queue.Queue = queue.Queue()
        self._clock = clock

    def submit(self, request: dict) -> PendingRequest:
        prefix = "chatcmpl" if request.get("kind") == "chat" else "cmpl"
        pending = PendingRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            request=request,
            future=concurrent.futures.Future(),
            arrival_time=self._clock(),
        )
        self._q.put(("add", pending))
        return pending

    def abort(self, request_id: str) -> None:
        self._q.put(("abort", request_id))

    def drain(self, timeout: float = 0.0) -> tuple[list[PendingRequest], list[str]]:
        """Return everything queued; wait up to ``timeout`` seconds for the first item."""
        added: list[PendingRequest] = []
        aborted: list[str] = []
        try:
            item = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return added, aborted
        while True:
            kind, value = item
            if kind == "add":
                added.append(value)
            else:
                aborted.append(value)
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return added, aborted


# --------------------------------------------------------------------------------------
# Lockstep loop (every rank)
# --------------------------------------------------------------------------------------


def make_batch_message(seq: int, add: list[dict], abort: list[str]) -> dict:
    return {"proto": CONTROL_PROTOCOL, "op": "batch", "seq": seq, "add": add, "abort": abort}


def make_stop_message(seq: int) -> dict:
    return {"proto": CONTROL_PROTOCOL, "op": "stop", "seq": seq}


class ControlPlaneError(RuntimeError):
    """The ranks disagree about the control stream; continuing would corrupt NCCL."""


def check_handshake(infos: list[dict]) -> None:
    """All ranks must run the same script and protocol with the same engine settings.

    ``infos[i]`` is what rank ``i`` reported; ``"rank"`` must equal ``i`` and every
    other key must equal rank 0's. Different seeds, for example, make the ranks
    sample different tokens, and their schedulers drift apart.
    """
    if not infos:
        raise ControlPlaneError("handshake: no ranks reported")
    reference = {k: v for k, v in infos[0].items() if k != "rank"}
    problems = []
    for index, info in enumerate(infos):
        if info.get("rank") != index:
            problems.append(f"position {index} reported rank {info.get('rank')}")
        mine = {k: v for k, v in info.items() if k != "rank"}
        for key in sorted(set(reference) | set(mine)):
            if mine.get(key) != reference.get(key):
                problems.append(f"rank {index}: {key}={mine.get(key)!r}, rank 0 has {reference.get(key)!r}")
    if problems:
        raise ControlPlaneError("ranks disagree: " + "; ".join(problems))


def handshake_info(rank: int, engine_args: Any = None, script_path: str | None = None) -> dict:
    """What every rank reports in the start-up handshake."""
    import hashlib

    info: dict[str, Any] = {"rank": rank, "proto": CONTROL_PROTOCOL}
    path = script_path or os.path.abspath(__file__)
    try:
        with open(path, "rb") as fh:
            info["script_sha256"] = hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        info["script_sha256"] = None
    for key in (
        "model",
        "revision",
        "tokenizer",
        "seed",
        "dtype",
        "quantization",
        "max_model_len",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "served_model_name",
    ):
        if engine_args is not None and hasattr(engine_args, key):
            value = getattr(engine_args, key)
            info[key] = value if isinstance(value, (str, int, float, bool, type(None), list)) else str(value)
    try:
        import vllm  # noqa: F401 - only for its version string

        info["vllm"] = getattr(vllm, "__version__", None)
    except ImportError:
        info["vllm"] = None
    return info


class LockstepLoop:
    """The engine loop. All ranks run it; rank 0 also feeds it from the queue.

    ``broadcast(obj) -> obj`` must deliver rank 0's ``obj`` to every rank (the
    argument is ignored on the other ranks). ``engine`` needs ``add_request``,
    ``abort_request``, ``step`` and ``has_unfinished_requests``, as vLLM's
    ``LLMEngine`` has.
    """

    def __init__(
        self,
        rank: int,
        engine: Any,
        broadcast: Callable[[Any], Any],
        *,
        make_sampling_params: Callable[[dict], Any] = lambda kwargs: dict(kwargs),
        request_queue: RequestQueue | None = None,
        prepare: Callable[[dict], dict] | None = None,
        sampling_defaults: dict | None = None,
        stop_event: threading.Event | None = None,
        idle_timeout: float = 0.02,
    ) -> None:
        if rank == 0 and request_queue is None:
            raise ValueError("rank 0 needs a request queue")
        self.rank = rank
        self.engine = engine
        self.broadcast = broadcast
        self.make_sampling_params = make_sampling_params
        self.queue = request_queue
        self.prepare = prepare or (lambda request: prepare_prompt(request, None))
        self.sampling_defaults = dict(sampling_defaults or {})
        self.stop_event = stop_event or threading.Event()
        self.idle_timeout = idle_timeout
        self.seq = 0
        self.steps = 0
        self.added: list[str] = []  # request ids in the order this rank added them
        self.pending: dict[str, PendingRequest] = {}
        self.running = False
        self._busy = False

    # -- rank 0 -------------------------------------------------------------------
    def _leader_message(self) -> dict:
        if self.stop_event.is_set():
            return make_stop_message(self.seq)
        # Whether the engine has work is remembered from the end of the last
        # iteration, so every rank calls into the engine the same number of times.
        new, aborts = self.queue.drain(0.0 if self._busy else self.idle_timeout)
        if self.stop_event.is_set():
            for pending in new:
                _fail(pending.future, RequestError("The server is shutting down", 503))
            return make_stop_message(self.seq)
        add = []
        for pending in new:
            if pending.future.done():  # the client gave up before we started
                continue
            try:
                prompt = self.prepare(pending.request)
                sampling = resolve_sampling(
                    pending.request["kind"], pending.request.get("sampling", {}), self.sampling_defaults
                )
            except RequestError as exc:
                _fail(pending.future, exc)
                continue
            except Exception as exc:
                logger.exception("could not prepare request %s", pending.request_id)
                _fail(pending.future, RequestError(f"Could not prepare the request: {exc}", 500))
                continue
            self.pending[pending.request_id] = pending
            add.append(
                {
                    "id": pending.request_id,
                    "prompt": prompt,
                    "sampling": sampling,
                    "arrival_time": pending.arrival_time,
                }
            )
        aborts = [rid for rid in aborts if rid in self.pending]
        return make_batch_message(self.seq, add, aborts)

    # -- all ranks ----------------------------------------------------------------
    def run_once(self) -> bool:
        """One lockstep iteration. Returns False once the stop message arrived."""
        outgoing = self._leader_message() if self.rank == 0 else None
        msg = self.broadcast(outgoing)
        if not isinstance(msg, dict) or msg.get("proto") != CONTROL_PROTOCOL:
            raise ControlPlaneError(f"rank {self.rank}: unexpected control message {msg!r:.200}")
        if msg.get("seq") != self.seq:
            raise ControlPlaneError(f"rank {self.rank}: control message seq {msg.get('seq')} != expected {self.seq}")
        self.seq += 1
        if msg["op"] == "stop":
            self._fail_all(RequestError("The server is shutting down", 503))
            return False
        if msg["op"] != "batch":
            raise ControlPlaneError(f"rank {self.rank}: unknown control op {msg['op']!r}")

        if msg["abort"]:
            self.engine.abort_request(list(msg["abort"]))
            for rid in msg["abort"]:
                pending = self.pending.pop(rid, None)
                if pending is not None:
                    _fail(pending.future, RequestError("The request was aborted", 504, err_type="timeout"))

        for item in msg["add"]:
            rid = item["id"]
            try:
                params = self.make_sampling_params(item["sampling"])
                self.engine.add_request(rid, item["prompt"], params, arrival_time=item["arrival_time"])
            except Exception as exc:
                # Validation inside vLLM is deterministic, so every rank rejects the
                # same request here and the engines stay identical.
                logger.warning("rank %d: request %s rejected by the engine: %s", self.rank, rid, exc)
                pending = self.pending.pop(rid, None)
                if pending is not None:
                    _fail(pending.future, RequestError(str(exc) or type(exc).__name__, 400))
                continue
            self.added.append(rid)

        if self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            self.steps += 1
            if self.rank == 0:
                self._resolve(outputs)
            self._busy = bool(self.engine.has_unfinished_requests())
        else:
            self._busy = False
        return True

    def _resolve(self, outputs: Iterable[Any]) -> None:
        for out in outputs or ():
            if not getattr(out, "finished", False):
                continue
            pending = self.pending.pop(out.request_id, None)
            if pending is None:
                continue
            if not pending.future.done():
                try:
                    pending.future.set_result(summarize_output(out))
                except concurrent.futures.InvalidStateError:
                    pass

    def _fail_all(self, exc: RequestError) -> None:
        pending, self.pending = self.pending, {}
        for p in pending.values():
            _fail(p.future, exc)
        if self.rank == 0 and self.queue is not None:
            new, _ = self.queue.drain(0.0)
            for p in new:
                _fail(p.future, exc)

    def run(self) -> int:
        """Loop until the stop message; returns the number of engine steps."""
        self.running = True
        try:
            while self.run_once():
                pass
        except BaseException:
            self._fail_all(RequestError("The engine loop failed", 500))
            raise
        finally:
            self.running = False
        return self.steps


def _fail(future: concurrent.futures.Future, exc: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            pass


# --------------------------------------------------------------------------------------
# HTTP layer (rank 0)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ServerState:
    model_names: list[str]
    queue: RequestQueue
    request_timeout: float | None = 600.0
    max_model_len: int | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    max_body_bytes: int = 32 * 1024 * 1024


class OpenAIHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = SERVER_NAME
    state: ServerState  # set on the subclass by make_http_server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            logger.info("client %s went away before the response was written", self.address_string())

    def _send_error(self, exc: RequestError) -> None:
        self._send_json(exc.status, exc.to_body())

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self._path()
        state = self.state
        if path == "/health":
            if state.ready.is_set() and not state.stopping.is_set():
                self._send_json(200, {"status": "ok"})
            else:
                self._send_json(503, error_body("The engine is not ready", "server_error"))
        elif path == "/v1/models":
            self._send_json(200, format_models_response(state.model_names, state.created, state.max_model_len))
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self._send_error(RequestError(f"Use POST for {path}", 405))
        else:
            self._send_error(RequestError(f"Not found: {path}", 404))

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self._path()
        try:
            raw = self._read_body()
            if path == "/v1/completions":
                self._generate(raw, parse_completion_request, format_completion_response)
            elif path == "/v1/chat/completions":
                self._generate(raw, parse_chat_request, format_chat_response)
            elif path in ("/health", "/v1/models"):
                raise RequestError(f"Use GET for {path}", 405)
            else:
                raise RequestError(f"Not found: {path}", 404)
        except RequestError as exc:
            self._send_error(exc)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise RequestError("Chunked request bodies are not supported; send Content-Length", 411)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise RequestError("Invalid Content-Length", 400) from None
        if size < 0 or size > self.state.max_body_bytes:
            self.close_connection = True
            raise RequestError(f"Request body too large (limit {self.state.max_body_bytes} bytes)", 413)
        return self.rfile.read(size)

    def _generate(self, raw: bytes, parse: Callable, fmt: Callable) -> None:
        state = self.state
        if state.stopping.is_set() or not state.ready.is_set():
            raise RequestError("The server is not accepting requests", 503)
        request = parse(decode_json_body(raw), state.model_names)
        pending = state.queue.submit(request)
        try:
            result = pending.future.result(timeout=state.request_timeout)
        except concurrent.futures.TimeoutError:
            pending.future.cancel()
            state.queue.abort(pending.request_id)
            raise RequestError(
                f"The request did not finish within {state.request_timeout} s", 504, err_type="timeout"
            ) from None
        except concurrent.futures.CancelledError:
            raise RequestError("The request was cancelled", 503) from None
        except RequestError:
            raise
        except Exception as exc:
            raise RequestError(f"Internal error: {exc}", 500) from None
        model = request.get("model") or state.model_names[0]
        body = fmt(pending.request_id, model, result)
        if request.get("return_token_ids"):
            body["choices"][0]["token_ids"] = list(result.get("token_ids", []))
        self._send_json(200, body)


def make_http_server(host: str, port: int, state: ServerState) -> ThreadingHTTPServer:
    handler = type("BoundOpenAIHandler", (OpenAIHandler,), {"state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def start_http_thread(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="serve-torchrun-http", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("serve_torchrun", "HTTP server on rank 0 and the GLOO control plane")
    group.add_argument("--host", default="0.0.0.0", help="address rank 0's HTTP server binds to")
    group.add_argument("--port", type=int, default=8011, help="port of rank 0's HTTP server")
    group.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before an unfinished request is aborted on all ranks (504)",
    )
    group.add_argument(
        "--control-idle-timeout",
        type=float,
        default=0.02,
        help="seconds rank 0 waits for new requests while idle before broadcasting an empty batch",
    )
    group.add_argument(
        "--control-timeout",
        type=float,
        default=1800.0,
        help="timeout in seconds for the GLOO control group's collectives",
    )
    return parser


def check_torchrun_env(environ: dict | None = None) -> dict:
    """The variables torchrun sets and vLLM's external_launcher reads."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise SystemExit(
            f"serve_torchrun: missing {', '.join(missing)}; launch this script with torchrun "
            "(torchrun --nnodes N --nproc-per-node 1 --node-rank R --master-addr A --master-port P ...)"
        )
    return {
        "rank": int(env["RANK"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
    }


# --------------------------------------------------------------------------------------
# Wiring: torch.distributed and vLLM (imported lazily)
# --------------------------------------------------------------------------------------


def make_gloo_group(timeout_s: float = 1800.0):
    """Create the GLOO control group spanning every rank (collective: all ranks call it)."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def make_torch_all_gather(group) -> Callable[[Any], list]:
    """``all_gather(obj) -> [obj of rank 0, obj of rank 1, ...]`` over ``group``."""
    import torch.distributed as dist

    def all_gather(obj: Any) -> list:
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return all_gather


def make_torch_broadcast(group, src: int = 0) -> Callable[[Any], Any]:
    """``broadcast(obj) -> obj`` over ``group`` with ``broadcast_object_list``."""
    import torch.distributed as dist

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    return broadcast


def _install_signal_handlers(rank: int, stop_event: threading.Event) -> None:
    def handler(signum, _frame):
        name = signal.Signals(signum).name
        if rank == 0:
            if stop_event.is_set():
                logger.warning("rank 0: second %s, exiting now", name)
                os._exit(128 + signum)
            logger.info("rank 0: %s received, broadcasting stop to all ranks", name)
            stop_event.set()
        else:
            # Leaving on our own would strand the other ranks in a collective;
            # rank 0 decides when everyone stops.
            if stop_event.is_set():
                logger.warning("rank %d: second %s, exiting now", rank, name)
                os._exit(128 + signum)
            logger.info("rank %d: %s received, waiting for rank 0's stop message", rank, name)
            stop_event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def make_engine_args(args: argparse.Namespace):
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.distributed_executor_backend not in (None, "external_launcher"):
        raise SystemExit(
            "serve_torchrun: --distributed-executor-backend must be external_launcher "
            f"(got {engine_args.distributed_executor_backend!r})"
        )
    if (getattr(engine_args, "data_parallel_size", 1) or 1) != 1:
        # With DP, vLLM's has_unfinished_requests() becomes a collective; this loop
        # only supports tensor (and pipeline) parallelism across the torchrun ranks.
        raise SystemExit("serve_torchrun: --data-parallel-size is not supported")
    engine_args.distributed_executor_backend = "external_launcher"
    return engine_args


def build_engine(engine_args: Any):
    """One engine per rank; vLLM joins the torchrun world (env://) while building it."""
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args)


def make_vllm_sampling_params() -> Callable[[dict], Any]:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    def build(kwargs: dict) -> Any:
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)

    return build


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("SERVE_TORCHRUN_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s serve_torchrun[%(process)d] %(message)s",
    )
    dist_env = check_torchrun_env()
    rank = dist_env["rank"]

    # external_launcher runs the engine core in this process; vLLM asserts this.
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        logger.warning("rank %d: overriding VLLM_ENABLE_V1_MULTIPROCESSING=%s with 0", rank,
                       os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch.distributed as dist
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="serve_torchrun.py",
        description="OpenAI-compatible vLLM server for torchrun multi-node tensor parallelism",
    )
    add_server_args(parser)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)

    engine_args = make_engine_args(args)
    served = engine_args.served_model_name
    if isinstance(served, str):
        served = [served]
    model_names = list(served or [engine_args.model])

    stop_event = threading.Event()
    server = None
    state = None
    request_queue = None
    if rank == 0:
        # Bind before loading the model: a busy port fails in seconds, not after the
        # weights are loaded, and /health answers 503 while the engine is starting.
        request_queue = RequestQueue()
        state = ServerState(
            model_names=model_names,
            queue=request_queue,
            request_timeout=args.request_timeout if args.request_timeout > 0 else None,
            stopping=stop_event,
        )
        try:
            server = make_http_server(args.host, args.port, state)
        except OSError as exc:
            raise SystemExit(f"serve_torchrun: cannot listen on {args.host}:{args.port}: {exc}") from None
        start_http_thread(server)
        logger.info("rank 0: listening on http://%s:%d (not ready until the engine is up)", args.host, args.port)

    engine = build_engine(engine_args)
    logger.info("rank %d/%d: engine ready", rank, dist_env["world_size"])

    control_group = make_gloo_group(args.control_timeout)
    try:
        check_handshake(make_torch_all_gather(control_group)(handshake_info(rank, engine_args)))
    except ControlPlaneError as exc:
        logger.error("rank %d: %s", rank, exc)
        if server is not None:
            server.shutdown()
            server.server_close()
        return 2
    broadcast = make_torch_broadcast(control_group, src=0)
    _install_signal_handlers(rank, stop_event)

    sampling_defaults: dict = {}
    tokenizer = None
    if rank == 0:
        model_config = getattr(engine, "model_config", None)
        if model_config is not None:
            try:
                sampling_defaults = dict(model_config.get_diff_sampling_param())
            except Exception as exc:  # a missing generation config is not fatal
                logger.warning("no generation-config defaults: %s", exc)
            state.max_model_len = getattr(model_config, "max_model_len", None)
        try:
            tokenizer = engine.get_tokenizer()
        except Exception as exc:
            logger.warning("no tokenizer (chat disabled): %s", exc)
        state.ready.set()
        logger.info("rank 0: serving %s on http://%s:%d", ", ".join(model_names), args.host, args.port)

    loop = LockstepLoop(
        rank,
        engine,
        broadcast,
        make_sampling_params=make_vllm_sampling_params(),
        request_queue=request_queue,
        prepare=lambda request: prepare_prompt(request, tokenizer),
        sampling_defaults=sampling_defaults,
        stop_event=stop_event,
        idle_timeout=args.control_idle_timeout,
    )
    exit_code = 0
    try:
        steps = loop.run()
        logger.info("rank %d: stopped cleanly after %d engine steps", rank, steps)
    except Exception:
        logger.exception("rank %d: engine loop failed", rank)
        exit_code = 1
    finally:
        stop_event.set()
        if server is not None:
            server.shutdown()
            server.server_close()
        if request_queue is not None:
            late, _ = request_queue.drain(0.0)
            for pending in late:
                _fail(pending.future, RequestError("The server is shutting down", 503))
    if exit_code == 0:
        try:
            dist.barrier(group=control_group)
            dist.destroy_process_group()
        except Exception as exc:
            logger.warning("rank %d: process group teardown: %s", rank, exc)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
