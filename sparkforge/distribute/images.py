"""Which image is where: an image's identity on every image store, the head's record and builds, a node's tags."""

from __future__ import annotations

import re
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from ..build import dockercli
from ..build.builder import BASE_LABEL
from ..errors import DistributeError, Hint
from ..files import read_regular, write_atomic
from ..imageref import ImageRef
from ..inimage.contract import JsonError, parse_json
from ..recipe.layout import PROJECT_ROOT
from ..recipe.plan import Plan
from ..recipe.fields import DIGEST_RE, REPOSITORY_RE, SHA256_RE, TAG_RE
from .cluster import Node
from .nodes import CONTROL_TIMEOUT, NodeFailure, one_line, run_dockers

STATE_DIR = PROJECT_ROOT / "build" / "distribute"


@dataclass(frozen=True)
class ImageIdentity:
    """What names one image on every image store: config digest, manifest digests, layer diff IDs."""

    config: str | None  # the config digest (the image ID on a classic-store engine)
    manifests: frozenset[str]  # manifest digests it is known by: registry pushes, docker save
    layers: tuple[str, ...]  # RootFS.Layers, in order


@dataclass(frozen=True)
class NodeImage:
    """One image as an engine's `docker image inspect` shows it."""

    id: str
    digests: frozenset[str]  # the digest part of each RepoDigests entry
    layers: tuple[str, ...]

    @classmethod
    def from_inspect(cls, data: dict[str, Any]) -> NodeImage:
        digests = frozenset(d.partition("@")[2] for d in data.get("RepoDigests") or [] if "@" in d)
        return cls(data["Id"], digests, tuple((data.get("RootFS") or {}).get("Layers") or ()))


def same_image(head: ImageIdentity, node: NodeImage) -> bool:
    """True when a node's image is the head's, on either image store; never by image ID alone."""
    if not head.layers or node.layers != head.layers:
        return False
    if head.config is not None and node.id == head.config:  # classic store: the ID is the config digest
        return True
    # containerd store: the ID is a manifest digest (pulled: the registry's; loaded: the tarball's)
    return node.id in head.manifests or bool(node.digests & head.manifests)


@dataclass(frozen=True)
class HeadImage:
    """The image on the head (the engine that built it), the two names it goes by, and its identity."""

    tag: str  # immutable, e.g. sparkforge/vllm:ng17e-0123456789ab
    moving_tag: str  # e.g. sparkforge/vllm:ng17e
    image_id: str
    size: int  # as the engine reports it: unpacked (classic store) or compressed (containerd); about a save's
    identity: ImageIdentity
    arch: str = ""  # the architecture it is built for, as Docker names it (arm64, amd64); "" when not known

    @property
    def repository(self) -> str:
        return ImageRef.parse(self.tag).repository


def _state_file(state_dir: Path | None, repository: str) -> Path:
    return (state_dir or STATE_DIR) / (repository.replace("/", "_") + ".json")


class DeployRecord(TypedDict):
    """The head's record of a repository, each section as read_state checked it (_RECORD)."""

    manifests: dict[str, list[str]]  # per tag, the manifest digests its image is known by
    deploys: dict[str, list[dict[str, Any]]]  # per node, its deploys in order: {"tag": ..., "at": ...}
    configs: dict[str, dict[str, str]]  # per tag, {"head_id": ..., "config": ...} learnt at a push or save
    deployed: dict[str, str]  # per moving tag, the build the last deploy set
    blobs: dict[str, dict[str, list[Any]]]  # per diff ID and compression, [blob digest, size] in the registry


def read_state(state_dir: Path | None, repository: str) -> DeployRecord:
    """The head's record of a repository; one that is not what sparkforge writes is one line naming the file and the
    entry, as its tags and digests reach docker's command line and registry URLs."""
    path = _state_file(state_dir, repository)
    try:
        data = parse_json(read_regular(path))
    except FileNotFoundError:
        data = {}  # no record yet: every section empty
    except (OSError, JsonError) as exc:
        raise DistributeError(f"unreadable deploy record: {getattr(exc, 'strerror', None) or exc}", path=path) from None
    if not isinstance(data, dict):
        raise DistributeError("unreadable deploy record: not a JSON object", path=path)
    for section, valid in _RECORD.items():
        entries = data.setdefault(section, {})
        bad = (section if not isinstance(entries, dict)
               else next((f"{section}.{key}" for key, value in entries.items() if not valid(value)), None))
        if bad:
            raise DistributeError("not what sparkforge writes in a deploy record; remove the entry or the file "
                                  "(it only remembers pushes and deploys)", path=path, field=bad)
    return cast(DeployRecord, data)  # every section checked above


