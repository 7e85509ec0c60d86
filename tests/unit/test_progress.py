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


def test_a_long_build_step_says_again_what_it_is_doing_every_ten_seconds() -> None:
    from sparkforge.build.builder import STILL_RUNNING, _BuildLog

    now = [0.0]
    shown: list[tuple[str, str, float]] = []
    log = _BuildLog(progress=lambda step, elapsed: shown.append((step.name, step.said, elapsed)),
                    clock=lambda: now[0], start=0.0)
    for at, line in ((0, "#7 [runtime 4/9] RUN pip install vllm.whl"), (5, "#7 5.0 Processing vllm.whl"),
                     (STILL_RUNNING + 1, "#7 11.0 Installing collected packages: vllm"),
                     (15, "#7 15.0 still installing"), (2 * STILL_RUNNING + 2, "#7 22.0 Successfully installed vllm"),
                     (23, "#7 DONE 23.0s")):
        now[0] = at
        log.feed(line)
    assert shown == [("runtime 4/9", "", 0.0),
                     ("runtime 4/9", "Installing collected packages: vllm", STILL_RUNNING + 1),
                     ("runtime 4/9", "Successfully installed vllm", 2 * STILL_RUNNING + 2)]


def test_a_step_from_the_cache_is_not_shown_and_one_that_runs_is_shown_with_the_time_it_started() -> None:
    from sparkforge.build.builder import _BuildLog

    now = [0.0]
    shown: list[tuple[str, float]] = []
    log = _BuildLog(progress=lambda step, elapsed: shown.append((step.name, elapsed)), clock=lambda: now[0], start=0.0)
    for at, line in ((0, "#4 [base 1/3] FROM docker.io/library/debian:bookworm@sha256:00"),
                     (0, "#4 resolve docker.io/library/debian:bookworm@sha256:00 done"), (0, "#4 CACHED"), (0, ""),
                     (1, "#5 [other 1/2] FROM docker.io/library/debian:trixie@sha256:01"),
                     (1, "#5 resolve docker.io/library/debian:trixie@sha256:01 done"), (1, "#5 DONE 0.0s"),
                     (1, "#6 [base 2/3] COPY sparkforge/inimage/ /opt/sparkforge/inimage/"), (1, "#6 CACHED"), (1, ""),
                     (2, "#8 [runtime 1/2] RUN pip install vllm.whl"), (2, ""), (4, "#8 2.1 Processing vllm.whl"),
                     (9, "#9 [runtime 2/2] COPY plan.json /opt/plan.json"), (9, "#9 CACHED"),
                     (12, "#10 [runtime 3/3] RUN record"), (14, "#10 DONE 2.0s")):
        now[0] = at
        log.feed(line)
    # shown at its next line, with the time it started; the cached steps and a base the engine had, never
    assert shown == [("runtime 1/2", 2.0), ("runtime 3/3", 12.0)]
    assert [n for n, step in sorted(log.steps.items()) if step.cached] == [4, 6, 9]


def test_a_step_that_runs_without_a_line_is_shown_once_a_second_has_passed() -> None:
    from sparkforge.build.builder import SHOW_AFTER, _BuildLog

    now = [0.0]
    shown: list[tuple[str, float]] = []
    log = _BuildLog(progress=lambda step, elapsed: shown.append((step.name, elapsed)), clock=lambda: now[0], start=0.0)
    log.feed("#5 [2/2] RUN sleep 600")
    now[0] = SHOW_AFTER / 2
    log.feed("")  # the build's time passing, no line yet
    assert shown == []
    now[0] = SHOW_AFTER
    log.feed("")
    assert shown == [("2/2", 0.0)]
    now[0] = 600
    log.feed("#5 DONE 600.0s")
    assert shown == [("2/2", 0.0)] and log.steps[5].ran


def test_a_download_says_its_bytes_of_the_whole_and_the_time_left_at_most_every_few_seconds() -> None:
    from sparkforge.net import byte_progress

    now = [0.0]
    lines: list[str] = []
    show = byte_progress(lines.append, "downloading vllm-0.19.0.tar.gz", every=5.0, clock=lambda: now[0])
    for at, done in ((1, 1_000_000), (5, 10_000_000), (6, 12_000_000), (10, 20_000_000), (11, 40_000_000)):
        now[0] = at
        show(done, 40_000_000)
    assert lines == ["downloading vllm-0.19.0.tar.gz: 10.0 of 40.0 MB, about 15 s left",
                     "downloading vllm-0.19.0.tar.gz: 20.0 of 40.0 MB, about 10 s left",
                     "downloading vllm-0.19.0.tar.gz: 40.0 of 40.0 MB"]


def test_a_quick_download_says_nothing() -> None:
    from sparkforge.net import byte_progress

    lines: list[str] = []
    show = byte_progress(lines.append, "downloading x", every=5.0, clock=lambda: 1.0)
    show(10, 20)
    show(20, 20)
    assert lines == []


def test_a_transfer_says_its_bytes_its_rate_and_with_a_total_the_time_left() -> None:
    from sparkforge.distribute.deploy import moved_said

    # A pull of 4.3 GB: 1.2 GB moved, 1.0 GB of it in the last 10 s.
    assert moved_said(1_200_000_000, 4_300_000_000, 10.0, since=200_000_000) == \
        "1.2 GB / 4.3 GB at 100.0 MB/s, about 31 s left"
    # A push, whose whole is not known: bytes and rate only.
    assert moved_said(300_000_000, None, 4.0) == "300.0 MB at 75.0 MB/s"
    # No time passed yet, or done: no rate to go by, nothing left to wait.
    assert moved_said(5_000, 10_000, 0.0) == "5.0 kB / 10.0 kB"
    assert moved_said(10_000, 10_000, 2.0) == "10.0 kB / 10.0 kB at 5.0 kB/s"
    assert moved_said(1_000_000_000, 9_000_000_000, 10.0) == "1.0 GB / 9.0 GB at 100.0 MB/s, about 1 min 20 s left"
