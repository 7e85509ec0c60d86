"""How a push by blobs reads a saved image: the config and the layer order from manifest.json, checked
against the diff IDs the head's engine reports (pure logic; the real stores are in
tests/docker/test_containerd_head.py and tests/docker/test_distribute.py)."""

from __future__ import annotations

import json

import pytest

from sparkforge.distribute.images import HeadImage, ImageIdentity
from sparkforge.errors import DistributeError
from sparkforge.distribute.push import LAYER_TYPES, STORED_TYPES, Layer, saved_image, stored_compression

D1, D2 = "1" * 64, "2" * 64  # diff IDs (uncompressed digests)
G2 = "9" * 64  # the gzip blob of the second layer, as the containerd store keeps it
CONFIG = json.dumps({"rootfs": {"type": "layers", "diff_ids": [f"sha256:{D1}", f"sha256:{D2}"]}}).encode()
IMAGE = HeadImage("r/x:1", "r/x:latest", "sha256:" + "c" * 64, 0,
                  ImageIdentity(None, frozenset(), (f"sha256:{D1}", f"sha256:{D2}")))


def saved(layers: object, config: object = "blobs/sha256/" + "c" * 64) -> bytes:
    return json.dumps([{"Config": config, "RepoTags": ["r/x:1"], "Layers": layers}]).encode()


def zstd(hexname: str) -> Layer:
    return Layer("sha256:" + hexname[::-1], 10, LAYER_TYPES["zstd"])


def test_classic_store_layers_are_their_diff_ids_in_order() -> None:
    layers = {D1: zstd(D1), D2: zstd(D2)}
    config, order = saved_image(IMAGE, saved([f"blobs/sha256/{D1}", f"blobs/sha256/{D2}"]), {"c" * 64: CONFIG},
                                 layers)
    assert config == CONFIG and order == [layers[D1], layers[D2]]


def test_containerd_store_gzip_layers_go_as_they_are_kept() -> None:
    stored = Layer(f"sha256:{G2}", 7, STORED_TYPES["gzip"], as_stored=True)
    _, order = saved_image(IMAGE, saved([f"blobs/sha256/{D1}", f"blobs/sha256/{G2}"]), {"c" * 64: CONFIG},
                            {D1: zstd(D1), G2: stored})
    assert order[1] is stored and order[1].media_type.endswith("+gzip")


@pytest.mark.parametrize("manifest, why", [
    (saved([]), "its layers differ"),
    (saved(None), "not the one of a saved image"),
    (saved([f"blobs/sha256/{D2}", f"blobs/sha256/{D1}"]), "stands where the engine reports"),
    (saved([f"blobs/sha256/{D1}", f"blobs/sha256/{'5' * 64}"]), "is not in the saved image"),
    (saved([f"blobs/sha256/{D1}", f"blobs/sha256/{D2}"], config="blobs/sha256/" + "e" * 64), "the config"),
    (b"{}", "not the one of a saved image"),
])
def test_a_saved_image_that_does_not_match_the_engine_is_refused_in_one_line(manifest: bytes, why: str) -> None:
    with pytest.raises(DistributeError, match=why):
        saved_image(IMAGE, manifest, {"c" * 64: CONFIG}, {D1: zstd(D1), D2: zstd(D2)})


def test_stored_compression_by_magic_number() -> None:
    assert stored_compression(b"\x1f\x8b\x08\x00") == "gzip"
    assert stored_compression(b"\x28\xb5\x2f\xfd") == "zstd"
    assert stored_compression(b"{\"ar") is None and stored_compression(b"bin/") is None


def test_the_image_of_a_save_is_the_named_entry_of_its_index_not_its_referrers() -> None:
    from sparkforge.distribute.stream import saved_image_digest

    image = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": "sha256:" + "a" * 64,
             "annotations": {"io.containerd.image.name": "docker.io/r/x:1", "org.opencontainers.image.ref.name": "1"}}
    # From Docker 29.1 a save carries the image's signatures and attestations as more entries, without a name.
    signature = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + "b" * 64,
                 "artifactType": "application/vnd.dev.sigstore.bundle.v0.3+json"}
    assert saved_image_digest({"manifests": [image, signature]}) == image["digest"]
    assert saved_image_digest({"manifests": [image]}) == image["digest"]
    assert saved_image_digest({"manifests": [dict(image, annotations={})]}) == image["digest"]  # an older save
    assert saved_image_digest({"manifests": [image, dict(image, digest="sha256:" + "c" * 64)]}) is None  # two images
    assert saved_image_digest({"manifests": "x"}) is None