def _digest(value: object) -> bool:
    return isinstance(value, str) and bool(DIGEST_RE.fullmatch(value))


def _tag(value: object) -> bool:
    """An image reference REPOSITORY:TAG as sparkforge records one (it reaches docker's command line)."""
    if not isinstance(value, str):
        return False
    ref = ImageRef.parse(value)
    return (ref.digest is None and bool(REPOSITORY_RE.fullmatch(ref.repository))
            and bool(ref.tag and TAG_RE.fullmatch(ref.tag)))


_RECORD: dict[str, Callable[[object], bool]] = {
    "manifests": lambda v: isinstance(v, list) and all(map(_digest, v)),
    "deploys": lambda v: isinstance(v, list) and all(isinstance(d, dict) and _tag(d.get("tag")) for d in v),
    "configs": lambda v: isinstance(v, dict) and _digest(v.get("head_id")) and _digest(v.get("config")),
    "deployed": _tag,  # per moving tag, the build the last deploy set
    "blobs": lambda v: isinstance(v, dict) and all(
        isinstance(b, list) and len(b) == 2 and _digest(b[0]) and type(b[1]) is int and b[1] >= 0 for b in v.values()),
}


@contextmanager
def recording(state_dir: Path | None, repository: str) -> Iterator[DeployRecord]:
    """The head's record of a repository to change in place: written whole when the block ends without an error."""
    data = read_state(state_dir, repository)
    yield data
    path = _state_file(state_dir, repository)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())  # never half a record


def record_manifest(state_dir: Path | None, tag: str, digest: str | None, config: str | None = None,
                    head_id: str | None = None) -> None:
    """Remember a manifest digest the image of tag is known by and, with head_id, its config digest (on a
    containerd-store head the image ID is a manifest digest; a classic-store node knows only the config digest)."""
    with recording(state_dir, ImageRef.parse(tag).repository) as data:
        known = data["manifests"].setdefault(tag, [])
        if digest and digest not in known:
            known.append(digest)
        if config and head_id:
            data["configs"][tag] = {"head_id": head_id, "config": config}


def head_image(plan: Plan, state_dir: Path | None = None, tag: str | None = None) -> HeadImage:
    """The image of a plan (or an older build, by its tag) on the head engine; it must be here."""
    tag = tag or plan.tag
    image = image_on_head(tag, plan.moving_tag, state_dir)
    if image is None:
        raise DistributeError(f"image {tag} is not on this machine", field=plan.variant,
                              hint=Hint("build it first with", ("build", plan.variant)))
    return image


def image_on_head(tag: str, moving_tag: str, state_dir: Path | None = None) -> HeadImage | None:
    """The image tagged `tag` on the head engine with every name recorded for it, or None when there is none."""
    data = dockercli.inspect_images(tag)[tag]
    if data is None:
        return None
    own = NodeImage.from_inspect(data)
    state = read_state(state_dir, ImageRef.parse(tag).repository)
    recorded = state["manifests"].get(tag, [])
    # The head's ID is its config digest on the classic store, a manifest digest on containerd: it goes in both
    # places. A config digest learnt at a push or save of this very image (same head ID) is the better config.
    learnt = state["configs"].get(tag) or {}
    config = learnt.get("config") if learnt.get("head_id") == own.id else None
    identity = ImageIdentity(config or own.id, frozenset(recorded) | own.digests | {own.id}, own.layers)
    return HeadImage(tag, moving_tag, own.id, int(data.get("Size") or 0), identity, str(data.get("Architecture") or ""))


@dataclass(frozen=True)
class Build:
    """One immutable tag of a variant on the head: when it was built, its vLLM and mods, where it went."""

    tag: str
    tagged: str  # when the engine last set a tag on it: the build's own time (its Created is SOURCE_DATE_EPOCH)
    vllm: str
    mods: str
    nodes: tuple[str, ...]  # nodes whose last recorded deploy was this tag
    moving: bool = False  # the variant's moving tag names this image
    base: str = "-"  # the base it was built from: the pinned digest, else what the engine held (12 hex, or "-")


# What follows `VARIANT-` in a build's tag: the plan's 12 hex, and for a kept build `.` and its own 12 hex
# (build/builder.kept_tag). Another variant's tag (`VARIANT-url-...`) never reads like one.
_BUILD_TAG = re.compile(r"[0-9a-f]{12}(\.[0-9a-f]{12})?")


