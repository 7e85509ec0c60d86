"""The one way sparkforge runs a process (sparkforge/inimage/proc.py) with real children: the time limit stops the
whole process group, a missing program is one line, Ctrl-C and SIGTERM leave nothing running."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparkforge.inimage import proc
from tests.support.paths import ROOT

# A shell that starts a grandchild in its group, writes both pids, then waits forever.
FOREVER = 'sleep 300 & echo "$$ $!" > "$1"; wait'


def alive(pid: int) -> bool:
    """Whether pid is a running process (a zombie waiting for its parent counts as stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def pids_in(path: Path, within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"the child wrote no pids to {path} within {within:.0f} s")


def gone(pids: list[int], within: float = 60.0) -> bool:  # a loaded machine may take seconds to stop and reap them
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_that_never_ends_is_stopped_at_the_limit_with_its_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(proc.TimedOut) as caught:
        proc.run(["sh", "-c", FOREVER, "sh", str(pidfile)], timeout=1, what="git fetch")
    took = time.monotonic() - start
    assert str(caught.value) == "git fetch: gave no answer within 1 s and was stopped"
    assert took >= 1  # it ran to its limit, not less
    pids = pids_in(pidfile)
    assert len(pids) == 2 and gone(pids)  # the shell and the sleep it started, nothing else would stop them


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    with pytest.raises(proc.TimedOut):
        proc.run(["sh", "-c", "trap '' TERM; " + FOREVER, "sh", str(pidfile)], timeout=1)
    assert gone(pids_in(pidfile))


def test_a_missing_program_is_one_line() -> None:
    with pytest.raises(proc.CommandError) as caught:
        proc.run(["sparkforge-no-such-program", "fetch", "--all"], timeout=5)
    assert str(caught.value) == "sparkforge-no-such-program fetch: sparkforge-no-such-program is not installed"
    assert type(caught.value) is proc.CommandError


def test_a_program_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "tool"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)  # not executable
    with pytest.raises(proc.CommandError) as caught:
        proc.run([str(script), "x"], timeout=5)
    assert str(caught.value) == f"tool x: cannot start {script}: Permission denied"


def test_the_exit_code_and_output_come_back_and_no_shell_reads_the_arguments() -> None:
    done = proc.run(["sh", "-c", 'printf "%s" "$1"; echo oops >&2; exit 3', "sh", "$(id) ; `x`"], timeout=30,
                    capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "$(id) ; `x`", "oops\n")
    assert proc.run(["cat"], timeout=30, input=b"in", capture_output=True).stdout == b"in"


# The start of each child Python below: the checkout's proc, and Ctrl-C and SIGTERM as the CLI has them.
AS_THE_CLI = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from sparkforge.inimage import proc
    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)  # as the CLI does (dockercli.exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a test worker may start us with SIGINT ignored
""")

CHILD = AS_THE_CLI + textwrap.dedent("""
    proc.run(["sh", "-c", sys.argv[3], "sh", sys.argv[2]], timeout=300)
""")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_ctrl_c_and_sigterm_stop_the_child_and_its_group(tmp_path: Path, sig: int, code: int) -> None:
    """Python running the runner gets the signal while the child runs: the child's group goes with it."""
    pidfile = tmp_path / "pids"
    python = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), str(pidfile), FOREVER],
                              stderr=subprocess.PIPE)
    try:
        pids = pids_in(pidfile)
        assert all(alive(p) for p in pids)
        python.send_signal(sig)
        assert python.wait(timeout=30) == code
    finally:
        if python.poll() is None:
            python.kill()
            python.wait()
    assert gone(pids)  # sleep 300 ends only when stopped


