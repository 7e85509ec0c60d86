"""A head on the containerd image store, the default of new Docker 29 installs, pushing what BuildKit
built there.

That store keeps a built layer as the blob BuildKit exported (sparkforge's builds export zstd there), and
`docker save` names each blob by its own digest, not by the layer's diff ID, and the image ID is a manifest
digest; a layer it loaded from a classic store's save stays uncompressed. An image is built on a real
containerd-store dockerd (the head's engine and version) with the exporter sparkforge's builds use, on a base
that came from a classic-store machine, pushed to a real registry with each compression, and pulled by the three
kinds of node a cluster has beside such a head: a classic-store node and a containerd-store node of the head's
version, and an older engine (Docker 26, classic store), each then holding the same image by the identity
`deploy` checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import pytest

from sparkforge.build import dockercli
from sparkforge.build.builder import INTO_ENGINE
from sparkforge.distribute import deploy, images, push, stream
from sparkforge.distribute.cluster import Node as ClusterNode
from sparkforge.distribute.cluster import Registry as RegistrySpec
from sparkforge.errors import DistributeError
from tests.support.needs import require

pytestmark = [pytest.mark.docker, pytest.mark.network, pytest.mark.root]

TAG, MOVING = "sparkforge-test/ctd-head:1", "sparkforge-test/ctd-head:latest"
NODES = ("classic", "ctd", "old")  # Docker 28.5 on each store, and Docker 26 (classic)
DOCKERFILE = """FROM {base}
RUN head -c 3000000 /dev/urandom > /blob && echo one > /one
RUN echo two > /two
"""


@pytest.fixture(scope="module")
def engines(base_image: str):
    """A containerd-store head with a BuildKit-built image, a classic-store node, a containerd-store node and an
    older engine's node (classic). The head gets its base from the classic node's `docker save`, as from another
    machine: a layer kept as it came (uncompressed) beside the ones BuildKit built (zstd, as sparkforge builds)."""
    require("dockerd")
    from tests.infra.nodes import CLASSIC, CONTAINERD, OLD_DOCKERD, start_nodes

    require("old-dockerd")

    where = tempfile.mkdtemp(prefix="sfh-", dir="/tmp")  # short: unix socket paths max 107 bytes
    started = []
    try:
        head, ctd = start_nodes(2, f"{where}/c", CONTAINERD, prefix="c")
        started += [head, ctd]
        (classic,) = start_nodes(1, f"{where}/k", CLASSIC, prefix="k")
        started.append(classic)
        (old,) = start_nodes(1, f"{where}/o", CLASSIC, prefix="o", dockerd=OLD_DOCKERD)
        started.append(old)
        for source, target in (("docker", classic.endpoint), (f"docker -H {classic.endpoint}", head.endpoint)):
            save = subprocess.Popen([*source.split(), "save", base_image], stdout=subprocess.PIPE)
            load = subprocess.run(["docker", "-H", target, "load", "-q"], stdin=save.stdout, capture_output=True,
                                  timeout=600)
            assert save.wait() == 0 and load.returncode == 0, load.stderr
        ctx = Path(where) / "ctx"
        ctx.mkdir()
        (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base_image))
        built = subprocess.run(["docker", "-H", head.endpoint, "buildx", "build", "--network", "host", "--output",
                                INTO_ENGINE, "--provenance=false", "--tag", TAG, "--tag", MOVING, str(ctx)],
                               capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stderr[-2000:]
        yield {"head": head, "classic": classic, "ctd": ctd, "old": old}
    finally:
        for node in started:
            with contextlib.suppress(Exception):  # every node is destroyed, whatever one of them does
                node.destroy()
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture()
def on_head(engines, monkeypatch):
    """The head's docker CLI is the containerd-store engine's, as on a Docker 29 machine."""
    monkeypatch.setenv("DOCKER_HOST", engines["head"].endpoint)
    return engines["head"]


def test_the_head_keeps_built_layers_compressed_and_saves_them_under_their_own_digests(on_head) -> None:
    image = images.image_on_head(TAG, MOVING)
    assert image is not None
    saved = subprocess.run(["docker", "save", TAG], capture_output=True, timeout=300).stdout
    with tarfile.open(fileobj=io.BytesIO(saved)) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        names = [name.rpartition("/")[2] for name in manifest[0]["Layers"]]
        heads = {n: tar.extractfile(f"blobs/sha256/{n}").read(4) for n in names}  # type: ignore[union-attr]
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        digest = index["manifests"][0]["digest"].partition(":")[2]
        layers = json.loads(tar.extractfile(f"blobs/sha256/{digest}").read())["layers"]  # type: ignore[union-attr]
    # The two built layers: zstd frames under the OCI media type, named by their compressed digest, so not by a
    # diff ID; the base's layer as it came.
    assert [heads[n] == b"\x28\xb5\x2f\xfd" for n in names] == [False, True, True]
    assert [layer["mediaType"] for layer in layers] == ["application/vnd.oci.image.layer.v1.tar"] + \
        ["application/vnd.oci.image.layer.v1.tar+zstd"] * 2, layers
    assert [f"sha256:{n}" in image.identity.layers for n in names] == [True, False, False]
    assert image.image_id != image.identity.layers[0]


@pytest.mark.parametrize("compression", ["zstd", "none", "gzip", None])
def test_push_from_a_containerd_head_deploys_to_both_stores(compression: str | None, engines, on_head, registry,
                                                             tmp_path: Path) -> None:
    """Each compression, and push's default (None): on this head, the engine's own push, which says so."""
    state = tmp_path / "state"
    head_image, where, said = images.image_on_head(TAG, MOVING, state), RegistrySpec(registry.address, ""), []
    if compression is None:
        pushed = push.push_by_default(head_image, where, said.append, state_dir=state)
        assert said == [f"route: {push.default_route(dockercli.ImageStore(True, 'overlayfs'))[1]} "
                        "(`--compression` chooses another)"], said
        assert said[0].startswith("route: the engine's own push")
    else:
        pushed = push.push_to(head_image, where, compression, state_dir=state)
    assert pushed.digest and pushed.layers_pushed + pushed.layers_present == 3, pushed
    assert pushed.layers_pushed == 0 or pushed.bytes_pushed > 0, pushed  # the layers sent have their sizes
    # The engine's push names the image after the registry only while it runs: the head keeps no such tag.
    names = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                           text=True, timeout=120).stdout.split()
    assert not [n for n in names if n.startswith(f"{registry.address}/")], names
    image = images.image_on_head(TAG, MOVING, state)
    assert pushed.digest in image.identity.manifests
    for name in NODES:
        node = engines[name]
        for ref in (TAG, MOVING):
            node.docker("rmi", "-f", f"{registry.address}/{ref}", ref, check=False)
        node.docker("image", "prune", "-af", check=False)
    result = deploy.deploy_registry(image, [ClusterNode(n, engines[n].endpoint) for n in NODES], registry.address)
    assert result.ok, result
    for name in NODES:
        node = engines[name]
        seen = images.NodeImage.from_inspect(json.loads(node.docker("image", "inspect", MOVING).stdout)[0])
        assert images.same_image(image.identity, seen), (name, seen)
        run = node.docker("run", "--rm", "--network", "none", MOVING, "cat", "/one", "/two")
        assert run.stdout.split() == [b"one", b"two"], (name, run.stderr)


def test_a_classic_head_pushes_zstd_by_blobs_by_default(engines, base_image: str, registry, monkeypatch,
                                                        tmp_path: Path) -> None:
    """push's default on a classic-store head (the store of every Docker before 29): zstd on every core, by
    blobs, and it says so; the registry then holds zstd layers under the immutable and the moving tag. The
    image is the base, loaded into the classic engine again (a deploy test above may have pruned it there),
    under the two tags."""
    classic = engines["classic"]
    tag, moving = "sparkforge-test/classic-head:1", "sparkforge-test/classic-head:latest"
    save = subprocess.Popen(["docker", "save", base_image], stdout=subprocess.PIPE)
    load = subprocess.run(["docker", "-H", classic.endpoint, "load", "-q"], stdin=save.stdout, capture_output=True,
                          timeout=600)
    assert save.wait() == 0 and load.returncode == 0, load.stderr
    for ref in (tag, moving):
        tagged = subprocess.run(["docker", "-H", classic.endpoint, "tag", base_image, ref], capture_output=True,
                                text=True, timeout=120)
        assert tagged.returncode == 0, tagged.stderr
    monkeypatch.setenv("DOCKER_HOST", classic.endpoint)
    assert not dockercli.image_store().containerd
    said: list[str] = []
    pushed = push.push_by_default(images.image_on_head(tag, moving, tmp_path), RegistrySpec(registry.address, ""),
                                  said.append, state_dir=tmp_path)
    assert said == ["route: layers zstd-compressed on every core, by blobs: this engine's classic store keeps them "
                    "unpacked (`--compression` chooses another)"], said
    assert pushed.digest and pushed.layers_pushed + pushed.layers_present == 1, pushed  # one: the base's layer
    request = urllib.request.Request(f"http://{registry.address}/v2/sparkforge-test/classic-head/manifests/1",
                                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        layers = json.load(resp)["layers"]
    assert {layer["mediaType"] for layer in layers} == {push.LAYER_TYPES["zstd"]}, layers
    assert registry.has_tag("sparkforge-test/classic-head", "latest")


def test_the_engines_push_to_a_registry_that_is_not_there_is_one_line(on_head, tmp_path: Path) -> None:
    """`push --compression gzip` is `docker push`: its failure is the CLI's own last line, naming the cause."""
    with pytest.raises(DistributeError) as caught:
        push.push_to(images.image_on_head(TAG, MOVING, tmp_path), RegistrySpec("127.0.0.1:9", ""), "gzip",
                     state_dir=tmp_path)
    assert caught.value.field == "--registry"
    assert caught.value.detail.startswith(f"push of 127.0.0.1:9/{TAG} failed: "), caught.value.detail
    assert "connection refused" in caught.value.detail and "\n" not in caught.value.detail, caught.value.detail


def test_stream_from_a_containerd_head_loads_on_every_kind_of_node(engines, on_head, tmp_path: Path) -> None:
    targets = [ClusterNode(n, engines[n].endpoint) for n in NODES]
    for name in NODES:
        for ref in (TAG, MOVING):
            engines[name].docker("rmi", "-f", ref, check=False)
        engines[name].docker("image", "prune", "-af", check=False)
    result = stream.deploy_stream(images.image_on_head(TAG, MOVING, tmp_path), targets, state_dir=tmp_path)
    assert result.ok, result
    image = images.image_on_head(TAG, MOVING, tmp_path)  # with the manifest digest recorded at save
    for name in NODES:
        seen = images.NodeImage.from_inspect(json.loads(engines[name].docker("image", "inspect", MOVING).stdout)[0])
        assert images.same_image(image.identity, seen), (name, seen)
