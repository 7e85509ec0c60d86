"""The cluster verbs: push, deploy, status, registry, history and launch; the distribute package decides the rest."""

from __future__ import annotations

import enum
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..distribute.cluster import push_registry, registry_to_run, resolve_cluster, run_registry
from ..distribute.images import builds, head_image, rollback_tag
from ..distribute.nodes import PULL_STALL_TIMEOUT, STALL_TIMEOUT
from ..errors import ConfigError, DistributeError, visible
from ..imageref import ImageRef
from ..recipe.fields import ENV_NAME_RE, HOST, host_problem
from ..serve import ServeError, cache_dir, model_of
from . import views
from .app import DEFAULT_LOG_DIR, Base, Variant, app, emit, next_step, out, plan_of, say, tell_step, write

if TYPE_CHECKING:
    from ..distribute.deploy import ProgressFn

Cluster = Annotated[Path | None, typer.Option("--cluster", metavar="FILE", help="Cluster file naming the nodes and "
                                                 "the registry (default: ./cluster.yaml when it exists).")]
Nodes = Annotated[list[str] | None, typer.Option(
    "--nodes", metavar="NODES", show_default=False, help="Nodes by cluster-file name, or by endpoint (ssh://user@host, "
    "tcp://host:port, unix:///path); comma-separated or repeated. Default: every node of the cluster file.")]
