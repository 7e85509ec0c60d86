"""The cluster verbs of the command line: push, deploy and status, registered on the one typer app.

Only flags and printing live here; what to do on the nodes is decided in the distribute package.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..distribute.nodes import PULL_STALL_TIMEOUT, STALL_TIMEOUT
from ..errors import ConfigError, visible
from ..imageref import ImageRef
from . import views
from .app import Base, Variant, app, emit, err, next_step, out, plan_of, say, write

if TYPE_CHECKING:
    from ..distribute.deploy import ProgressFn

Cluster = Annotated[Optional[Path], typer.Option("--cluster", metavar="FILE", help="Cluster file naming the nodes and "
                                                 "the registry (default: ./cluster.yaml when it exists).")]
Nodes = Annotated[Optional[list[str]], typer.Option("--nodes", metavar="NODES", help="Nodes by cluster-file name, or by "
                                                    "endpoint (ssh://user@host, tcp://host:port, unix:///path); "
                                                    "comma-separated or repeated. Default: every node of the cluster "
                                                    "file.", show_default=False)]
Registry = Annotated[Optional[str], typer.Option("--registry", metavar="HOST:PORT", help="Registry as HOST:PORT, e.g. "
                                                 "127.0.0.1:5000 (default: registry: of the cluster file).")]


class Compression(str, enum.Enum):
    """How `push` sends layers."""

    zstd = "zstd"
    none = "none"
    gzip = "gzip"


class Mode(str, enum.Enum):
    """How `deploy` moves the image."""

    registry = "registry"
    stream = "stream"


class Action(str, enum.Enum):
    """What `registry` does."""

    start = "start"
    stop = "stop"
    status = "status"


def _cluster_path(cluster: Optional[Path]) -> Optional[Path]:
    if cluster is not None:
        return cluster
    default = Path("cluster.yaml")
    return default if default.is_file() else None


def _distribute_printer() -> ProgressFn:
    """Per-node progress lines: on each phase change, and at most every 2 s while bytes move."""
    from ..distribute.deploy import Progress, human_bytes

    last: dict[str, tuple[str, float]] = {}

    def show(p: Progress) -> None:
        import time

        now = time.monotonic()
        phase, when = last.get(p.node, ("", 0.0))
        if p.phase == phase and now - when < 2.0:
            return
        last[p.node] = (p.phase, now)
        moved = f" {human_bytes(p.done)}" + (f" / {human_bytes(p.total)}" if p.total else "") if p.done else ""
        err.print(f"  {p.node:<14} {p.phase:<7}{moved}  {p.detail}".rstrip(), markup=False)

    return show


@app.command()
def push(
    variant: Variant,
    registry: Registry = None,
    cluster: Cluster = None,
    base: Base = None,
    compression: Annotated[Compression, typer.Option("--compression", help="zstd: layers compressed on every core "
                                                     "(Docker 23+ pulls them, both image stores); none: uncompressed, "
                                                     "for a fast LAN; gzip: the engine's own push (one core, any "
                                                     "Docker). A containerd-store head sends the layers it built as "
                                                     "it keeps them (gzip) whatever is chosen; there gzip is "
                                                     "fastest, where the engine trusts the registry.")] = Compression.zstd,
) -> None:
    """Push a built image's immutable tag and moving tag to a registry.

    Example: ./build.py push ng17e --registry 127.0.0.1:5000
    """
    from ..distribute.cluster import push_registry
    from ..distribute.deploy import human_bytes
    from ..distribute.images import head_image
    from ..distribute.push import push_to

    plan = plan_of(variant, base)
    reg = push_registry(registry, _cluster_path(cluster))
    image = head_image(plan)
    out.print(f"pushing {plan.tag} ({image.image_id[:19]}) to {reg.address}, layers {compression.value}")
    result = push_to(image, reg, compression.value, progress=_distribute_printer())
    for ref in result.refs:
        out.print(f"pushed {ref}")
    out.print(f"manifest {result.digest}; {result.layers_pushed} layers sent ({human_bytes(result.bytes_pushed)}), "
              f"{result.layers_present} already in the registry; {result.seconds:.1f}s")
    for stored, n in result.sent_as_stored:
        if stored != compression.value:
            faster = ("; here `--compression gzip` (the engine's own push) makes a first deploy faster, where this "
                      "engine trusts the registry") if stored == "gzip" else ""
            out.print(f"note: {n} layer{'' if n == 1 else 's'} went as this engine keeps them ({stored}), not "
                      f"{compression.value}: the containerd image store keeps what BuildKit built compressed{faster}")


@app.command()
def deploy(
    variant: Variant,
    nodes: Nodes = None,
    cluster: Cluster = None,
    registry: Registry = None,
    mode: Annotated[Mode, typer.Option("--mode", help="registry: nodes pull what they lack (push first); stream: "
                                       "docker save piped into each node's docker load, no registry needed.")]
    = Mode.registry,
    base: Base = None,
    to: Annotated[Optional[str], typer.Option("--to", metavar="TAG", help="Deploy this older build instead (an "
                                              "immutable tag, see `history`); the moving tag goes back to it.")]
    = None,
    previous: Annotated[bool, typer.Option("--previous", help="Deploy the build the nodes ran before their current "
                                           "one (from the head's deploy record).")] = False,
    stall: Annotated[Optional[float], typer.Option("--stall", metavar="SECONDS", min=1,
                                                   help="Stop a node's transfer after this many seconds without "
                                                   "progress (its docker pull prints nothing, or its docker load "
                                                   "takes no data); that node fails alone and keeps its old image. "
                                                   f"Default: {PULL_STALL_TIMEOUT:.0f} for a pull (a containerd-store "
                                                   "node prints nothing while it unpacks a layer), "
                                                   f"{STALL_TIMEOUT:.0f} for a stream.")] = None,
) -> None:
    """Put a built image on every node, in parallel, and check that every node has the head's image.

    A node that already has the image is skipped. On each node the moving tag is set last, only
    after the image ID matches the head's; a node that fails keeps its old image. Exits 1 when
    any node failed.

    Examples:

      ./build.py push ng17e --registry 127.0.0.1:5000

      ./build.py deploy ng17e --cluster cluster.yaml

      ./build.py deploy ng17e --mode stream --nodes ssh://admin@spark2,ssh://admin@spark3
    """
    from ..distribute.cluster import resolve_cluster
    from ..distribute.deploy import deploy_registry
    from ..distribute.images import head_image, rollback_tag
    from ..distribute.stream import deploy_stream

    plan = plan_of(variant, base)
    target = resolve_cluster(_cluster_path(cluster), nodes, registry)
    if mode is Mode.registry and not target.registry:
        raise ConfigError("registry mode needs a registry: pass --registry HOST:PORT, set registry: in the "
                              "cluster file, or use --mode stream", field="--registry")
    image = head_image(plan, tag=rollback_tag(plan, to, previous, target.nodes) if to or previous else None)
    where = f"from {target.registry}" if mode is Mode.registry else "by docker save | docker load"
    out.print(f"deploying {image.tag} ({image.image_id[:19]}) to {len(target.nodes)} nodes {where}")
    show = _distribute_printer()
    if mode is Mode.registry:
        result = deploy_registry(image, target.nodes, target.registry_spec or target.registry or "", show,
                                 stall_timeout=stall or PULL_STALL_TIMEOUT)
    else:
        result = deploy_stream(image, target.nodes, show, stall_timeout=stall or STALL_TIMEOUT)
    out.print(views.deploy_table(result))
    emit(views.deploy_lines(plan, result))
    if not result.ok:
        raise typer.Exit(1)
    out.print(f"every node runs {plan.moving_tag} = {image.image_id}")


@app.command()
def status(
    variant: Variant,
    nodes: Nodes = None,
    cluster: Cluster = None,
    base: Base = None,
) -> None:
    """Show which image each node's moving tag points to; exit 1 unless all match (and match the head).

    Example: ./build.py status ng17e --cluster cluster.yaml
    """
    from ..distribute.cluster import resolve_cluster
    from ..distribute.deploy import cluster_status

    plan = plan_of(variant, base)
    target = resolve_cluster(_cluster_path(cluster), nodes, None)
    st = cluster_status(plan, target.nodes)
    head_id = st.image.image_id if st.image else None
    out.print(f"{plan.moving_tag}: head has {head_id[:19] if head_id else 'no image (not built here)'}")
    if st.newest:
        out.print(f"compared with {st.tag}, the build the last deploy set; the newest build here is {st.newest} "
                  f"({next_step('deploy it with', 'deploy', plan.variant)})", markup=False)
    out.print(views.status_table(st, ImageRef.parse(plan.tag).tag or ""))
    if st.all_match:
        out.print(f"all {len(st.nodes)} nodes match: {head_id or next(iter(st.ids))}")
        return
    out.print(f"[bold red]nodes differ[/]: {len(st.ids)} distinct images across {len(st.nodes)} nodes"
              + ("" if not any(n.error for n in st.nodes) else "; some nodes did not answer"))
    raise typer.Exit(1)


@app.command("registry")
def registry_cmd(
    action: Annotated[Action, typer.Argument(metavar="ACTION", help="start, stop or status.", show_default=False)],
    cluster: Cluster = None,
) -> None:
    """Start, stop or check the registry the cluster file describes (address, TLS or insecure).

    Without a cluster file (or without registry: in it): a plain-HTTP registry on 127.0.0.1:5000.

    Example: ./build.py registry start --cluster cluster.yaml
    """
    from ..distribute.cluster import registry_to_run, run_registry

    proc = run_registry(action.value, registry_to_run(_cluster_path(cluster)))
    write(visible(proc.stdout))  # a script's output, shown with its control characters escaped
    write(visible(proc.stderr), stderr=True)
    if proc.returncode != 0:
        raise typer.Exit(proc.returncode)


@app.command()
def history(
    variant: Variant,
    base: Base = None,
) -> None:
    """List the builds of a variant on this machine, newest first, with vLLM, mods and the nodes running each.

    Go back to one with `deploy VARIANT --to TAG`, or to the one before with `deploy VARIANT --previous`.
    """
    from ..distribute.images import builds

    plan = plan_of(variant, base)
    found = builds(plan)
    if not found:
        say(f"no builds of {plan.variant} on this machine ({plan.image}:{plan.variant}-...); "
            f"{next_step('make one with', 'build', plan.variant)}")
        return
    table = Table(box=None, pad_edge=False)
    for col in ("tag", "tagged (UTC)", "vLLM", "mods", "last deployed to"):
        table.add_column(col)
    for b in found:
        shown = ImageRef.parse(b.tag).tag or ""
        table.add_row(escape(shown + (f"  <- {plan.variant}" if b.moving else "")), b.tagged, escape(b.vllm),
                      escape(b.mods), ", ".join(b.nodes) or "-")
    out.print(table)
