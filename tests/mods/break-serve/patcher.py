"""Patcher of the test mod break-serve (stdlib only): `vllm serve` raises as it imports its API server."""

from __future__ import annotations

SERVER = "vllm/entrypoints/launchers/api_server/entry.py"
TARGETS = [SERVER]
MARK = "sparkforge test mod break-serve"


def is_applied(sources: dict[str, str]) -> bool:
    return MARK in sources[SERVER]


def transform(sources: dict[str, str]) -> dict[str, str]:
    return {SERVER: sources[SERVER] + f'\nraise RuntimeError("{MARK}: broken on purpose")\n'}
