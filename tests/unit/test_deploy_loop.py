"""The deploy loop over nodes whose engines do not answer (real docker CLI, no engine): every node
fails alone with its own line, each transfer hears of every node once, and nothing waits forever."""

from __future__ import annotations

import threading
from pathlib import Path

from sparkforge.distribute import deploy, images, stream
from sparkforge.distribute.cluster import Node
from tests.support.limits import ended

IMAGE = images.HeadImage("sparkforge/vllm:loop-0123456789ab", "sparkforge/vllm:loop", "sha256:" + "a" * 64, 1,
                         images.ImageIdentity("sha256:" + "a" * 64, frozenset(), ("sha256:" + "b" * 64,)))


def gone(tmp_path: Path, *names: str) -> list[Node]:
    return [Node(name, f"unix://{tmp_path / name}.sock") for name in names]


class Counting(deploy.RegistryPull):
    """A registry transfer that notes what the loop told it, and from which thread."""

    def __init__(self) -> None:
        super().__init__(IMAGE, "127.0.0.1:1")
        self.skipped: list[str] = []
        self.moved: list[str] = []
        self.serve_thread: threading.Thread | None = None

    def prepare(self, nodes: list[Node]) -> None:
        pass  # no registry to ask for layer sizes

    def skip(self, node: Node) -> None:
        self.skipped.append(node.name)

    def move(self, node: Node, run: deploy.NodeRun, progress: deploy.ProgressFn) -> None:
        self.moved.append(node.name)

    def serve(self, progress: deploy.ProgressFn) -> None:
        self.serve_thread = threading.current_thread()


def test_unanswered_checks_skip_each_node_once_and_serve_runs_on_the_calling_thread(tmp_path: Path) -> None:
    transfer = Counting()
    seen: list[deploy.Progress] = []
    result = deploy.deploy_all(gone(tmp_path, "n1", "n2", "n3"), transfer, seen.append, tmp_path)
    assert sorted(transfer.skipped) == ["n1", "n2", "n3"] and transfer.moved == []
    assert transfer.serve_thread is threading.current_thread()
    assert [r.node.name for r in result.results] == ["n1", "n2", "n3"]  # in node order
    for r in result.results:
        assert r.outcome is deploy.Outcome.FAILED and r.outcome == "failed"
        assert r.error and r.error.startswith(f"unreachable at unix://{tmp_path}"), r.error
        assert r.bytes_moved == 0 and r.previous_id is None and r.image_id is None
    assert not result.ok and result.mode == "registry" and result.source == "127.0.0.1:1/" + IMAGE.tag
    failed = [p for p in seen if p.phase == "failed"]
    assert sorted(p.node for p in failed) == ["n1", "n2", "n3"] and all(p.detail for p in failed)
    assert images.read_state(tmp_path, IMAGE.repository)["deploys"] == {}  # a failed node is not recorded


def test_stream_to_unanswering_nodes_starts_no_stream_and_ends(tmp_path: Path) -> None:
    result, _ = ended(lambda: stream.deploy_stream(IMAGE, gone(tmp_path, "a", "b"), state_dir=tmp_path,
                                                   stall_timeout=5))
    assert type(result) is deploy.Deployment, result
    assert result.mode == "stream" and result.source == f"docker save {IMAGE.tag}"
    assert [(r.node.name, r.outcome) for r in result.results] == [("a", deploy.FAILED), ("b", deploy.FAILED)]
    # The head has no such image: had a stream started, its save would have failed the nodes instead.
    assert all(r.error and "unreachable at" in r.error for r in result.results), result.results


def test_outcomes_read_as_their_words() -> None:
    assert [f"{o}" for o in deploy.Outcome] == ["updated", "current", "failed"]
    assert {"updated": 1}[deploy.UPDATED] == 1  # the views key their styles by the word


def test_a_dropped_stream_writer_waiting_for_data_ends_at_once() -> None:
    """A node dropped while its writer waits on an empty queue (the save failed, or another node cut it):
    the writer ends now, not after the stream's 10 s join per node."""
    import subprocess

    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    writer = stream._Writer(Node("n1", "unix:///nowhere.sock"), proc)
    writer.start()
    writer.drop("the save on the head failed")
    writer.join(2)
    assert not writer.is_alive() and writer.error == "the save on the head failed"
    proc.wait(5)
