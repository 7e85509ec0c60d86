"""How a deploy reads a node's answers: the architecture asked with the first inspect, and the tags set by the
manifest digest a pull printed. `docker` here is a script on PATH that answers as the real CLI does, for a
tcp:// node (over ssh the same commands run in one session; tests/cluster runs them there)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from sparkforge.distribute.cluster import Node
from sparkforge.distribute.deploy import verify_and_tag
from sparkforge.distribute.images import HeadImage, ImageIdentity, inspect
from sparkforge.distribute.nodes import NodeFailure

NODE = Node("spark2", "tcp://127.0.0.1:9")
LAYERS = ("sha256:" + "1" * 64,)
DIGEST = "sha256:" + "d" * 64
NODE_ID = "sha256:" + "e" * 64
IMAGE = HeadImage("sf/vllm:ng17e-0123456789ab", "sf/vllm:ng17e", "sha256:" + "c" * 64, 1,
                  ImageIdentity("sha256:" + "c" * 64, frozenset({DIGEST}), LAYERS), "arm64")


def fake_docker(tmp_path: Path, monkeypatch, *, arch: str = "arm64", version_fails: bool = False) -> Path:
    """A docker for one node: `version` gives arch (or fails, printing its format's text alone), `image inspect`
    knows the moving tag only, `tag` succeeds. Each call's arguments go to the file it returns."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    found = json.dumps([{"Id": NODE_ID, "RepoTags": [IMAGE.moving_tag], "RepoDigests": [], "RootFS": {"Layers": list(LAYERS)}}])
    version = ("echo 'engine-arch: '; echo 'Cannot reach the engine: the daemon is restarting' >&2; exit 1"
               if version_fails else f"echo 'engine-arch: {arch}'")
    script = bin_dir / "docker"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
shift 2
case "$1" in
  version) {version} ;;
  image) if [ "$3" = --format ]; then echo {NODE_ID}; exit 0; fi
         shift 2
         printf '%s\\n' '{found}'
         for ref in "$@"; do [ "$ref" = {IMAGE.moving_tag} ] || echo "Error response from daemon: No such image: $ref" >&2; done
         [ "$#" -eq 1 ] || exit 1 ;;
  tag) exit 0 ;;
  *) exit 3 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return calls


def test_the_first_inspect_asks_the_architecture_too_and_reads_both_answers(tmp_path, monkeypatch) -> None:
    calls = fake_docker(tmp_path, monkeypatch)
    found = inspect(NODE, IMAGE.moving_tag, IMAGE.tag, runs=IMAGE)
    assert found[IMAGE.tag] is None and found[IMAGE.moving_tag] is not None
    assert found[IMAGE.moving_tag].id == NODE_ID and found[IMAGE.moving_tag].layers == LAYERS
    assert [line.split()[2] for line in calls.read_text().splitlines()] == ["version", "image"]


def test_a_node_of_another_architecture_is_refused_before_anything_is_sent(tmp_path, monkeypatch) -> None:
    fake_docker(tmp_path, monkeypatch, arch="amd64")
    with pytest.raises(NodeFailure) as caught:
        inspect(NODE, IMAGE.moving_tag, IMAGE.tag, runs=IMAGE)
    assert str(caught.value) == (f"its engine runs amd64 images, and {IMAGE.tag} is built for linux/arm64; "
                                 "nothing was sent to it")


def test_an_engine_that_does_not_say_its_architecture_is_a_failed_version_not_an_empty_one(tmp_path,
                                                                                             monkeypatch) -> None:
    calls = fake_docker(tmp_path, monkeypatch, version_fails=True)
    with pytest.raises(NodeFailure) as caught:
        inspect(NODE, IMAGE.moving_tag, runs=IMAGE)
    assert str(caught.value) == "docker version failed: Cannot reach the engine: the daemon is restarting"
    assert len(calls.read_text().splitlines()) == 1  # the inspect never ran


def test_a_pulled_digest_the_head_pushed_is_tagged_by_digest_with_no_inspect_to_compare(tmp_path,
                                                                                         monkeypatch) -> None:
    calls = fake_docker(tmp_path, monkeypatch)
    ref = f"10.0.0.1:5443/{IMAGE.tag}"
    assert verify_and_tag(NODE, IMAGE, ref, DIGEST) == NODE_ID
    pulled = f"10.0.0.1:5443/sf/vllm@{DIGEST}"
    assert [line.split(" ", 2)[2] for line in calls.read_text().splitlines()] == [
        f"tag {pulled} {IMAGE.tag}", f"tag {pulled} {IMAGE.moving_tag}", f"image inspect --format {{{{.Id}}}} {pulled}"]


def test_a_digest_the_head_does_not_know_is_compared_before_the_tags_move(tmp_path, monkeypatch) -> None:
    calls = fake_docker(tmp_path, monkeypatch)
    with pytest.raises(NodeFailure) as caught:
        verify_and_tag(NODE, IMAGE, IMAGE.moving_tag, "sha256:" + "f" * 64)
    assert "not the head's image" in str(caught.value)  # the fake's image has another ID and no known digest
    assert [line.split()[2] for line in calls.read_text().splitlines()] == ["image"]  # no tag was set
