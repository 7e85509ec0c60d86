"""Distribution benchmark on the namespace cluster: cold deploys by stream and by registry, side by side,
from a head on each image store.

In one run, on the test variant (real vLLM 0.17.0 wheel) and three ssh hosts in network
namespaces (tests/infra/netns.py; node3 on the containerd image store), with the registry on the
head's address over TLS, the same steps run twice: from the machine's engine (the containerd image
store of a Docker 29 install) and from a classic-store engine of the bench's own (the same dockerd,
`features.containerd-snapshotter` off). Each step:
  anchor  `docker save | ssh docker load` to the 3 nodes (sparkforge's stream mode);
  push    the engine's own push (gzip, one core), and sparkforge's blob push with zstd on every
          core and with no compression; each to an empty repository;
  deploy  cold registry deploys (1 node, then 3 nodes) after each kind of push;
  change  one install-phase mod changed: rebuild, push (zstd), deploy to the 3 nodes.
Bytes are what the code counted: bytes piped into each docker load, blob bytes sent by a push,
and for a pull the registry sizes of the layers each node reported downloading.
Every timed step starts after a sync, so none pays for the disk writes of the one before it
(the 3-node deploy comes right after the 1-node deploy and a wipe).
The last table puts the two heads side by side (containerd / classic).
Run with `make bench-distribute` (root, Docker up on the containerd store, sshd installed, `make base-local`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkout's sparkforge and tests packages

from tests.cluster.clusterkit import make_ca  # noqa: E402
from tests.infra.netns import NetnsCluster, free_subnet, missing  # noqa: E402
from tests.infra.nodes import CLASSIC, start_nodes, stop_nodes  # noqa: E402
from tests.infra.nodes import Node as Engine  # noqa: E402

from sparkforge.build import dockercli  # noqa: E402
from sparkforge.distribute import deploy, images, push, stream  # noqa: E402
from sparkforge.distribute.cluster import Node, Registry, registry_command, resolve_cluster  # noqa: E402
from sparkforge.build.pipeline import LockPolicy, load_plan  # noqa: E402
from sparkforge.recipe.layout import Layout  # noqa: E402
from sparkforge.recipe.plan import Plan  # noqa: E402

BASE = "sparkforge/base-local:bookworm"
CA = "/etc/ssl/certs/ca-certificates.crt"
VARIANT = "testvllm"
IMAGES = ROOT / "tests" / "variants"
PORT = 5443


def sparkforge(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench-distribute: build.py {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def gb(n: int) -> str:
    return deploy.human_bytes(n)


def with_record(image: images.HeadImage, state: Path) -> images.HeadImage:
    """The image with the manifest digests its pushes recorded (what containerd-store nodes show)."""
    recorded = images.read_state(state, image.repository)["manifests"].get(image.tag, [])
    return replace(image, identity=replace(image.identity, manifests=image.identity.manifests | set(recorded)))


def wipe(cluster: NetnsCluster) -> None:
    """Remove every image from every node, so that the next deploy starts cold."""
    for host in cluster.nodes:
        node = host.engine
        assert node is not None, f"{host.name} has no engine"  # every node of a started cluster has one
        ids = node.docker("images", "-qa").stdout.decode().split()
        if ids:
            node.docker("rmi", "-f", *sorted(set(ids)), check=False)
        node.docker("image", "prune", "-af")
        assert not node.docker("images", "-qa").stdout.strip(), f"{host.name} still has images"


def settle() -> None:
    """Write what the step before left in memory (a wipe's deletions, a push, a deploy) to disk, so that
    each timed step starts with nothing to flush and none pays for the one before it."""
    os.sync()


def plan_of(mods: Path | None = None) -> Plan:
    layout = Layout.default(ROOT, images_dir=IMAGES, mods_dir=mods)
    return load_plan(layout, VARIANT, base=BASE, lock_policy=LockPolicy.AUTO).plan


def store_of() -> str:
    """The image store of the engine DOCKER_HOST names (or the default one)."""
    try:
        return "containerd" if dockercli.image_store().containerd else "classic"
    except dockercli.EngineError as exc:
        sys.exit(f"bench-distribute: the engine does not answer: {exc.detail}")


def measure(store: str, cluster: NetnsCluster, nodes: tuple[Node, ...], reg: Registry, work: Path) -> dict[str, Any]:
    """Every step of the docstring from the head the environment's DOCKER_HOST names: the runs and their ratios."""
    address = reg.address
    state = work / f"state-{store}"
    rows: dict[str, dict[str, Any]] = {}  # step -> its seconds, bytes and what they were
    # BuildKit may hold several cache records for one step (one per earlier --no-cache build, say), and a
    # later build may go on from any of them; on the classic store their layers differ in their bytes. From
    # an empty build cache, the head and the mod-changed build below share one chain, as on a machine that
    # built only this image. This empties the engine's build cache: the bench says so before it does.
    # The head may hold an earlier build of the same plan (the tests make one); the bench's own build, whose
    # layers the mod-changed build goes on from, takes the tags (--move-tag), so that this build is what it sends.
    print(f"head on the {store} store: emptying its build cache (docker builder prune --all), so both builds "
          "share one chain; its builds take the variant's tags (--move-tag)")
    subprocess.run(["docker", "builder", "prune", "--all", "--force"], check=True, capture_output=True)
    sparkforge("--images", str(IMAGES), "build", VARIANT, "--base", BASE, "--ca-cert", CA, "--move-tag")
    head = images.head_image(plan_of(), state)
    counted = "compressed, on the containerd store" if store == "containerd" else "unpacked, on the classic store"
    print(f"  image {head.tag} {head.image_id[:19]}, {gb(head.size)} as the engine counts it ({counted}), "
          f"{len(head.identity.layers)} layers")

    def note(name: str, seconds: float, moved: int, what: str) -> None:
        rows[name] = {"seconds": seconds, "bytes": moved, "what": what}
        print(f"  {name:<44} {seconds:7.1f} s  {gb(moved):>10}  {what}")

    def deploy_to(name: str, targets: tuple[Node, ...], image: images.HeadImage) -> deploy.Deployment:
        settle()
        dep = deploy.deploy_registry(image, targets, reg, state_dir=state)
        bad = [f"{r.node.name}: {r.error}" for r in dep.results if r.outcome == deploy.FAILED]
        if bad:
            sys.exit(f"bench-distribute: {name} failed: {'; '.join(bad)}")
        note(name, dep.seconds, dep.bytes_moved, f"{len(dep.results)} nodes pulled "
             f"({', '.join(f'{r.node.name} {r.outcome} {r.seconds:.1f} s' for r in dep.results)})")
        return dep

    def renamed(compression: str, image: images.HeadImage) -> images.HeadImage:
        """The image under a repository of its own: each head and each kind of push starts from an empty one."""
        repo = f"bench-{store[:3]}-{compression}"
        return images.HeadImage(f"{repo}/{image.tag.partition('/')[2]}", f"{repo}/{image.moving_tag.partition('/')[2]}",
                                image.image_id, image.size, image.identity)

    wipe(cluster)
    settle()
    anchor = stream.deploy_stream(head, nodes, state_dir=state)
    if not anchor.ok:
        sys.exit(f"bench-distribute: stream failed: {[r.error for r in anchor.results if r.error]}")
    note("anchor: docker save | ssh docker load, 3 nodes", anchor.seconds, anchor.bytes_moved,
         "bytes piped into the 3 loads")
    for compression in ("gzip", "none", "zstd"):
        wipe(cluster)
        image = renamed(compression, head)
        subprocess.run(["docker", "tag", head.image_id, image.tag], check=True, capture_output=True)
        settle()
        pushed = push.push_to(image, reg, compression, state_dir=state)
        note(f"push {compression}", pushed.seconds, pushed.bytes_pushed, f"{pushed.layers_pushed} layers sent")
        image = with_record(image, state)
        if compression == "zstd":
            deploy_to(f"cold deploy from {compression}, 1 node", nodes[:1], image)
            wipe(cluster)
        deploy_to(f"cold deploy from {compression}, 3 nodes", nodes, image)
        subprocess.run(["docker", "rmi", image.tag, f"{address}/{image.tag}", f"{address}/{image.moving_tag}"],
                       capture_output=True)

    # one install-phase mod changed: rebuild (only the mod layers), push with zstd, deploy.
    mods = work / f"mods-{store}"
    shutil.copytree(ROOT / "mods", mods)
    mod = plan_of().mods_in("install")[0]
    with open(mods / mod.name / "mod.yaml", "a", encoding="utf-8") as f:
        f.write("# edited by bench-distribute: a new mod digest, hence a new tag\n")
    sparkforge("--images", str(IMAGES), "--mods", str(mods), "build", VARIANT, "--base", BASE, "--ca-cert", CA,
               "--move-tag")
    changed = renamed("zstd", images.head_image(plan_of(mods), state))
    subprocess.run(["docker", "tag", changed.image_id, changed.tag], check=True, capture_output=True)
    settle()
    pushed = push.push_to(changed, reg, "zstd", state_dir=state)
    note(f"push after mod {mod.name} changed (zstd)", pushed.seconds, pushed.bytes_pushed,
         f"{pushed.layers_pushed} layers sent, {pushed.layers_present} already there")
    after = deploy_to("deploy after one mod changed, 3 nodes", nodes, with_record(changed, state))

    r = rows
    anchor_s = r["anchor: docker save | ssh docker load, 3 nodes"]["seconds"]
    ratios = {f"first_deploy_{c}_incl_push_over_anchor":
              (r[f"push {c}"]["seconds"] + r[f"cold deploy from {c}, 3 nodes"]["seconds"]) / anchor_s
              for c in ("zstd", "gzip", "none")}
    ratios["push_zstd_over_push_gzip"] = r["push zstd"]["seconds"] / r["push gzip"]["seconds"]
    ratios["mod_change_bytes_per_node_over_image"] = after.bytes_moved / max(1, len(after.results)) / head.size
    ratios["time_3_nodes_over_1_node"] = (r["cold deploy from zstd, 3 nodes"]["seconds"]
                                          / r["cold deploy from zstd, 1 node"]["seconds"])
    print(f"ratios from the {store} head (one run, side by side):")
    print(f"  first deploy incl. push / anchor:  zstd {ratios['first_deploy_zstd_incl_push_over_anchor']:.2f}"
          f"   none {ratios['first_deploy_none_incl_push_over_anchor']:.2f}"
          f"   gzip {ratios['first_deploy_gzip_incl_push_over_anchor']:.2f}")
    default = push.default_route(dockercli.image_store())[0]
    ratios["first_deploy_default_incl_push_over_anchor"] = ratios[f"first_deploy_{default}_incl_push_over_anchor"]
    print(f"  first deploy with push's default here ({default}) / anchor = "
          f"{ratios['first_deploy_default_incl_push_over_anchor']:.2f} (target <= 0.6, goal 0.5)")
    print(f"  push zstd / push gzip = {ratios['push_zstd_over_push_gzip']:.2f}")
    share = ratios["mod_change_bytes_per_node_over_image"]
    print(f"  bytes per node after one mod change / image = {share:.5f} ({share * 100:.3f} %, target < 1 %)")
    print(f"  cold deploy 3 nodes / 1 node = {ratios['time_3_nodes_over_1_node']:.2f} (target < 1.5)")
    return {"image": head.tag, "size": head.size, "runs": rows, "ratios": ratios}


def classic_head(where: Path) -> Engine:
    """A classic-store engine of the bench's own, holding the base (sent from the machine's engine)."""
    (engine,) = start_nodes(1, where, CLASSIC, prefix="classic-head")
    save = subprocess.Popen(["docker", "save", BASE], stdout=subprocess.PIPE)
    try:
        subprocess.run(["docker", "-H", engine.endpoint, "load"], stdin=save.stdout, check=True, capture_output=True,
                       timeout=1800)
        if save.wait(timeout=60) != 0:
            sys.exit(f"bench-distribute: docker save {BASE} failed")
    except BaseException:
        save.kill()
        stop_nodes([engine], kill=True)
        engine.destroy()
        raise
    finally:
        assert save.stdout is not None
        save.stdout.close()
        save.wait(timeout=60)
    return engine


def main() -> None:
    why = missing()
    if why:
        sys.exit(f"bench-distribute: needs a namespace cluster: {why}")
    if os.environ.get("DOCKER_HOST") or store_of() != "containerd":
        sys.exit("bench-distribute: needs the machine's engine on the containerd image store, as DOCKER_HOST unset "
                 "reaches it (.ci/provision sets one up); the classic head is the bench's own")
    work = Path(tempfile.mkdtemp(prefix="sfbench-", dir="/tmp"))
    print(f"bench-distribute: variant {VARIANT} (real vLLM 0.17.0 wheel) on {BASE}; 3 ssh hosts in network "
          "namespaces (node3: containerd store), TLS registry on the head's address; from a containerd-store head "
          "(the machine's engine), then from a classic-store head of the bench's own")
    k = free_subnet()
    cluster = NetnsCluster(Path(f"/run/sfc-{k}"), k).start()
    assert cluster.head is not None  # start made it
    out: dict[str, dict[str, Any]] = {}
    reg = engine = None
    env = dict(os.environ, SPARKFORGE_STATE=str(work / "registry"))
    try:
        address = f"{cluster.head.address}:{PORT}"
        tls = make_ca(work / "tls", cluster.head.address)
        cluster.trust(address, tls["ca"])
        reg = Registry(address, address, str(tls["cert"]), str(tls["key"]), str(tls["ca"]))
        cluster.head.exec(*registry_command("start", reg), env=env, timeout=120)
        cfile = work / "cluster.yaml"
        cfile.write_text("\n".join(
            ["ssh:", f"  known_hosts: {cluster.known_hosts}", f"  identity_file: {cluster.client_key}", "nodes:"]
            + [f"  {h.name}:\n    endpoint: {h.endpoint}" for h in cluster.nodes]) + "\n")
        nodes = resolve_cluster(cfile, None, None).nodes
        out["containerd"] = measure("containerd", cluster, nodes, reg, work)
        engine = classic_head(work / "engines")
        os.environ["DOCKER_HOST"] = engine.endpoint  # every docker call below, and the builds' too
        if store_of() != "classic":
            sys.exit("bench-distribute: the bench's own engine is not on the classic store")
        out["classic"] = measure("classic", cluster, nodes, reg, work)
        os.environ.pop("DOCKER_HOST")
        print("the two heads side by side (one run; ratio: containerd / classic):")
        print(f"  {'':46} {'containerd':>11} {'classic':>9} {'ratio':>7}")
        for name, run in out["containerd"]["runs"].items():
            a, b = run["seconds"], out["classic"]["runs"][name]["seconds"]
            print(f"  {name[:42] + ' (s)':46} {a:11.1f} {b:9.1f} {a / b:7.2f}")
        print(f"  (machine: {os.cpu_count()} CPUs; the heads, the registry and all nodes share it)")
        dest = ROOT / "bench" / "out"
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "deploy.json").write_text(json.dumps(out, indent=2) + "\n")
    finally:
        os.environ.pop("DOCKER_HOST", None)
        refs = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                              text=True).stdout.split()
        mine = [ref for ref in refs if ref.startswith("bench-") or ref.startswith(f"{cluster.head.address}:")]
        if mine:
            subprocess.run(["docker", "rmi", *mine], capture_output=True)
        if engine is not None:
            stop_nodes([engine], kill=True)
            engine.destroy()
        if reg is not None:
            cluster.head.exec(*registry_command("stop", reg), env=env, timeout=60, check=False)
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