# The signal lands while Popen is returning: the child runs, but proc.run has no name for it yet.
LATE = AS_THE_CLI + textwrap.dedent("""
    real = subprocess.Popen
    class Popen(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            # until the shell has written both pids (the file exists before they are in it)
            while not (os.path.exists(sys.argv[2]) and open(sys.argv[2]).read().endswith("\\n")):
                time.sleep(0.01)
            os.kill(os.getpid(), int(sys.argv[4]))
    subprocess.Popen = Popen
    proc.run(["sh", "-c", sys.argv[3], "sh", sys.argv[2]], timeout=300)
""")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_a_signal_while_the_child_starts_still_stops_its_group(tmp_path: Path, sig: int, code: int) -> None:
    pidfile = tmp_path / "pids"
    python = subprocess.Popen([sys.executable, "-c", LATE, str(ROOT), str(pidfile), FOREVER, str(int(sig))],
                              stderr=subprocess.PIPE)
    try:
        assert python.wait(timeout=60) == code
    finally:
        if python.poll() is None:
            python.kill()
            python.wait()
    assert gone(pids_in(pidfile))


def test_held_raises_a_signal_that_came_inside_it_as_it_ends() -> None:
    # As the CLI starts: Ctrl-C raises KeyboardInterrupt and is not blocked (a test worker may start otherwise).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        seen = []
        with pytest.raises(KeyboardInterrupt), proc.held():
            signal.raise_signal(signal.SIGINT)
            seen.append("went on")  # not interrupted inside
        assert seen == ["went on"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # and not left blocked
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)


def test_a_streaming_child_that_goes_silent_is_stopped_at_its_stall_limit() -> None:
    """The build's bound (dockercli.lines_until_stall): lines pass on; silence past the limit stops the child."""
    from sparkforge.build import dockercli

    child = dockercli.spawn(["sh", "-c", "echo one; echo two; exec sleep 300"], stdout=subprocess.PIPE, text=True)
    seen = []
    start = time.monotonic()
    with pytest.raises(dockercli.EngineError) as caught:
        for line in dockercli.lines_until_stall(child, stall=1):
            seen.append(line)
    assert seen == ["one\n", "two\n"]
    assert caught.value.detail == "wrote nothing for 1 s and was stopped"
    assert caught.value.field == "sh -c echo one; echo two; exec sleep 300"
    assert time.monotonic() - start >= 1 and child.poll() is not None
    dockercli.finish(child)


def test_a_streaming_child_read_with_ticks_gives_an_empty_line_for_each_silent_tick() -> None:
    """The build's lines with time passing between them (lines_until_stall with a tick): every line, in order,
    an empty string for each silent tick, and the end when the child ends."""
    from sparkforge.build import dockercli

    child = dockercli.spawn(["sh", "-c", "echo one; sleep 0.5; echo two"], stdout=subprocess.PIPE, text=True)
    seen = list(dockercli.lines_until_stall(child, stall=30, tick=0.1))
    assert [line for line in seen if line] == ["one\n", "two\n"]
    assert seen[0] == "one\n" and seen[-1] == "two\n" and seen.count("") >= 2
    assert dockercli.finish(child) == 0


# Many runs, each stopped by a signal at a random moment across the child's start-up (before the fork, inside
# Popen, as it returns, once it runs): whatever the moment, nothing the run started is left.
WINDOW = AS_THE_CLI + textwrap.dedent("""
    os.write(1, b"ready\\n")
    while True:
        proc.run(["sh", "-c", "sleep 300 & wait"], timeout=300)
""")


def marked(marker: str) -> list[int]:
    """The running processes whose environment holds marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_of_the_start_leaves_nothing_running(tmp_path: Path, sig: int) -> None:
    import os
    import random

    rng = random.Random(1234 + int(sig))
    for i in range(100):
        marker = f"SPARKFORGE_WINDOW_TEST=run{os.getpid()}-{int(sig)}-{i}"
        env = dict(os.environ, SPARKFORGE_WINDOW_TEST=marker.partition("=")[2])
        python = subprocess.Popen([sys.executable, "-c", WINDOW, str(ROOT)], stdout=subprocess.PIPE, env=env)
        try:
            assert python.stdout is not None and python.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0, 0.004))  # about as long as a fork and exec take
            python.send_signal(sig)
            python.wait(timeout=60)
        finally:
            if python.poll() is None:
                python.kill()
                python.wait()
            python.stdout.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while (left := marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [], f"run {i}: {len(left)} processes left after the signal"
