"""`launch`: the variant's server on every node (`vllm serve`, or one serve-torchrun rank per node), started together;
a rank that exits during start-up, a node that fails, a time limit or Ctrl-C stops every rank on every node."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable

from ..build.dockercli import last_line
from ..errors import ConfigError, DistributeError
from ..recipe.plan import Plan
from ..serve import TOKENS, Answer, Model, ServeError, ask, first_difference, log_summary, wait_ready
from .cluster import Node, engine_of
from .deploy import cluster_status
from .nodes import CONTROL_TIMEOUT, NodeFailure, run_docker, run_nodes

LABEL = "io.sparkforge.launch"
SERVER = "/opt/sparkforge/serve_torchrun.py"
# Each rank's /dev/shm (Docker's default is 64 MB). Not the host's IPC namespace: vLLM would take ranks that see one
# shared memory for ranks of one node, and join them by shared memory and local sockets, across hosts.
SHM_SIZE = "16g"
START_TIMEOUT = 120.0  # seconds one `docker run -d` (or a preflight container) may take on a node


@dataclass(frozen=True)
class LaunchSpec:
    """What to start, and where the ranks meet."""

    model: Model
    port: int = 8011  # rank 0's HTTP port
    master_port: int = 29500  # the GLOO / torch.distributed master's port, on rank 0's node
    master_addr: str | None = None  # default: the first node's host
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()  # more vLLM arguments, as given after --
    timeout: float = 1800.0  # seconds until rank 0 must answer
    log_dir: Path | None = None  # where the ranks' logs are kept when the launch fails


@dataclass(frozen=True)
class Rank:
    node: Node
    rank: int
    image: str  # the node's own ID of the image it runs
    address: str  # its address on the way to the master
    ifname: str  # the interface that holds it


@dataclass(frozen=True)
class Launched:
    endpoint: str
    ranks: tuple[Rank, ...]
    load_seconds: float
    first_token: Answer


def container_name(plan: Plan) -> str:
    return f"sparkforge-launch-{plan.variant}"


def master_of(nodes: tuple[Node, ...], spec: LaunchSpec) -> str:
    """The master's address: as given, else the first node's host (127.0.0.1 for a local socket)."""
    if spec.master_addr:
        return spec.master_addr
    kind, where, _ = engine_of(nodes[0].endpoint)
    return where if kind in ("ssh", "tcp") else "127.0.0.1"


def _preflight(node: Node, image: str, master: str, spec: LaunchSpec, rank: int, name: str) -> Rank:
    """A throwaway container on the node's network: the model, the ports, the route to the master."""
    if run_docker(node, "container", "inspect", name, timeout=CONTROL_TIMEOUT).returncode == 0:
        raise NodeFailure(f"{node.name}: a container {name} is there already (stop it with launch --stop)")
    ports = [spec.port, spec.master_port] if rank == 0 else []
    cmd = ["run", "--rm", "--network", "host", *spec.model.mount(), "--entrypoint", "python3", image,
           "-I", "-B", "/opt/sparkforge/inimage", "preflight", "--master", master, "--master-port",
           str(spec.master_port), *[w for p in ports for w in ("--port", str(p))]]
    if spec.model.folder is not None:
        cmd += ["--model", spec.model.arg]
    done = run_docker(node, *cmd, timeout=START_TIMEOUT)
    if done.returncode != 0:
        raise NodeFailure(f"{node.name}: the preflight container failed: {last_line(done.stderr, 'no output')}")
    try:
        found = json.loads(last_line(done.stdout, "{}"))
        problems, address, ifname = list(found["problems"]), found["address"], found["ifname"]
    except (ValueError, KeyError, TypeError):
        raise NodeFailure(f"{node.name}: the preflight said {last_line(done.stdout, 'nothing')!r}") from None
    if problems:
        raise NodeFailure(f"{node.name}: {'; '.join(str(p) for p in problems)}")
    return Rank(node, rank, image, str(address), str(ifname))


