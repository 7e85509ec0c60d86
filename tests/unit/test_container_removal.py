"""dockercli.remove_container: a container is believed gone only when the engine no longer finds it, and a
refusal (a loaded engine's "did not receive an exit event") is tried again within a bound, then said.

`docker` here is a script on PATH that answers as the real CLI does, refusing `rm -f` a given number of
times first; the real removal is walked by the serve tests (tests/docker/test_serve.py)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

from sparkforge.build import dockercli

REFUSAL = ("Error response from daemon: cannot remove container \"/sparkforge-serve-1-2\": could not kill: "
           "tried to kill container, but did not receive an exit event")


def fake_docker(tmp_path: Path, monkeypatch, refusals: int, *, lies: bool = False) -> Path:
    """A docker whose `rm -f` fails `refusals` times, then removes (or, with lies, says so and does not)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    gone = tmp_path / "gone"
    script = bin_dir / "docker"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
case "$1" in
  version) echo 28.5.2 amd64; exit 0 ;;
  rm) n=$(grep -c '^rm ' {calls})
      if [ "$n" -le {refusals} ]; then echo '{REFUSAL}' >&2; exit 1; fi
      {':' if lies else f'touch {gone}'}; echo "$3"; exit 0 ;;
  container) if [ -e {gone} ]; then echo "Error: No such container: $5" >&2; exit 1; fi
      echo running; exit 0 ;;
esac
exit 3
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")  # an engine of the fake's own: it answers `version`
    return calls


def test_a_refused_removal_is_tried_again_until_the_container_is_gone(tmp_path: Path, monkeypatch) -> None:
    calls = fake_docker(tmp_path, monkeypatch, refusals=2)
    assert dockercli.remove_container("sparkforge-serve-1-2", within=30, pause=0.05) is None
    # (the engine check's `version` comes first, once per process)
    assert [w for line in calls.read_text().splitlines() if (w := line.split()[0]) != "version"] == \
        ["rm", "rm", "rm", "container"]


def test_a_removal_that_keeps_failing_is_said_after_the_bound(tmp_path: Path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, refusals=10**6)
    start = time.monotonic()
    said = dockercli.remove_container("sparkforge-serve-1-2", within=0.5, pause=0.05)
    assert said == REFUSAL
    assert time.monotonic() - start < 10


def test_an_rm_that_says_done_is_not_believed_while_the_engine_still_has_it(tmp_path: Path, monkeypatch) -> None:
    calls = fake_docker(tmp_path, monkeypatch, refusals=0, lies=True)
    # a bound that leaves room for two rounds of the fake on a loaded machine (each round starts two shells)
    said = dockercli.remove_container("sparkforge-serve-1-2", within=3, pause=0.05)
    assert said == "still there after docker rm -f (running)"
    assert calls.read_text().count("container inspect") >= 2  # asked again after each rm
