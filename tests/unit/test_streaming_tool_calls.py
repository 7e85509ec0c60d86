"""The streaming-tool-calls mod against the real Anthropic stream converter of each release it targets.

The mod's range is checked against the release sources (PyPI, cached), and its effect is shown by
running the converter itself, before and after the patch, on one OpenAI stream: the converter is
lifted out of serving.py (the module needs torch and FastAPI) and run with the release's own
pydantic protocol models.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import logging
import types
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sparkforge import inimage
from sparkforge.recipe import sources
from sparkforge.repro.checkmods import matrix
from sparkforge.recipe.config import load_mod
from sparkforge.recipe.layout import Layout, digest_tree
from sparkforge.recipe.plan import Mod
from sparkforge.recipe.remote import materialize

pytestmark = pytest.mark.network

NAME = "streaming-tool-calls"
SERVING = "vllm/entrypoints/anthropic/serving.py"
DECLARED = ["0.15.0", "0.15.1", "0.16.0"]
UPSTREAM_FIXED = ["0.17.0", "0.17.1"]


def the_mod() -> Mod:
    spec, folder = load_mod(Layout.default().mods_dir, NAME)
    return Mod(NAME, digest_tree(folder), str(folder), spec)


def test_declares_exactly_the_releases_whose_converter_has_the_fault() -> None:
    spec = SpecifierSet(the_mod().spec.targets.versions)
    releases = [v for v in sources.release_versions("vllm") if Version(v) >= Version("0.12.0")]
    assert [v for v in releases if spec.contains(v)] == DECLARED


def test_applies_to_every_declared_release_and_fails_where_upstream_rewrote_it(fast_tmp: Path) -> None:
    cells = matrix([the_mod()], DECLARED + UPSTREAM_FIXED, fast_tmp)
    assert [(c.version, c.state, c.declared) for c in cells] == (
        [(v, "applied", True) for v in DECLARED] + [(v, "failed", False) for v in UPSTREAM_FIXED]), \
        [(c.version, c.detail) for c in cells]
    for cell in cells[len(DECLARED):]:
        assert cell.detail.startswith(f"{SERVING}: hunk @@")
        # what replaced the fault there: upstream's own handling of a call's first arguments
        assert "# Handle initial arguments if present" in (
            sources.release_tree("vllm", cell.version) / SERVING).read_text()


def test_second_application_is_detected(fast_tmp: Path) -> None:
    m = the_mod()
    spec = materialize(m)[0]
    root = sources.scratch_copy(sources.release_tree("vllm", "0.16.0"), fast_tmp / "root")
    assert inimage.apply_mod(spec, Path(m.folder), root).state == inimage.ModState.APPLIED
    assert [c for c in inimage.verify_mod(spec, root, in_image=False) if c[1] == inimage.CheckState.FAILED] == []
    assert inimage.apply_mod(spec, Path(m.folder), root).state == inimage.ModState.ALREADY


# ------------------------------------------------------------------ the converter, run


def _ns(value):
    """A parsed stream chunk as attributes, with the defaults the OpenAI delta model gives."""
    if isinstance(value, dict):
        out = types.SimpleNamespace(**{k: _ns(v) for k, v in value.items()})
        if "delta" in value:
            out.finish_reason = value.get("finish_reason")
            out.delta.content = value["delta"].get("content")
            out.delta.tool_calls = _ns(value["delta"].get("tool_calls", []))
        if "index" in value and "function" in value:  # a tool call delta
            out.id = value.get("id")
        return out
    if isinstance(value, list):
        return [_ns(v) for v in value]
    return value


class _StreamResponse:
    """Stands in for ChatCompletionStreamResponse (its module imports torch)."""

    @staticmethod
    def model_validate_json(data: str):
        parsed = json.loads(data)
        parsed.setdefault("usage", None)
        return _ns(parsed)


def converter(tree: Path):
    """message_stream_converter of tree's serving.py, bound to a stand-in server."""
    spec = importlib.util.spec_from_file_location("anthropic_protocol", tree / "vllm/entrypoints/anthropic/protocol.py")
    protocol = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(protocol)
    protocol.AnthropicStreamEvent.model_rebuild(_types_namespace=vars(protocol))  # its forward reference
    module = ast.parse((tree / SERVING).read_text())
    wrap = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "wrap_data_with_event")
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "AnthropicServingMessages")
    method = next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "message_stream_converter")
    namespace = {**vars(protocol), "AsyncGenerator": AsyncGenerator, "ChatCompletionStreamResponse": _StreamResponse,
                 "logger": logging.getLogger("test")}
    exec(compile(ast.Module(body=[wrap, method], type_ignores=[]), str(tree / SERVING), "exec"), namespace)
    server = types.SimpleNamespace(stop_reason_map={"stop": "end_turn", "length": "max_tokens",
                                                    "tool_calls": "tool_use"})
    return lambda generator: namespace["message_stream_converter"](server, generator)


