"""Reproducibility check: build a plan twice with --no-cache and rewrite-timestamp, compare the images bit for bit.

The manifest digest decides; when the two differ, both exported tarballs name the layers and files. dockerd's
builder on the classic image store ignores rewrite-timestamp: refused, never reported as "not reproducible".
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path
from collections.abc import Callable, Iterator

from ..imageref import is_attestation
from ..build import dockercli
from ..build.builder import BuildOptions, Step, build_image
from ..build.render import Context
from ..distribute.nodes import cli_env  # never the user's current context: `host`, or the default engine
from ..errors import SparkforgeError
from ..inimage.contract import parse_json
from ..recipe.plan import Plan


class ReproError(SparkforgeError):
    """The reproducibility check cannot give a true answer here (engine, base image, export)."""


@dataclass(frozen=True)
class ImageDigests:
    """What identifies one exported image: its manifest, its config (the image ID) and its layers."""

    tarball: Path
    manifest: str
    config: str
    layers: tuple[str, ...]
    steps: tuple[str, ...]  # the Dockerfile step that made each layer (from the config's history)


@dataclass(frozen=True)
class FileDiff:
    path: str
    what: tuple[str, ...]  # content, mode, owner, mtime, type, link, only in build 1/2


@dataclass(frozen=True)
class LayerDiff:
    index: int  # 1-based
    step: str
    first: str
    second: str
    files: tuple[FileDiff, ...]


@dataclass(frozen=True)
class ReproResult:
    plan: Plan
    first: ImageDigests
    second: ImageDigests
    config_fields: tuple[str, ...]  # keys of the image config that differ
    layers: tuple[LayerDiff, ...]

    @property
    def identical(self) -> bool:
        return self.first.manifest == self.second.manifest


def check_engine(host: str | None) -> str:
    """Refuse, in one line, an engine whose builder cannot export reproducibly; else describe it."""
    where = host or "the default Docker engine"
    try:
        store = dockercli.image_store(host, env=cli_env())
    except dockercli.EngineError as exc:
        raise ReproError(f"{where} does not answer: {exc.detail}", field="--builder-host") from None
    if not store.containerd:
        raise ReproError(
            f"{where} keeps images in the classic store ({store.driver}): its builder ignores rewrite-timestamp and "
            "cannot export to a file, so two builds would differ whatever the recipe; pass --builder-host "
            "unix:///PATH/docker.sock of a dockerd with the containerd image store "
            '({"features": {"containerd-snapshotter": true}} in its daemon.json)', field="--builder-host")
    return f"{where} (containerd image store, {store.driver})"


def ensure_base(plan: Plan, host: str | None, progress: Callable[[str], None] = lambda _: None) -> None:
    """Copy the plan's base image from the default engine to the build engine when that lacks it and BuildKit
    cannot pull it (it is pinned by no digest)."""
    if host is None or plan.base.digest.value:
        return
    ref = plan.base.ref
    if dockercli.inspect_images(ref, host=host, env=cli_env())[ref] is not None:
        return
    if dockercli.inspect_images(ref, env=cli_env())[ref] is None:
        raise ReproError(f"base image {ref} is neither on {host} nor in the default engine; pull or build it first",
                         field="base")
    progress(f"copying base image {ref} to {host}")
    save = dockercli.start(["save", ref], stdout=subprocess.PIPE, env=cli_env())
    try:
        load = dockercli.run(["load"], host=host, env=cli_env(), timeout=dockercli.LONG, check=False,
                             stdin=save.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        if save.stdout:
            save.stdout.close()
    if dockercli.finish(save, timeout=dockercli.LONG) != 0 or load.returncode != 0:
        raise ReproError(f"could not copy {ref} to {host}: {load.stderr.strip()[-200:]}", field="base")


def _blob(tf: tarfile.TarFile, digest: str) -> bytes:
    member = tf.extractfile(f"blobs/{digest.replace(':', '/')}")
    if member is None:
        raise ReproError(f"blob {digest} missing from the exported tarball",
                         path=None if tf.name is None else os.fsdecode(tf.name))
    return member.read()


def read_digests(tarball: Path) -> ImageDigests:
    """The manifest, config and layer digests of a single-image OCI/Docker tarball from buildx."""
    try:
        with tarfile.open(tarball) as tf:
            # An index.json that is no regular file gives None, whose AttributeError is caught below.
            index = parse_json(tf.extractfile("index.json").read())  # type: ignore[union-attr]
            desc = index["manifests"][0]
            manifest = parse_json(_blob(tf, desc["digest"]))
            if "manifests" in manifest:  # an index: its image manifest, not an attestation beside it
                desc = next(m for m in manifest["manifests"] if not is_attestation(m))
                manifest = parse_json(_blob(tf, desc["digest"]))
            config = parse_json(_blob(tf, manifest["config"]["digest"]))
    except (OSError, tarfile.TarError, KeyError, ValueError, AttributeError, StopIteration) as exc:
        raise ReproError(f"not an image tarball from buildx: {exc}", path=tarball) from None
    steps = [h.get("created_by", "") for h in config.get("history", []) if not h.get("empty_layer")]
    layers = tuple(layer["digest"] for layer in manifest["layers"])
    steps += [""] * (len(layers) - len(steps))
    return ImageDigests(tarball, desc["digest"], manifest["config"]["digest"], layers,
                        tuple(_short_step(s) for s in steps[:len(layers)]))


def _short_step(created_by: str) -> str:
    text = " ".join(created_by.split())
    for prefix in ("RUN /bin/bash -euo pipefail -c ", "/bin/bash -euo pipefail -c ", "|0 ", "|1 "):
        text = text.removeprefix(prefix)
    return text if len(text) <= 90 else text[:87] + "..."


# A file of a layer: (type, mode, (uid, gid), mtime, link, sha256 of content).
_Entry = tuple[bytes, int, tuple[int, int], int, str, str]


def _layer_entries(tf: tarfile.TarFile, digest: str) -> dict[str, _Entry]:
    """path -> _Entry of each file of one layer blob."""
    member = tf.extractfile(f"blobs/{digest.replace(':', '/')}")
    if member is None:
        return {}
    entries: dict[str, _Entry] = {}
    with tarfile.open(fileobj=member, mode="r|*") as layer:
        for info in layer:
            content = ""
            if info.isfile():
                f = layer.extractfile(info)
                content = hashlib.sha256(f.read() if f else b"").hexdigest()
            entries[info.name] = (info.type, info.mode, (info.uid, info.gid), int(info.mtime), info.linkname, content)
    return entries


_ATTRS = ("type", "mode", "owner", "mtime", "link", "content")


def _config_fields(a: object, b: object, where: str = "") -> Iterator[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from _config_fields(a.get(key), b.get(key), f"{where}.{key}" if where else key)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _config_fields(x, y, f"{where}[{i}]")
    elif a != b:
        yield where


def compare(first: ImageDigests, second: ImageDigests) -> tuple[tuple[str, ...], tuple[LayerDiff, ...]]:
    """What differs between two exported images: config fields, and per layer the files."""
    with tarfile.open(first.tarball) as ta, tarfile.open(second.tarball) as tb:
        cfg = tuple(_config_fields(parse_json(_blob(ta, first.config)), parse_json(_blob(tb, second.config))))
        diffs = []
        pairs = zip_longest(zip(first.layers, first.steps), zip(second.layers, second.steps), fillvalue=("", ""))
        for i, ((la, step_a), (lb, step_b)) in enumerate(pairs):
            if la == lb:
                continue
            ea = _layer_entries(ta, la) if la else {}
            eb = _layer_entries(tb, lb) if lb else {}
            files = []
            for path in sorted(set(ea) | set(eb)):
                if path not in ea or path not in eb:
                    files.append(FileDiff(path, ("only in build 2" if path not in ea else "only in build 1",)))
                elif ea[path] != eb[path]:
                    files.append(FileDiff(path, tuple(n for n, x, y in zip(_ATTRS, ea[path], eb[path]) if x != y)))
            diffs.append(LayerDiff(i + 1, step_a or step_b, la, lb, tuple(files)))
    return cfg, tuple(diffs)


def verify_repro(plan: Plan, context: Context, opts: BuildOptions, workdir: Path,
                 progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                 say: Callable[[str], None] = lambda _: None) -> ReproResult:
    """Build the plan twice with --no-cache, export both with rewrite-timestamp, and compare."""
    if opts.source_date_epoch is None:
        raise ReproError("a reproducible build needs a SOURCE_DATE_EPOCH (from the lock, or --source-date-epoch)",
                         field="source_date_epoch")
    say(f"build engine: {check_engine(opts.docker_host)}")
    ensure_base(plan, opts.docker_host, say)
    workdir.mkdir(parents=True, exist_ok=True)
    images = []
    for n in (1, 2):
        tarball = workdir / f"build-{n}.tar"
        tarball.unlink(missing_ok=True)
        run = replace(opts, no_cache=True, log_dir=workdir,
                      output=f"type=docker,dest={tarball},name={plan.tag},rewrite-timestamp=true,compression=uncompressed,force-compression=true")
        say(f"build {n} of 2 (--no-cache) -> {tarball}")
        build_image(plan, context, run, progress=progress)
        if not tarball.is_file():
            raise ReproError(f"the build wrote no tarball to {tarball}", field="--builder-host")
        images.append(read_digests(tarball))
    first, second = images
    cfg, layers = ((), ()) if first.manifest == second.manifest else compare(first, second)
    return ReproResult(plan, first, second, cfg, layers)