def repository_tags(repository: str) -> list[str]:
    """Every REPOSITORY:TAG of one repository on the head engine, in the order docker lists them (no untagged)."""
    proc = dockercli.run(["images", repository, "--format", "{{.Repository}}:{{.Tag}}"], what="docker images")
    return list(dict.fromkeys(t for t in proc.stdout.split() if not t.endswith(":<none>")))


def builds(plan: Plan, state_dir: Path | None = None) -> list[Build]:
    """The builds of a variant on the head, newest first: its tags that read as a build's, on its images."""
    repo = plan.image
    prefix = f"{repo}:{plan.variant}-"
    tags = [t for t in repository_tags(repo) if t.startswith(prefix) and _BUILD_TAG.fullmatch(t[len(prefix):])]
    last = {node: past[-1]["tag"] for node, past in read_state(state_dir, repo)["deploys"].items() if past}
    found = []
    seen = dockercli.inspect_images(*tags, plan.moving_tag) if tags else {}
    moving = (seen.get(plan.moving_tag) or {}).get("Id")
    for tag in tags:  # one call for them all
        data = seen.get(tag)
        if data is None:  # removed since `docker images` listed it
            continue
        labels = (data.get("Config") or {}).get("Labels") or {}
        if labels.get("io.sparkforge.variant") != plan.variant:  # a tag that reads like one, on another image
            continue
        when = str((data.get("Metadata") or {}).get("LastTagTime") or "")[:19].replace("T", " ")
        said = labels.get("org.opencontainers.image.base.digest") or labels.get(BASE_LABEL) or ""
        base = said.rpartition("@")[2].removeprefix("sha256:")
        found.append(Build(tag, when if when[:4] > "0001" else "-",
                           labels.get("org.opencontainers.image.version", "-"), labels.get("io.sparkforge.mods", "-"),
                           tuple(sorted(n for n, t in last.items() if t == tag)), data["Id"] == moving,
                           base[:12] if SHA256_RE.fullmatch(base) else "-"))
    return sorted(found, key=lambda b: b.tagged, reverse=True)


def rollback_tag(plan: Plan, to: str | None, previous: bool, nodes: Iterable[Node],
                 state_dir: Path | None = None) -> str:
    """The tag a `deploy --to TAG` or `--previous` goes to; refused unless it is a build on the head."""
    repo = plan.image
    if to:
        tag = to if ImageRef.parse(to).tag else f"{repo}:{to}"
        if dockercli.inspect_images(tag)[tag] is None:
            raise DistributeError(f"no build {tag} on this machine", field="--to",
                                  hint=Hint("its builds are in", ("history", plan.variant)))
        return tag
    deploys = read_state(state_dir, repo)["deploys"]
    befores: set[str] = {past[-2]["tag"] for past in (deploys.get(node.name, []) for node in nodes) if len(past) >= 2}
    if len(befores) != 1:
        raise DistributeError("the nodes have no single previous deploy in the record; name one with --to TAG",
                              field="--previous", hint=Hint("the builds are in", ("history", plan.variant)))
    return befores.pop()


ARCH_SAID = "engine-arch: "  # how the node's engine names its architecture in an answer (see inspect)


def inspect(node: Node, *refs: str, runs: HeadImage | None = None) -> dict[str, NodeImage | None]:
    """The image each reference names on a node (or None), in one call that also refuses (NodeFailure) a node whose
    engine runs another architecture than the image `runs`."""
    arch = runs.arch if runs else ""
    asks = [("version", "--format", ARCH_SAID + "{{.Server.Arch}}")] if arch else []
    proc = run_dockers(node, [*asks, ("image", "inspect", *refs)], timeout=CONTROL_TIMEOUT)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    if runs and arch:
        lines = out.splitlines()
        said = [line.removeprefix(ARCH_SAID).strip() for line in lines if line.startswith(ARCH_SAID)]
        if not said or not said[-1]:  # the engine did not say (a failed `docker version` prints the marker alone)
            raise NodeFailure(f"docker version failed: {one_line(err) or 'no answer'}")
        if said[-1] != arch:
            raise NodeFailure(f"its engine runs {said[-1]} images, and {runs.tag} is built for linux/{arch}; "
                              "nothing was sent to it")
        out = "\n".join(line for line in lines if not line.startswith(ARCH_SAID))
    try:
        seen = dockercli.read_inspect(refs, proc.returncode, out, err)
        return {ref: None if data is None else NodeImage.from_inspect(data) for ref, data in seen.items()}
    except (ValueError, LookupError, TypeError) as exc:  # also an image without an ID or with odd digests
        raise NodeFailure(f"inspect of {' '.join(refs)} failed: {exc}") from None
