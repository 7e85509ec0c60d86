"""Tests for mods/serve-torchrun/serve_torchrun.py, without a GPU and without vLLM.

The script is not a package, so it is loaded from its path with importlib.
The GLOO test runs this same file as a worker process (see ``_gloo_worker`` at the
bottom), one process per rank, on 127.0.0.1 only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # not tests.support.paths: the GLOO workers run this file as a script
SCRIPT = REPO / "mods" / "serve-torchrun" / "serve_torchrun.py"


def load_module():
    spec = importlib.util.spec_from_file_location("serve_torchrun_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


st = load_module()


# --------------------------------------------------------------------------------------
# Fakes
# --------------------------------------------------------------------------------------


class FakeCompletion:
    def __init__(self, text, token_ids, finish_reason):
        self.text = text
        self.token_ids = token_ids
        self.finish_reason = finish_reason


class FakeOutput:
    def __init__(self, request_id, prompt_token_ids, completion, finished=True):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [completion]
        self.finished = finished


class FakeEngine:
    """Enough of vLLM's LLMEngine: a request takes ``max_tokens`` steps to finish."""

    def __init__(self):
        self.live = {}  # insertion-ordered, like a FCFS scheduler
        self.params = {}
        self.step_delay = 0.0
        self.log = []  # ("add", id) / ("abort", id) / ("step", n_live)
        self.steps = 0
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt, params, arrival_time=None):
        assert isinstance(request_id, str)
        if params.get("max_tokens") == 4242:
            raise ValueError("max_tokens 4242 exceeds the fake context")
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            text = "".join(chr(i) for i in ids)
        else:
            text = prompt["prompt"]
            ids = [ord(c) for c in text]
        self.params[request_id] = params
        budget = params.get("max_tokens") or 3
        self.live[request_id] = {"text": text, "ids": ids, "left": budget, "made": 0, "params": params}
        self.log.append(("add", request_id))

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.live.pop(rid, None)
            self.log.append(("abort", rid))

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        self.log.append(("step", len(self.live)))
        done = []
        for rid, req in list(self.live.items()):
            req["left"] -= 1
            req["made"] += 1
            if req["left"] <= 0:
                del self.live[rid]
                text = f"<{req['text'][::-1]}>"
                done.append(FakeOutput(rid, req["ids"], FakeCompletion(text, list(range(req["made"])), "length")))
        return done


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert tokenize is False
        if any(m["content"] == "BOOM" for m in messages):
            raise ValueError("template exploded")
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) % 1000 for c in text]


# --------------------------------------------------------------------------------------
# Import hygiene
# --------------------------------------------------------------------------------------


