"""Progress of a run over vLLM releases (check-mods --matrix, outdated): n/N, and the time left."""

from __future__ import annotations

from sparkforge.repro.checkmods import release_progress


def test_a_run_over_releases_says_n_of_n_and_the_time_left() -> None:
    now = [100.0]
    lines: list[str] = []
    tick = release_progress(lines.append, "matrix: vllm", 4, clock=lambda: now[0])
    for version, took in (("0.17.0", 30.0), ("0.17.1", 50.0), ("0.18.0", 10.0), ("0.18.1", 0.0)):
        tick(version)
        now[0] += took
    assert lines == ["matrix: vllm 0.17.0 (1/4)", "matrix: vllm 0.17.1 (2/4, about 1 min 30 s left)",
                     "matrix: vllm 0.18.0 (3/4, about 1 min 20 s left)", "matrix: vllm 0.18.1 (4/4, about 30 s left)"]