def rank_command(plan: Plan, r: Rank, world: int, master: str, spec: LaunchSpec, name: str) -> list[str]:
    """The `docker run -d` of one rank: the host's network, its own IPC namespace with a large /dev/shm, the GPUs."""
    cmd = ["run", "-d", "--name", name, "--label", f"{LABEL}={plan.variant}", "--network", "host",
           "--shm-size", SHM_SIZE, *spec.model.mount()]
    if not plan.on_cpu:  # as NVIDIA runs its NGC containers: NCCL over RDMA pins memory
        cmd += ["--gpus", "all", "--ulimit", "memlock=-1"]
    for key, value in (("GLOO_SOCKET_IFNAME", r.ifname), ("NCCL_SOCKET_IFNAME", r.ifname),
                       ("VLLM_HOST_IP", r.address), *spec.env):
        cmd += ["-e", f"{key}={value}"]
    served = ["--served-model-name", spec.model.served, "--host", "0.0.0.0", "--port", str(spec.port)]
    if world == 1:
        return cmd + ["--entrypoint", "vllm", r.image, "serve", spec.model.arg, *served, *spec.args]
    return cmd + ["--entrypoint", "torchrun", r.image, "--nnodes", str(world), "--nproc-per-node", "1",
                  "--node-rank", str(r.rank), "--master-addr", master, "--master-port", str(spec.master_port),
                  SERVER, "--model", spec.model.arg, "--tensor-parallel-size", str(world), *served, *spec.args]


def _ended(r: Rank, name: str) -> str | None:
    """Why a rank's container no longer runs (with its last log lines), or None while it does."""
    done = run_docker(r.node, "container", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name,
                      timeout=CONTROL_TIMEOUT)
    if done.returncode != 0:
        return f"rank {r.rank} on {r.node.name}: its container is gone"
    status, _, code = done.stdout.decode().strip().partition(" ")
    if status in ("created", "running"):
        return None
    logs = run_docker(r.node, "logs", "--tail", "2000", name, timeout=CONTROL_TIMEOUT)
    text = (logs.stdout + logs.stderr).decode(errors="replace")
    return f"rank {r.rank} on {r.node.name} exited (code {code}): {log_summary(text)}"


def stop(plan: Plan, nodes: tuple[Node, ...]) -> dict[str, str]:
    """Remove the variant's launch container on every node; what happened on each."""
    def one(node: Node) -> str:
        try:
            done = run_docker(node, "rm", "-f", container_name(plan), timeout=CONTROL_TIMEOUT)
        except NodeFailure as exc:
            return f"failed: {exc}"
        if done.returncode != 0:
            return f"failed: {last_line(done.stderr, 'no message')}"
        return "stopped" if done.stdout.strip() else "nothing running"

    return dict(zip((n.name for n in nodes), run_nodes(nodes, one)))


def launch(plan: Plan, nodes: tuple[Node, ...], spec: LaunchSpec,
           say: Callable[[str], None] = lambda line: None) -> Launched:
    """Start the server on every node and wait for rank 0's first token; see the module docstring."""
    if not nodes:
        raise ConfigError("no nodes to launch on", field="--nodes")
    if len(nodes) > 1 and not any(m.name == "serve-torchrun" for m in plan.mods):
        raise ConfigError(f"{plan.variant} has no torchrun server for {len(nodes)} nodes: add the serve-torchrun "
                          "mod to its recipe (one node runs `vllm serve`)", field="--nodes")
    st = cluster_status(plan, nodes)  # each node runs its own ID of the image `status` calls current
    missing = [f"{n.node.name}: {n.error}" if n.error else f"{n.node.name} does not hold {st.tag}"
               for n in st.nodes if n.error or n.moving_id is None or (st.image is not None and not n.current)]
    if missing:
        raise DistributeError(f"not launched, nothing was started: {'; '.join(missing)} (deploy it first)")
    images = {n.node.name: n.moving_id or "" for n in st.nodes}
    master = master_of(nodes, spec)
    name = container_name(plan)

    def preflight(node: Node) -> Rank | str:  # each node fails alone, and all are reported
        try:
            return _preflight(node, images[node.name], master, spec, nodes.index(node), name)
        except NodeFailure as exc:
            return str(exc)

    ranks = run_nodes(nodes, preflight)
    if failed := [r for r in ranks if isinstance(r, str)]:
        raise DistributeError(f"not launched, nothing was started: {'; '.join(failed)}")
    ready = tuple(r for r in ranks if isinstance(r, Rank))
    for r in ready:
        say(f"{r.node.name}: rank {r.rank}, {r.address} on {r.ifname}")
    started: list[Rank] = []
    ok = False
    try:
        for r in ready:
            done = run_docker(r.node, *rank_command(plan, r, len(ready), master, spec, name), timeout=START_TIMEOUT)
            if done.returncode != 0:
                raise DistributeError(f"rank {r.rank} on {r.node.name} did not start: "
                                      f"{log_summary(done.stderr.decode(errors='replace'), 1)}")
            started.append(r)
        endpoint = f"http://{master}:{spec.port}"
        say(f"started {len(started)} rank{'s' if len(started) > 1 else ''}; waiting for {endpoint}/health "
            f"(up to {spec.timeout:.0f} s)")
        loaded = wait_ready(endpoint, lambda: next(filter(None, (_ended(r, name) for r in started)), None),
                            spec.timeout, poll=3.0)
        first = ask(endpoint, spec.model.served, "completion", tokens=1)
        ok = True
        return Launched(endpoint, tuple(started), loaded, first)
    except ServeError as exc:
        raise DistributeError(f"stopped every rank: {exc}{_keep_logs(started, name, spec.log_dir, plan.variant)}") \
            from None
    finally:
        if not ok and started:
            stop(plan, tuple(r.node for r in started))


