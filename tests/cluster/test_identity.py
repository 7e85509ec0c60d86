"""The rule "this node has the head's image", on real `docker image inspect` output of both stores.

The fixtures were taken from Docker 26.1 engines here: a classic-store engine and a containerd-store
engine (`features: {containerd-snapshotter: true}`), with one image pushed to a registry, pulled by
both and `docker save | docker load`ed into the containerd one, and a second image with the same
layers and another config (a LABEL only). Pure logic: no engine is needed to run these.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from sparkforge.distribute.images import ImageIdentity, NodeImage, same_image
from sparkforge.distribute.stream import TarIndex

FIXTURES = Path(__file__).parent / "fixtures"


def inspect(name: str) -> NodeImage:
    return NodeImage.from_inspect(json.loads((FIXTURES / f"inspect-{name}.json").read_text())[0])


def saved_manifest() -> str:
    return json.loads((FIXTURES / "save-index.json").read_text())["manifests"][0]["digest"]


@pytest.fixture
def head() -> ImageIdentity:
    """The head (classic store) after its push: ID = config digest, RepoDigests = the pushed manifest."""
    own = inspect("classic-pulled")
    return ImageIdentity(own.id, own.digests | {own.id}, own.layers)


def test_the_stores_disagree_on_the_id_but_not_on_layers_or_the_pushed_manifest() -> None:
    classic, ctd = inspect("classic-pulled"), inspect("containerd-pulled")
    assert classic.id != ctd.id  # the defect: comparing .Id fails every containerd node
    assert classic.layers == ctd.layers
    assert ctd.id in classic.digests  # containerd's ID is the manifest digest the classic push recorded


def test_a_pulled_image_is_the_heads_on_both_stores(head) -> None:
    assert same_image(head, inspect("classic-pulled"))
    assert same_image(head, inspect("containerd-pulled"))


def test_a_loaded_image_on_containerd_needs_the_saved_manifest_recorded(head) -> None:
    loaded = inspect("containerd-loaded")
    assert loaded.layers == head.layers
    assert not same_image(head, loaded)  # same layers alone are not enough
    recorded = ImageIdentity(head.config, head.manifests | {saved_manifest()}, head.layers)
    assert loaded.id == saved_manifest()
    assert same_image(recorded, loaded)


def test_same_layers_with_another_config_is_another_image(head) -> None:
    for name in ("classic-label", "containerd-label"):
        other = inspect(name)
        assert other.layers == head.layers, name
        assert not same_image(head, other), name


def test_layers_must_match_in_order_even_when_an_id_matches(head) -> None:
    node = inspect("classic-pulled")
    assert not same_image(head, NodeImage(node.id, node.digests, node.layers + ("sha256:" + "0" * 64,)))
    assert not same_image(ImageIdentity(head.config, head.manifests, ()), node)


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("chunk", [1, 511, 512, 4096, 1 << 20])
def test_the_tar_index_is_caught_from_the_stream_in_any_chunking(chunk: int) -> None:
    index = (FIXTURES / "save-index.json").read_bytes()
    blob = bytes(range(256)) * 4000  # not a multiple of 512: padding is skipped right
    saved = json.dumps([{"Config": "blobs/sha256/" + "c" * 64, "RepoTags": ["x:1"],
                         "Layers": ["blobs/sha256/" + "a" * 64]}]).encode()
    stream = _tar([("blobs/", b""), ("blobs/sha256/" + "a" * 64, blob), ("index.json", index),
                   ("manifest.json", saved), ("oci-layout", b"{}")])
    sniff = TarIndex()
    for i in range(0, len(stream), chunk):
        sniff.feed(stream[i:i + chunk])
    assert sniff.manifest == saved_manifest()
    assert sniff.config == "sha256:" + "c" * 64  # what a classic-store node shows as the image ID
    assert sniff.ended


def test_a_member_whose_size_only_a_pax_header_gives_is_skipped_right() -> None:
    """Go's archive/tar (Docker's save) gives a member over 8 GiB its size in a PAX header and 0 in its
    own; made here with a small member, whose own size field is then zeroed as Go's would be."""
    blob_name = "blobs/sha256/" + "a" * 64
    blob = bytes(range(256)) * 3000
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, pax in (("blobs/", b"", {}), (blob_name, blob, {"size": str(len(blob))}),
                                ("index.json", (FIXTURES / "save-index.json").read_bytes(), {})):
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax
            tf.addfile(info, io.BytesIO(data))
    data = bytearray(buf.getvalue())
    at = next(i for i in range(0, len(data), 512) if data[i:i + len(blob_name) + 1] == blob_name.encode() + b"\0")
    assert data[at - 1024 + 156:at - 1024 + 157] == b"x"  # the PAX header and its one block of records
    data[at + 124:at + 136] = b"00000000000\0"
    sniff = TarIndex()
    for i in range(0, len(data), 4096):
        sniff.feed(bytes(data[i:i + 4096]))
    assert sniff.manifest == saved_manifest()


def test_a_tar_without_an_index_gives_no_manifest() -> None:
    sniff = TarIndex()
    sniff.feed(_tar([("manifest.json", b"[]")]))
    assert sniff.manifest is None
