"""How a `docker image inspect` answer is read, on a node and on the head: every reference found or named
missing is a whole answer, whatever else a node's shell printed; anything less is one line naming what went
wrong.

`docker` here is a script on PATH that answers as the real CLI does (JSON of what it found on stdout, one
"No such image" line per missing reference on stderr, exit 1 when one is missing).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from sparkforge.build import dockercli
from sparkforge.distribute.cluster import Node
from sparkforge.distribute.nodes import NodeFailure
from sparkforge.distribute.images import inspect

FOUND = {"Id": "sha256:" + "a" * 64, "RepoTags": ["repo/x:v"], "RepoDigests": [], "RootFS": {"Layers": []}}
NOISE = "rm: cannot remove '/root/.pyenv/shims/tmp.x': No such file or directory"  # a login script, seen on a node


def fake_docker(tmp_path: Path, monkeypatch, stdout: str, stderr: str, code: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "out").write_text(stdout)
    (tmp_path / "err").write_text(stderr)
    script = bin_dir / "docker"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = version ] && echo 28.5.2 && exit 0\n"  # the engine check
                      f"cat {tmp_path / 'out'}\ncat {tmp_path / 'err'} >&2\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    # An engine over TCP, which the fake ignores: it answers the engine check (`docker version`) itself.
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")


NODE = Node("n1", "tcp://10.0.0.1:2375")


def test_one_found_one_missing_and_shell_noise_is_a_whole_answer(tmp_path: Path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, json.dumps([FOUND]),
                f"{NOISE}\nError response from daemon: No such image: repo/x:new\n", 1)
    seen = inspect(NODE, "repo/x:v", "repo/x:new")
    assert seen["repo/x:new"] is None and seen["repo/x:v"].id == FOUND["Id"]


def test_both_missing_with_noise_is_a_whole_answer(tmp_path: Path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, "[]", f"{NOISE}\nError: No such image: repo/x:v\n"
                "Error: No such image: repo/x:new\n", 1)
    assert inspect(NODE, "repo/x:v", "repo/x:new") == {"repo/x:v": None, "repo/x:new": None}


def test_an_answer_that_misses_a_reference_names_the_line_that_says_why(tmp_path: Path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, "[]", "Error response from daemon: No such image: repo/x:new\n"
                "Error response from daemon: invalid reference format: repository name must be lowercase\n", 1)
    with pytest.raises(NodeFailure) as err:
        inspect(NODE, "repo/x:v", "repo/x:new")
    assert str(err.value).endswith("failed: Error response from daemon: invalid reference format: repository name "
                                   "must be lowercase")


def test_the_head_maps_each_reference_to_its_image_or_none(tmp_path: Path, monkeypatch) -> None:
    other = dict(FOUND, Id="sha256:" + "b" * 64, RepoTags=["repo/x:w"], RepoDigests=["repo/x@sha256:" + "c" * 64])
    fake_docker(tmp_path, monkeypatch, json.dumps([FOUND, other]), "Error: No such image: repo/x:new\n", 1)
    seen = dockercli.inspect_images("repo/x:v", "repo/x:new", "repo/x@sha256:" + "c" * 64)
    assert seen == {"repo/x:v": FOUND, "repo/x:new": None, "repo/x@sha256:" + "c" * 64: other}


def test_the_head_engine_refusing_is_one_line_naming_the_call(tmp_path: Path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, "", "permission denied while trying to connect to the Docker daemon socket\n", 1)
    with pytest.raises(dockercli.EngineError) as err:
        dockercli.inspect_images("repo/x:v")
    assert err.value.field == "docker image inspect" and "permission denied" in str(err.value)


def test_head_and_node_read_a_not_found_line_alike(tmp_path: Path, monkeypatch) -> None:
    """One reader for both: a missing reference said as "not found" is missing on the head too."""
    fake_docker(tmp_path, monkeypatch, json.dumps([FOUND]),
                f"{NOISE}\nError response from daemon: image repo/x:new not found\n", 1)
    assert dockercli.inspect_images("repo/x:v", "repo/x:new") == {"repo/x:v": FOUND, "repo/x:new": None}
    assert inspect(NODE, "repo/x:v", "repo/x:new")["repo/x:new"] is None


@pytest.mark.parametrize("stdout", ['{"Id": "x"}', "[1]", "not json", '[{"RepoTags": []}]'])
def test_an_answer_that_is_no_list_of_images_is_one_line(stdout: str, tmp_path: Path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, stdout, "", 0)
    with pytest.raises(NodeFailure, match="^inspect of repo/x:v failed: "):
        inspect(NODE, "repo/x:v")
    if stdout != '[{"RepoTags": []}]':  # the head reads only what it is asked for; an ID is not one
        with pytest.raises(dockercli.EngineError):
            dockercli.inspect_images("repo/x:v")