def _keep_logs(ranks: list[Rank], name: str, log_dir: Path | None, variant: str) -> str:
    """Each rank's log into log_dir; what to add to the error line: rank 0's first error and where the logs are."""
    kept, first = [], ""
    for r in ranks:
        try:
            done = run_docker(r.node, "logs", name, timeout=CONTROL_TIMEOUT)
        except NodeFailure:
            continue
        text = (done.stdout + done.stderr).decode(errors="replace")
        if r.rank == 0:
            first = log_summary(text, 1)
        if log_dir is not None:
            path = log_dir / f"launch-{variant}-rank{r.rank}.log"
            try:
                log_dir.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            except OSError:  # the logs are a help; the failure being reported is the launch's
                continue
            kept.append(str(path))
    return (f"; rank 0's log: {first}" if first else "") + (f" (logs: {', '.join(kept)})" if kept else "")


@dataclass(frozen=True)
class CheckResult:
    """The greedy tokens of the fixed prompt from each run, and the first difference (None: all equal)."""

    answers: tuple[tuple[str, Answer], ...]
    difference: str | None


def check(plan: Plan, nodes: tuple[Node, ...], spec: LaunchSpec,
          say: Callable[[str], None] = lambda line: None) -> tuple[Launched, CheckResult]:
    """The correctness gate: greedy tokens of one prompt from one node alone (for several), with
    VLLM_UF_EAGER_ALLREDUCE=1 (the UF17 mod's path) and as asked, left running when all agree, else nothing is."""
    answers: list[tuple[str, Answer]] = []
    where = "one node" if len(nodes) == 1 else f"{len(nodes)} nodes"
    eager = replace(spec, env=(*spec.env, ("VLLM_UF_EAGER_ALLREDUCE", "1")))
    runs = [("one node", nodes[:1], spec)] if len(nodes) > 1 else []
    runs += [(f"{where}, VLLM_UF_EAGER_ALLREDUCE=1", nodes, eager), (where, nodes, spec)]
    launched = None
    for label, on, run_spec in runs:
        say(f"check: {label}")
        launched = launch(plan, on, run_spec, say)
        keep = False
        try:
            answer = ask(launched.endpoint, spec.model.served, "completion", tokens=TOKENS)
            if problem := answer.problem(TOKENS):
                raise DistributeError(f"check: {label}: {problem}")
            say(f"check: {label}: {answer.text!r} {list(answer.token_ids or [])}")
            answers.append((label, answer))
            keep = label == runs[-1][0]
        except ServeError as exc:
            raise DistributeError(f"check: {label}: {exc}") from None
        finally:
            if not keep:
                stop(plan, on)
    assert launched is not None
    reference_name, reference = answers[0]
    difference = next((d for name, a in answers[1:]
                       if (d := first_difference(name, a, reference, reference_name))), None)
    if difference:
        stop(plan, nodes)
    return launched, CheckResult(tuple(answers), difference)