Registry = Annotated[str | None, typer.Option("--registry", metavar="HOST:PORT", help="Registry as HOST:PORT, e.g. "
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


def _cluster_path(cluster: Path | None) -> Path | None:
    if cluster is None and Path("cluster.yaml").is_file():
        return Path("cluster.yaml")
    return cluster


def _distribute_printer() -> ProgressFn:
    """Per-node progress lines: on each phase change, and at most every 2 s while bytes move (rate, time left)."""
    from ..distribute.deploy import Progress, moved_said

    last: dict[str, tuple[str, float, float, int]] = {}  # node: phase, last line, phase start, bytes at start

    def show(p: Progress) -> None:
        now = time.monotonic()
        phase, when, began, since = last.get(p.node, ("", 0.0, now, 0))
        if p.phase == phase and now - when < 2.0:
            return
        if p.phase != phase:
            began, since = now, p.done
        last[p.node] = (p.phase, now, began, since)
        moved = f" {moved_said(p.done, p.total, now - began, since)}" if p.done else ""
        tell_step(f"{p.node:<14} {p.phase:<7}{moved}  {p.detail}".rstrip())

    return show


@app.command()
def push(
    variant: Variant,
    registry: Registry = None,
    cluster: Cluster = None,
    base: Base = None,
    compression: Annotated[Compression | None, typer.Option(
        "--compression", show_default=False, help="zstd: layers compressed on every core (Docker 23+ pulls them, both "
        "image stores); none: uncompressed, for a fast LAN; gzip: the engine's own push (gzip on one core, any Docker; "
        "a containerd-store head sends the layers as it keeps them, zstd for sparkforge's builds). Default: the route "
        "a first deploy is fastest after: the engine's own push on a containerd-store head (blobs, zstd, where the "
        "engine cannot push to the registry), zstd on a classic-store head.")] = None,
) -> None:
    """Push a built image's immutable tag and moving tag to a registry.

    Example: ./build.py push ng17e --registry 127.0.0.1:5000
    """
    from ..distribute.deploy import human_bytes
    from ..distribute.push import push_by_default, push_to

    plan = plan_of(variant, base)
    reg = push_registry(registry, _cluster_path(cluster))
    image = head_image(plan)
    layers = f", layers {compression.value}" if compression else ""
    out.print(f"pushing {plan.tag} ({image.image_id[:19]}) to {reg.address}{layers}")
    show = _distribute_printer()
    result = (push_by_default(image, reg, say, progress=show) if compression is None
              else push_to(image, reg, compression.value, progress=show))
    for ref in result.refs:
        out.print(f"pushed {ref}")
    out.print(f"manifest {result.digest}; {result.layers_pushed} layers sent ({human_bytes(result.bytes_pushed)}), "
              f"{result.layers_present} already in the registry; {result.seconds:.1f}s")
    for stored, n in result.sent_as_stored:  # only a containerd-store head keeps layers compressed
        if compression is not None and stored != compression.value:
            out.print(f"note: {n} layer{'' if n == 1 else 's'} went as this engine keeps them ({stored}), not "
                      f"{compression.value}: the containerd image store keeps what BuildKit built compressed; here "
                      "`--compression gzip` (the engine's own push) makes a first deploy faster, where this engine "
                      "trusts the registry")


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
    to: Annotated[str | None, typer.Option("--to", metavar="TAG", help="Deploy this older build instead (an immutable "
                                           "tag, see `history`); the moving tag goes back to it.")] = None,
    previous: Annotated[bool, typer.Option("--previous", help="Deploy the build the nodes ran before their current "
                                           "one (from the head's deploy record).")] = False,
    stall: Annotated[float | None, typer.Option(
        "--stall", metavar="SECONDS", min=1, help="Stop a node's transfer after this many seconds without progress "
        "(docker pull prints nothing, docker load takes no data); that node fails alone, keeping its old image. "
        f"Default: {PULL_STALL_TIMEOUT:.0f} for a pull (a containerd-store node is silent while it unpacks a layer), "
        f"{STALL_TIMEOUT:.0f} for a stream.")] = None,
) -> None:
    """Put a built image on every node, in parallel, and check that every node has the head's image.

    A node that already has the image is skipped. On each node the moving tag is set last, only after the image ID
    matches the head's; a node that fails keeps its old image. Exits 1 when any node failed.

    Examples:
      ./build.py push ng17e --registry 127.0.0.1:5000
      ./build.py deploy ng17e --cluster cluster.yaml
      ./build.py deploy ng17e --mode stream --nodes ssh://admin@spark2,ssh://admin@spark3
    """
    from ..distribute.deploy import deploy_registry
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
    emit(views.deploy_lines(plan, result))
    if not result.ok:
        raise typer.Exit(1)
    out.print(f"every node runs {plan.moving_tag} = {image.image_id}")


@app.command()
def status(variant: Variant, nodes: Nodes = None, cluster: Cluster = None, base: Base = None) -> None:
    """Show which image each node's moving tag points to; exit 1 unless all match (and match the head).

    Example: ./build.py status ng17e --cluster cluster.yaml
    """
    from ..distribute.deploy import cluster_status

    plan = plan_of(variant, base)
    target = resolve_cluster(_cluster_path(cluster), nodes, None)
    st = cluster_status(plan, target.nodes)
    head_id = st.image.image_id if st.image else None
    out.print(f"{plan.moving_tag}: head has {head_id[:19] if head_id else 'no image (not built here)'}")
    if st.newest:
        say(f"compared with {st.tag}, the build the last deploy set; the newest build here is {st.newest} "
            f"({next_step('deploy it with', 'deploy', plan.variant)})")
    emit(views.status_lines(st, plan.moving_tag))
    if st.all_match:
        out.print(f"all {len(st.nodes)} nodes match: {head_id or next(iter(st.ids))}")
        return
    emit(views.status_summary(st))
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
    proc = run_registry(action.value, registry_to_run(_cluster_path(cluster)))
    write(visible(proc.stdout))  # a script's output, shown with its control characters escaped
    write(visible(proc.stderr), stderr=True)
    if proc.returncode != 0:
        raise typer.Exit(proc.returncode)


@app.command()
def history(variant: Variant, base: Base = None) -> None:
    """List the builds of a variant on this machine, newest first, with vLLM, base, mods and the nodes running each.

    The base column is the first 12 hex of the base image's digest (`inspect` shows it whole). Go back to a build
    with `deploy VARIANT --to TAG`, or to the one before with `deploy VARIANT --previous`.
    """
    plan = plan_of(variant, base)
    found = builds(plan)
    if not found:
        say(f"no builds of {plan.variant} on this machine ({plan.image}:{plan.variant}-...); "
            f"{next_step('make one with', 'build', plan.variant)}")
        return
    table = Table("tag", "tagged (UTC)", "vLLM", "base", "mods", "last deployed to", box=None, pad_edge=False)
    for b in found:
        shown = ImageRef.parse(b.tag).tag or ""
        table.add_row(escape(shown + (f"  <- {plan.variant}" if b.moving else "")), b.tagged, escape(b.vllm),
                      b.base, escape(b.mods), ", ".join(b.nodes) or "-")
    out.print(table)


@app.command()
def launch(
    variant: Variant,
    vllm_args: Annotated[list[str] | None, typer.Argument(
        metavar="[-- VLLM_ARGS...]", show_default=False, help="More arguments for vLLM on every rank, after --, e.g. "
        "-- --max-model-len 8192 --enforce-eager.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", metavar="MODEL", help="The model: a folder at the same path on every node (mounted read-only), or "
        "a Hugging Face name. Required, but with --stop.")] = None,
    nodes: Nodes = None,
    cluster: Cluster = None,
    base: Base = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Rank 0's HTTP port.")] = 8011,
    master_port: Annotated[int, typer.Option("--master-port", min=1, max=65535, help="The port the ranks meet at, "
                                             "on the first node.")] = 29500,
    master_addr: Annotated[str | None, typer.Option(
        "--master-addr", metavar="ADDRESS", help="The first node's address as the others reach it (default: its host "
        "in the cluster file).")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", metavar="NAME=VALUE", show_default=False, help="An "
                                                     "environment variable for every rank; repeat for several.")]
    = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", min=1, help="How long rank 0 may take to "
                                           "load the model and answer.")] = 1800,
    check: Annotated[bool, typer.Option(
        "--check", help="Before leaving the server running, compare its greedy tokens for a fixed prompt with a "
        "single-node run (the model must fit on one node) and with VLLM_UF_EAGER_ALLREDUCE=1; fail naming the first "
        "token that differs.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the variant's server on every node.")] = False,
) -> None:
    """Start the variant's server on every node: one container each, tensor parallel across the nodes.

    One node runs the image's `vllm serve`; several run the torchrun server (serve-torchrun mod), rank 0 on the first
    node serving the OpenAI API. Every node needs the image `status` calls current and the model folder at the same
    path. Launch waits for rank 0's first token, then prints the endpoint, load time and time to first token. A rank
    exiting during start-up, a node failing, the time running out or Ctrl-C stops every rank on every node. Exits 1
    when the server did not start.

    Examples:
      ./build.py launch ng17e --cluster cluster.yaml --model /models/Qwen3-Coder-30B-A3B-Instruct
      ./build.py launch ng17e --cluster cluster.yaml --model /models/tiny --check -- --enforce-eager
      ./build.py launch ng17e --cluster cluster.yaml --stop
    """
    from ..distribute.launch import LaunchSpec, check as check_launch, launch as launch_nodes, stop as stop_nodes

    plan = plan_of(variant, base)
    target = resolve_cluster(_cluster_path(cluster), nodes, None)
    if stop:
        done = stop_nodes(plan, target.nodes)
        for name, what in done.items():
            say(f"{name}: {what}")
        if any(what.startswith("failed") for what in done.values()):
            raise typer.Exit(1)
        return
    if model is None:
        raise ConfigError("give the model: a folder at the same path on every node, or a Hugging Face name "
                          "(make-model DIR makes a tiny one offline)", field="--model")
    if master_addr is not None and (not re.fullmatch(HOST, master_addr) or host_problem(master_addr)):
        raise ConfigError(f"{master_addr!r} is not a host name or an IPv4 address", field="--master-addr")
    pairs = []
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not ENV_NAME_RE.fullmatch(key):
            raise ConfigError(f"{item!r} is not NAME=VALUE", field="--env")
        pairs.append((key, value))
    try:
        served = model_of(model, cache_dir())
    except FileNotFoundError as exc:
        raise ConfigError(str(exc.strerror), path=model, field="--model") from None
    spec = LaunchSpec(served, port, master_port, master_addr, tuple(pairs), tuple(vllm_args or ()), timeout,
                      DEFAULT_LOG_DIR)
    world = len(target.nodes)
    say(f"launching {plan.moving_tag} on {world} node{'s' if world > 1 else ''}"
        + (f" (tensor parallel {world} over torchrun)" if world > 1 else " (vllm serve)"))
    try:
        launched, result = (check_launch(plan, target.nodes, spec, tell_step) if check
                            else (launch_nodes(plan, target.nodes, spec, tell_step), None))
    except ServeError as exc:
        raise DistributeError(str(exc)) from None
    if result is not None:
        for label, answer in result.answers:
            say(f"check: {label}: {list(answer.token_ids or [])} {answer.text!r}")
        if result.difference:
            raise DistributeError(f"check failed, every rank stopped: {result.difference}")
        say(f"check passed: the {len(result.answers)} runs generated the same "
            f"{len(result.answers[0][1].token_ids or [])} tokens")
    say(f"serving {served.served} at {launched.endpoint}/v1 (ranks: "
        f"{', '.join(f'{r.rank} on {r.node.name}' for r in launched.ranks)}); loaded in {launched.load_seconds:.1f} s, "
        f"first token in {launched.first_token.seconds:.2f} s")
    say(next_step("stop it with", "launch", plan.variant, "--stop"))