def test_module_imports_with_stdlib_only():
    code = (
        "import importlib.util, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'vllm', 'numpy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m; spec.loader.exec_module(m)\n"
        "print('ok', m.CONTROL_PROTOCOL)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


# --------------------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------------------

MODELS = ["qwen3-coder"]


def test_parse_completion_good():
    req = st.parse_completion_request(
        {
            "model": "qwen3-coder",
            "prompt": "Hello",
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 20,
            "stop": "\n",
            "seed": 7,
            "n": 1,
            "stream": False,
            "user": "u1",
        },
        MODELS,
    )
    assert req == {
        "kind": "completion",
        "model": "qwen3-coder",
        "prompt": {"prompt": "Hello"},
        "sampling": {"max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["\n"], "seed": 7},
        "return_token_ids": False,
    }
    json.dumps(req)  # JSON-able, so it can cross the control plane


def test_parse_completion_prompt_forms_and_nulls():
    assert st.parse_completion_request({"prompt": [1, 2, 3]})["prompt"] == {"prompt_token_ids": [1, 2, 3]}
    assert st.parse_completion_request({"prompt": ["only one"]})["prompt"] == {"prompt": "only one"}
    req = st.parse_completion_request({"prompt": "x", "temperature": None, "stop": None, "model": None}, MODELS)
    assert req["sampling"] == {} and req["model"] is None
    assert st.parse_completion_request({"prompt": "x", "top_k": -1, "temperature": 0})["sampling"] == {
        "top_k": -1,
        "temperature": 0.0,
    }


def test_vllms_own_extensions_exact_tokens_and_their_ids():
    req = st.parse_completion_request({"prompt": "x", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True})
    assert req["sampling"] == {"max_tokens": 8, "ignore_eos": True} and req["return_token_ids"] is True
    chat = st.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": False})
    assert chat["sampling"] == {} and chat["return_token_ids"] is False
    for field, value in (("ignore_eos", "yes"), ("return_token_ids", 1)):
        try:
            st.parse_completion_request({"prompt": "x", field: value})
        except st.RequestError as exc:
            assert exc.status == 400 and field in exc.message
        else:
            raise AssertionError(f"{field}={value!r} was taken")


def test_parse_chat_good():
    req = st.parse_chat_request(
        {
            "model": "qwen3-coder",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            ],
            "max_completion_tokens": 32,
            "stop": ["END", "STOP"],
        },
        MODELS,
    )
    assert req["kind"] == "chat"
    assert req["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert req["sampling"] == {"max_tokens": 32, "stop": ["END", "STOP"]}


BAD_COMPLETIONS = [
    ({"prompt": "x", "stream": True}, "stream"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.1}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "top_k": 2.0}, "top_k"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "x", "seed": "1"}, "seed"),
    ({"prompt": "x", "seed": False}, "seed"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "user": 3}, "user"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "frequency_penalty": 0.1}, "frequency_penalty"),
    ({"prompt": "x", "model": ""}, "model"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
]


def test_parse_completion_rejects_each_bad_field():
    import pytest

    for body, field in BAD_COMPLETIONS:
        with pytest.raises(st.RequestError) as info:
            st.parse_completion_request(body, MODELS)
        err = info.value
        assert err.status == 400, (body, err.status)
        assert err.param == field, (body, err.param)
        assert field in err.message, (body, err.message)
        shape = err.to_body()
        assert set(shape) == {"error"}
        assert set(shape["error"]) == {"message", "type", "param", "code"}
        assert shape["error"]["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 5},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
]


def test_parse_chat_rejects_each_bad_field():
    import pytest

    for body, field in BAD_CHATS:
        with pytest.raises(st.RequestError) as info:
            st.parse_chat_request(body, MODELS)
        assert info.value.status == 400, body
        assert info.value.param == field, (body, info.value.param)
        assert field in info.value.message, (body, info.value.message)


def test_unknown_model_is_404_and_bad_json_is_400():
    import pytest

    with pytest.raises(st.RequestError) as info:
        st.parse_completion_request({"prompt": "x", "model": "gpt-4"}, MODELS)
    assert info.value.status == 404 and info.value.param == "model"
    assert info.value.to_body()["error"]["code"] == "model_not_found"
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(st.RequestError) as info:
            st.decode_json_body(raw)
        assert info.value.status == 400


def test_resolve_sampling_merges_model_defaults():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    got = st.resolve_sampling("chat", {"temperature": 0.0, "stop": ["x"]}, defaults)
    assert got == {
        "temperature": 0.0,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "stop": ["x"],
        "max_tokens": None,
        "n": 1,
    }
    assert st.resolve_sampling("completion", {}, None) == {"max_tokens": 16, "n": 1}
    assert st.resolve_sampling("completion", {}, {"max_tokens": 99})["max_tokens"] == 99


def test_prepare_prompt_renders_chat_template():
    chat = st.parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    prompt = st.prepare_prompt(chat, FakeTokenizer())
    # token ids only (the template already holds the special tokens; keeps the broadcast small)
    assert prompt == {"prompt_token_ids": [ord(c) for c in "[user]hi[assistant]"]}
    comp = st.parse_completion_request({"prompt": "abc"})
    assert st.prepare_prompt(comp, None) == {"prompt": "abc"}
    import pytest

    with pytest.raises(st.RequestError) as info:
        st.prepare_prompt(st.parse_chat_request({"messages": [{"role": "user", "content": "BOOM"}]}), FakeTokenizer())
    assert info.value.status == 400 and info.value.param == "messages"


