"""push without --compression: the route by the head's image store, and the blob push where the engine's own
push fails. The pushes themselves run for real in tests/docker/test_containerd_head.py (a containerd-store
head and a classic-store one) and tests/docker/test_distribute.py (the command line); here, the choice alone."""

from __future__ import annotations

from typing import Any

import pytest

from sparkforge.build.dockercli import ImageStore
from sparkforge.distribute import push
from sparkforge.distribute.cluster import Registry
from sparkforge.errors import DistributeError

WHERE = Registry("10.0.0.1:5000", "10.0.0.1:5000")
IMAGE: Any = object()  # passed through to the push, never read here


def test_each_store_has_its_route() -> None:
    assert push.default_route(ImageStore(True, "overlayfs"))[0] == "gzip"
    assert push.default_route(ImageStore(False, "overlay2"))[0] == "zstd"


@pytest.fixture()
def pushes(monkeypatch) -> list[tuple[str, str]]:
    """The pushes asked for, in order: (route, compression); the engine's own push refuses, as an engine that
    does not trust the registry's CA does."""
    asked: list[tuple[str, str]] = []

    def engine(*args: Any) -> Any:
        asked.append(("engine", "gzip"))
        raise DistributeError("push of 10.0.0.1:5000/x:1 failed: tls: failed to verify certificate: x509: "
                              "certificate signed by unknown authority", field="--registry")

    def blobs(image: Any, registry: Registry, compression: str, *args: Any) -> str:
        asked.append(("blobs", compression))
        return "pushed"

    monkeypatch.setattr(push, "push_image", engine)
    monkeypatch.setattr(push, "push_blobs", blobs)
    return asked


def test_a_containerd_head_whose_engine_refuses_pushes_by_blobs_and_says_why(pushes, monkeypatch) -> None:
    monkeypatch.setattr(push.dockercli, "image_store", lambda: ImageStore(True, "overlayfs"))
    said: list[str] = []
    assert push.push_by_default(IMAGE, WHERE, said.append) == "pushed"
    assert pushes == [("engine", "gzip"), ("blobs", "zstd")]
    assert said[0].startswith("route: the engine's own push") and len(said) == 2
    assert "x509: certificate signed by unknown authority" in said[1] and "pushing by blobs instead" in said[1]


def test_a_classic_head_pushes_by_blobs_at_once(pushes, monkeypatch) -> None:
    monkeypatch.setattr(push.dockercli, "image_store", lambda: ImageStore(False, "overlay2"))
    said: list[str] = []
    assert push.push_by_default(IMAGE, WHERE, said.append) == "pushed"
    assert pushes == [("blobs", "zstd")] and len(said) == 1 and "zstd" in said[0]


def test_ctrl_c_during_the_engines_push_is_not_taken_for_a_refusal(monkeypatch) -> None:
    def engine(*args: Any) -> Any:
        raise KeyboardInterrupt

    def blobs(*args: Any) -> Any:
        raise AssertionError("the blob push must not start after Ctrl-C")

    monkeypatch.setattr(push.dockercli, "image_store", lambda: ImageStore(True, "overlayfs"))
    monkeypatch.setattr(push, "push_image", engine)
    monkeypatch.setattr(push, "push_blobs", blobs)
    with pytest.raises(KeyboardInterrupt):
        push.push_by_default(IMAGE, WHERE, lambda line: None)