def events(tree: Path, chunks: list[dict]) -> list[dict]:
    async def stream():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect():
        return [item async for item in converter(tree)(stream())]

    out = []
    for item in asyncio.run(collect()):
        if item.startswith("event: "):
            out.append(json.loads(item.split("\ndata: ", 1)[1]))
    assert [e for e in out if e["type"] == "error"] == []  # the converter reports its own exceptions so
    assert out[-1]["type"] == "message_stop"
    return out


def _delta(**delta) -> dict:
    return {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


WEATHER = {"index": 0, "id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
STREAM = [
    _delta(role="assistant", content=""),
    _delta(content="Let me look."),
    _delta(content="", tool_calls=[WEATHER]),  # a parser that emits the whole call, with an empty content
    {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"id": "chatcmpl-1", "model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}},
]


def tool_use(evs: list[dict]) -> tuple[list[str], str]:
    """The names of the tool_use blocks started, and the arguments sent as input_json_delta."""
    names = [e["content_block"]["name"] for e in evs
             if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    args = "".join(e["delta"]["partial_json"] for e in evs
                   if e["type"] == "content_block_delta" and e["delta"].get("type") == "input_json_delta")
    return names, args


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> tuple[Path, Path]:
    pristine = sources.release_tree("vllm", "0.16.0")
    patched = sources.scratch_copy(pristine, tmp_path_factory.mktemp("stc") / "root")
    m = the_mod()
    assert inimage.apply_mod(materialize(m)[0], Path(m.folder), patched).state == inimage.ModState.APPLIED
    return pristine, patched


def test_the_release_drops_a_tool_call_that_comes_with_empty_content(trees) -> None:
    pristine, patched = trees
    assert tool_use(events(pristine, STREAM)) == ([], "")
    evs = events(patched, STREAM)
    assert tool_use(evs) == (["get_weather"], '{"city": "Paris"}')
    texts = "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta"
                    and e["delta"].get("type") == "text_delta")
    assert texts == "Let me look."  # text from chunks without tool calls still goes out
    starts = [e for e in evs if e["type"] == "content_block_start"]
    stops = [e for e in evs if e["type"] == "content_block_stop"]
    assert [s["index"] for s in starts] == [0, 1] and [s["index"] for s in stops] == [0, 1]
    assert next(e for e in evs if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"


def test_the_release_drops_the_arguments_sent_with_the_call(trees) -> None:
    pristine, patched = trees
    no_content = dict(WEATHER)
    stream = [_delta(role="assistant", content=""), _delta(tool_calls=[no_content]),
              _delta(tool_calls=[{"index": 0, "function": {"arguments": ""}}])] + STREAM[3:]
    assert tool_use(events(pristine, stream)) == (["get_weather"], "")  # a tool_use whose input stays {}
    assert tool_use(events(patched, stream)) == (["get_weather"], '{"city": "Paris"}')