# --------------------------------------------------------------------------------------
# Response formatting
# --------------------------------------------------------------------------------------


def test_summarize_and_format_completion():
    out = FakeOutput("cmpl-1", [1, 2, 3], FakeCompletion("world", [9, 9], "stop"))
    result = st.summarize_output(out)
    assert result == {"text": "world", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2,
                      "token_ids": [9, 9]}
    body = st.format_completion_response("cmpl-1", "m", result, created=123)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 123,
        "model": "m",
        "choices": [{"index": 0, "text": "world", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def test_format_chat_and_models():
    result = {"text": "Hi!", "finish_reason": "length", "prompt_tokens": 4, "completion_tokens": 1}
    body = st.format_chat_response("chatcmpl-1", "m", result, created=5)
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["total_tokens"] == 5
    models = st.format_models_response(["a", "b"], 10, 4096)
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert models["data"][0] == {"id": "a", "object": "model", "created": 10, "owned_by": "sparkforge",
                                 "max_model_len": 4096}


# --------------------------------------------------------------------------------------
# Request queue and lockstep loop
# --------------------------------------------------------------------------------------


def test_queue_drain_waits_then_batches():
    q = st.RequestQueue()
    t0 = time.monotonic()
    assert q.drain(0.05) == ([], [])
    assert time.monotonic() - t0 >= 0.04
    a = q.submit({"kind": "completion"})
    b = q.submit({"kind": "chat"})
    q.abort(a.request_id)
    added, aborted = q.drain(1.0)
    assert [p.request_id for p in added] == [a.request_id, b.request_id]
    assert a.request_id.startswith("cmpl-") and b.request_id.startswith("chatcmpl-")
    assert aborted == [a.request_id]
    assert q.drain(0) == ([], [])


def _completion(prompt, **kw):
    return st.parse_completion_request({"prompt": prompt, **kw})


def test_lockstep_two_ranks_same_broadcast_sequence():
    q = st.RequestQueue()
    stop = threading.Event()
    sent = []

    def record(obj):
        sent.append(json.loads(json.dumps(obj)))  # must survive a JSON round trip
        return obj

    engine0, engine1 = FakeEngine(), FakeEngine()
    leader = st.LockstepLoop(0, engine0, record, request_queue=q, stop_event=stop, idle_timeout=0.001)

    first = [q.submit(_completion("ab", max_tokens=2)), q.submit(_completion("xyz", max_tokens=3))]
    assert leader.run_once()  # adds both, steps once
    late = q.submit(_completion("late", max_tokens=1))
    bad = q.submit(_completion("bad", max_tokens=4242))  # the engine rejects it on every rank
    for _ in range(4):
        assert leader.run_once()
    assert leader.run_once()  # idle iteration: empty batch is still broadcast
    stop.set()
    assert leader.run_once() is False

    assert [m["op"] for m in sent][-1] == "stop"
    assert [m["seq"] for m in sent] == list(range(len(sent)))
    assert sent[-2]["add"] == [] and sent[-2]["abort"] == []

    # rank 0 resolved its futures with the right results
    assert first[0].future.result(0)["text"] == "<ba>"
    assert first[1].future.result(0)["text"] == "<zyx>"
    assert late.future.result(0) == {"text": "<etal>", "finish_reason": "length", "prompt_tokens": 4,
                                     "completion_tokens": 1, "token_ids": [0]}
    err = bad.future.exception(0)
    assert isinstance(err, st.RequestError) and err.status == 400 and "4242" in err.message

    # rank 1 replays the same broadcast sequence
    replay = iter(sent)

    def follower_broadcast(obj):
        assert obj is None, "a follower must not send anything"
        return next(replay)

    follower = st.LockstepLoop(1, engine1, follower_broadcast)
    assert follower.run() == leader.steps
    assert follower.added == leader.added == [first[0].request_id, first[1].request_id, late.request_id]
    assert engine1.log == engine0.log
    assert engine1.steps == engine0.steps == leader.steps
    assert leader.pending == {}


def test_lockstep_abort_and_desync_detection():
    import pytest

    q = st.RequestQueue()
    engine = FakeEngine()
    loop = st.LockstepLoop(0, engine, lambda o: o, request_queue=q, idle_timeout=0.001)
    p = q.submit(_completion("long", max_tokens=100))
    loop.run_once()
    q.abort(p.request_id)
    loop.run_once()
    assert ("abort", p.request_id) in engine.log
    assert p.future.exception(0).status == 504
    assert not engine.has_unfinished_requests()

    follower = st.LockstepLoop(1, FakeEngine(), lambda o: st.make_batch_message(5, [], []))
    with pytest.raises(st.ControlPlaneError):
        follower.run_once()
    follower = st.LockstepLoop(1, FakeEngine(), lambda o: {"op": "batch"})
    with pytest.raises(st.ControlPlaneError):
        follower.run_once()


def test_stop_fails_outstanding_requests():
    q = st.RequestQueue()
    stop = threading.Event()
    loop = st.LockstepLoop(0, FakeEngine(), lambda o: o, request_queue=q, stop_event=stop, idle_timeout=0.001)
    running = q.submit(_completion("slow", max_tokens=1000))
    loop.run_once()
    stop.set()
    queued = q.submit(_completion("never"))
    assert loop.run() == 1
    assert running.future.exception(0).status == 503
    assert queued.future.exception(0).status == 503


def test_handshake_detects_disagreeing_ranks():
    import pytest

    class Args:
        model = "m"
        seed = 0
        tensor_parallel_size = 2
        dtype = "auto"

    infos = [st.handshake_info(r, Args(), str(SCRIPT)) for r in range(2)]
    assert infos[0]["script_sha256"] == infos[1]["script_sha256"] and len(infos[0]["script_sha256"]) == 64
    assert infos[0]["proto"] == st.CONTROL_PROTOCOL
    st.check_handshake(infos)
    infos[1]["seed"] = 1
    with pytest.raises(st.ControlPlaneError, match="seed"):
        st.check_handshake(infos)
    with pytest.raises(st.ControlPlaneError, match="rank"):
        st.check_handshake([dict(infos[0]), dict(infos[0])])


# --------------------------------------------------------------------------------------
# HTTP end to end with a fake engine
# --------------------------------------------------------------------------------------


class Harness:
    def __init__(self, request_timeout=10.0):
        self.queue = st.RequestQueue()
        self.stop = threading.Event()
        self.engine = FakeEngine()
        self.state = st.ServerState(
            model_names=["fake-model"], queue=self.queue, request_timeout=request_timeout,
            max_model_len=2048, stopping=self.stop,
        )
        self.server = st.make_http_server("127.0.0.1", 0, self.state)
        self.port = self.server.server_address[1]
        tokenizer = FakeTokenizer()
        self.loop = st.LockstepLoop(
            0, self.engine, lambda o: o, request_queue=self.queue, stop_event=self.stop, idle_timeout=0.005,
            prepare=lambda r: st.prepare_prompt(r, tokenizer),
            sampling_defaults={"temperature": 0.6},
        )
        self.loop_thread = threading.Thread(target=self.loop.run, daemon=True)

    def __enter__(self):
        st.start_http_thread(self.server)
        self.loop_thread.start()
        self.state.ready.set()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.loop_thread.join(5)
        self.server.shutdown()
        self.server.server_close()

    def call(self, method, path, body=None, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


def test_http_end_to_end():
    with Harness() as h:
        assert h.call("GET", "/health") == (200, {"status": "ok"})
        status, models = h.call("GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "fake-model"
        assert models["data"][0]["max_model_len"] == 2048

        status, body = h.call("POST", "/v1/completions", {"model": "fake-model", "prompt": "abc", "max_tokens": 2})
        assert status == 200, body
        assert body["object"] == "text_completion" and body["model"] == "fake-model"
        assert body["choices"][0]["text"] == "<cba>"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert body["id"].startswith("cmpl-")

        status, body = h.call(
            "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        )
        assert status == 200, body
        assert body["object"] == "chat.completion" and body["model"] == "fake-model"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "<]tnatsissa[ih]resu[>"}
        assert body["usage"]["prompt_tokens"] == len("[user]hi[assistant]")

        status, body = h.call("POST", "/v1/completions", {"prompt": "abc", "stream": True})
        assert status == 400 and body["error"]["param"] == "stream"
        assert body["error"]["type"] == "invalid_request_error"
        status, body = h.call("POST", "/v1/completions", raw=b"{oops")
        assert status == 400 and "JSON" in body["error"]["message"]
        status, body = h.call("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 4242})
        assert status == 400 and "4242" in body["error"]["message"]
        status, body = h.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "BOOM"}]})
        assert status == 400 and body["error"]["param"] == "messages"
        status, body = h.call("POST", "/v1/completions", {"prompt": "abc", "model": "other"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert h.call("GET", "/nope")[0] == 404
        assert h.call("GET", "/v1/completions")[0] == 405

        # the model's generation-config defaults reached the engine under the request's own values
        sent = list(h.engine.params.values())
        assert sent[0] == {"temperature": 0.6, "max_tokens": 2, "n": 1}
        assert sent[1] == {"temperature": 0.6, "max_tokens": 1, "n": 1}
        assert not h.engine.has_unfinished_requests()


def test_http_concurrent_requests_are_batched_and_timeouts_abort():
    with Harness(request_timeout=5.0) as h:
        h.engine.step_delay = 0.01  # a step takes time, so requests overlap like on a GPU
        results = {}

        def worker(i):
            results[i] = h.call("POST", "/v1/completions", {"prompt": f"p{i}", "max_tokens": 3})

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert all(results[i][0] == 200 and results[i][1]["choices"][0]["text"] == f"<{i}p>" for i in range(6))
        # six requests of three tokens took fewer than 18 steps: they ran together
        assert h.engine.steps < 18

        h.state.request_timeout = 0.3
        status, body = h.call("POST", "/v1/completions", {"prompt": "forever", "max_tokens": 10**6})
        assert status == 504 and body["error"]["type"] == "timeout"
        deadline = time.monotonic() + 5
        while h.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not h.engine.has_unfinished_requests()
        assert any(kind == "abort" for kind, _ in h.engine.log)

        h.stop.set()
        h.loop_thread.join(5)
        assert not h.loop_thread.is_alive()
        assert h.call("GET", "/health")[0] == 503
        assert h.call("POST", "/v1/completions", {"prompt": "x"})[0] == 503


def test_server_args_and_torchrun_env():
    import argparse

    import pytest

    parser = st.add_server_args(argparse.ArgumentParser())
    args = parser.parse_args(["--host", "127.0.0.1", "--port", "9000"])
    assert (args.host, args.port, args.request_timeout, args.control_idle_timeout) == ("127.0.0.1", 9000, 600.0, 0.02)
    assert parser.parse_args([]).port == 8011
    env = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert st.check_torchrun_env(env) == {"rank": 1, "local_rank": 0, "world_size": 2}
    with pytest.raises(SystemExit, match="torchrun"):
        st.check_torchrun_env({"RANK": "0"})


# --------------------------------------------------------------------------------------
# A real GLOO broadcast across two processes
# --------------------------------------------------------------------------------------


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_broadcast_two_processes(tmp_path):
    from tests.support.needs import require

    require("torch")

    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--gloo-worker", str(tmp_path / f"rank{rank}.json")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]

    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    # what rank 0 broadcast arrived at rank 1 identically and in order
    assert r1["received"] == r0["received"]
    assert [m["seq"] for m in r1["received"]] == list(range(len(r0["received"])))
    assert r1["received"][-1]["op"] == "stop"
    batches = [m for m in r0["received"] if m["op"] == "batch" and m["add"]]
    assert [a["prompt"]["prompt"] for m in batches for a in m["add"]] == ["alpha", "beta", "gamma", "delta"]
    # both engines saw the same adds in the same order and stepped the same number of times
    assert r0["added"] == r1["added"] and len(r0["added"]) == 4
    assert r0["engine_log"] == r1["engine_log"]
    assert r0["steps"] == r1["steps"] > 0
    assert r0["results"] == {"alpha": "<ahpla>", "beta": "<ateb>", "gamma": "<ammag>", "delta": "<atled>"}
    assert r1["results"] == {}
    assert r0["world"] == r1["world"] == 2
    assert r0["handshake"] == r1["handshake"] and [i["rank"] for i in r0["handshake"]] == [0, 1]


# A stand-in for the few vLLM modules main() imports, so that main() itself (argument
# parsing, torch.distributed set-up, handshake, HTTP thread, signals, stop broadcast)
# runs for real under two processes. Written to a temporary directory by the test.
FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = '0.0.0+fake'\n",
    "vllm/engine/__init__.py": "",
    "vllm/utils/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/utils/argparse_utils.py": "from argparse import ArgumentParser as FlexibleArgumentParser\n",
    "vllm/sampling_params.py": (
        "import enum\n"
        "class RequestOutputKind(enum.Enum):\n"
        "    CUMULATIVE = 0\n"
        "    DELTA = 1\n"
        "    FINAL_ONLY = 2\n"
        "class SamplingParams:\n"
        "    def __init__(self, **kw):\n"
        "        self.__dict__.update(kw)\n"
    ),
    "vllm/engine/arg_utils.py": (
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class EngineArgs:\n"
        "    model: str = 'fake'\n"
        "    served_model_name: object = None\n"
        "    seed: int = 0\n"
        "    tensor_parallel_size: int = 1\n"
        "    distributed_executor_backend: object = None\n"
        "    @staticmethod\n"
        "    def add_cli_args(parser):\n"
        "        parser.add_argument('--model', default='fake')\n"
        "        parser.add_argument('--served-model-name', nargs='+', default=None)\n"
        "        parser.add_argument('--seed', type=int, default=0)\n"
        "        parser.add_argument('--tensor-parallel-size', type=int, default=1)\n"
        "        parser.add_argument('--distributed-executor-backend', default=None)\n"
        "        return parser\n"
        "    @classmethod\n"
        "    def from_cli_args(cls, args):\n"
        "        names = [f.name for f in dataclasses.fields(cls)]\n"
        "        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})\n"
    ),
    "vllm/v1/engine/llm_engine.py": (
        "import os, types\n"
        "import torch.distributed as dist\n"
        "class _Tok:\n"
        "    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):\n"
        "        return ''.join(m['content'] for m in messages)\n"
        "    def encode(self, text, add_special_tokens=True):\n"
        "        return [ord(c) for c in text]\n"
        "class LLMEngine:\n"
        "    @classmethod\n"
        "    def from_engine_args(cls, engine_args):\n"
        "        assert engine_args.distributed_executor_backend == 'external_launcher'\n"
        "        assert os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] == '0'\n"
        "        dist.init_process_group('gloo', init_method='env://')\n"
        "        assert dist.get_world_size() == engine_args.tensor_parallel_size\n"
        "        return cls()\n"
        "    def __init__(self):\n"
        "        self.live = {}\n"
        "        self.model_config = types.SimpleNamespace(max_model_len=128,\n"
        "            get_diff_sampling_param=lambda: {'temperature': 0.5})\n"
        "    def get_tokenizer(self):\n"
        "        return _Tok()\n"
        "    def add_request(self, request_id, prompt, params, arrival_time=None):\n"
        "        assert params.output_kind.name == 'FINAL_ONLY' and params.temperature == 0.5\n"
        "        ids = prompt.get('prompt_token_ids') or [ord(c) for c in prompt['prompt']]\n"
        "        self.live[request_id] = [ids, params.max_tokens, 0]\n"
        "    def abort_request(self, ids):\n"
        "        for i in ids:\n"
        "            self.live.pop(i, None)\n"
        "    def has_unfinished_requests(self):\n"
        "        return bool(self.live)\n"
        "    def step(self):\n"
        "        out = []\n"
        "        for rid, st in list(self.live.items()):\n"
        "            st[2] += 1\n"
        "            if st[2] >= st[1]:\n"
        "                del self.live[rid]\n"
        "                text = ''.join(chr(i) for i in st[0])[::-1]\n"
        "                c = types.SimpleNamespace(text=text, token_ids=list(range(st[2])), finish_reason='length')\n"
        "                out.append(types.SimpleNamespace(request_id=rid, prompt_token_ids=st[0], outputs=[c],\n"
        "                                                 finished=True))\n"
        "        if out:\n"
        "            print('RANK', os.environ['RANK'], 'FINISHED', len(out), flush=True)\n"
        "        return out\n"
    ),
}


def test_main_under_two_processes_with_stand_in_vllm(tmp_path):
    from tests.support.needs import require

    require("torch")  # main() needs torch.distributed (CPU is fine)
    import signal as _signal

    fake = tmp_path / "fakevllm"
    for rel, text in FAKE_VLLM.items():
        path = fake / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    master, http_port = _free_port(), _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(fake), VLLM_ENABLE_V1_MULTIPROCESSING="1",
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), "--model", "fake", "--served-model-name", "fake-served",
             "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", str(http_port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 300  # two imports of torch on a loaded machine take minutes
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    assert resp.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert all(p.poll() is None for p in procs), procs[0].communicate()[0][-3000:]
                assert time.monotonic() < deadline, "rank 0 never became healthy"
                time.sleep(0.1)
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps({"model": "fake-served", "messages": [{"role": "user", "content": "abc"}],
                             "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["choices"][0]["message"]["content"] == "cba"
        assert body["model"] == "fake-served"
        procs[0].send_signal(_signal.SIGTERM)
        outs = [p.communicate(timeout=20)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    for rank, out in enumerate(outs):
        assert f"RANK {rank} FINISHED 1" in out  # both engines ran the request
        assert "stopped cleanly" in out
    assert "overriding VLLM_ENABLE_V1_MULTIPROCESSING" in outs[0]


def _gloo_worker(out_path):
    """One rank of the GLOO test: the server's own group and broadcast around a fake engine."""
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=30))
    group = st.make_gloo_group(30)

    class Args:
        model = "fake-model"
        seed = 0
        tensor_parallel_size = 2

    infos = st.make_torch_all_gather(group)(st.handshake_info(rank, Args()))
    st.check_handshake(infos)
    inner = st.make_torch_broadcast(group, src=0)
    received = []

    def broadcast(obj):
        msg = inner(obj)
        received.append(msg)
        return msg

    engine = FakeEngine()
    results = {}
    if rank == 0:
        q = st.RequestQueue()
        stop = threading.Event()
        loop = st.LockstepLoop(0, engine, broadcast, request_queue=q, stop_event=stop, idle_timeout=0.002)
        futures = {}
        for prompt in ("alpha", "beta"):
            futures[prompt] = q.submit(_completion(prompt, max_tokens=2))
        loop.run_once()
        for prompt in ("gamma", "delta"):
            futures[prompt] = q.submit(_completion(prompt, max_tokens=3))
        for _ in range(8):
            loop.run_once()
        stop.set()
        loop.run()
        results = {k: f.future.result(0)["text"] for k, f in futures.items()}
    else:
        loop = st.LockstepLoop(rank, engine, broadcast)
        loop.run()
    world = dist.get_world_size(group)
    dist.barrier(group=group)
    dist.destroy_process_group()
    Path(out_path).write_text(
        json.dumps(
            {
                "received": received,
                "added": loop.added,
                "steps": loop.steps,
                "engine_log": engine.log,
                "results": results,
                "world": world,
                "handshake": infos,
            }
        )
    )


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--gloo-worker":
    _gloo_worker(sys.argv[2])
