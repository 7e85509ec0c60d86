"""Distribution benchmark on the namespace cluster: cold deploys by stream and by registry, side by side.

In one run, on the test variant (real vLLM 0.17.0 wheel) and three ssh hosts in network
namespaces (tests/infra/netns.py; node3 on the containerd image store), with the registry on the
head's address over TLS:
  anchor  `docker save | ssh docker load` to the 3 nodes (sparkforge's stream mode);
  push    the engine's own push (gzip, one core), and sparkforge's blob push with zstd on every
          core and with no compression; each to an empty repository;
  deploy  cold registry deploys (1 node, then 3 nodes) after each kind of push;
  change  one install-phase mod changed: rebuild, push (zstd), deploy to the 3 nodes.
Bytes are what the code counted: bytes piped into each docker load, blob bytes sent by a push,
and for a pull the registry sizes of the layers each node reported downloading.
Every timed step starts after a sync, so none pays for the disk writes of the one before it
(the 3-node deploy comes right after the 1-node deploy and a wipe).
Run with `make bench-distribute` (root, Docker up, sshd installed, `make base-local`).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a script: the checkout's sparkforge and tests packages

from tests.cluster.clusterkit import make_ca  # noqa: E402
from tests.infra.netns import NetnsCluster, free_subnet, missing  # noqa: E402

from sparkforge.distribute import deploy, images, push, stream  # noqa: E402
from sparkforge.distribute.cluster import Registry, registry_command, resolve_cluster  # noqa: E402
from sparkforge.build.pipeline import LockPolicy, load_plan  # noqa: E402
from sparkforge.recipe.layout import Layout  # noqa: E402

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


def wipe(cluster) -> None:
    """Remove every image from every node, so that the next deploy starts cold."""
    for host in cluster.nodes:
        node = host.engine
        ids = node.docker("images", "-qa").stdout.decode().split()
        if ids:
            node.docker("rmi", "-f", *sorted(set(ids)), check=False)
        node.docker("image", "prune", "-af")
        assert not node.docker("images", "-qa").stdout.strip(), f"{host.name} still has images"


def settle() -> None:
    """Write what the step before left in memory (a wipe's deletions, a push, a deploy) to disk, so that
    each timed step starts with nothing to flush and none pays for the one before it."""
    os.sync()


def plan_of(mods: Path | None = None):
    layout = Layout.default(ROOT, images_dir=IMAGES, mods_dir=mods)
    return load_plan(layout, VARIANT, base=BASE, lock_policy=LockPolicy.AUTO).plan


def main() -> None:
    why = missing()
    if why:
        sys.exit(f"bench-distribute: needs a namespace cluster: {why}")
    work = Path(tempfile.mkdtemp(prefix="sfbench-", dir="/tmp"))
    print(f"bench-distribute: variant {VARIANT} (real vLLM 0.17.0 wheel) on {BASE}; 3 ssh hosts in network "
          "namespaces (node3: containerd store), TLS registry on the head's address")
    # BuildKit may hold several cache records for one step (one per earlier --no-cache build, say), and a
    # later build may go on from any of them; on the classic store their layers differ in their bytes. From
    # an empty build cache, the head and the mod-changed build below share one chain, as on a machine that
    # built only this image. This empties the engine's build cache: the bench says so before it does.
    print("  emptying the engine's build cache (docker builder prune --all), so both builds share one chain")
    subprocess.run(["docker", "builder", "prune", "--all", "--force"], check=True, capture_output=True)
    sparkforge("--images", str(IMAGES), "build", VARIANT, "--base", BASE, "--ca-cert", CA)
    head = images.head_image(plan_of(), work / "state")
    print(f"  image {head.tag} {head.image_id[:19]}, {gb(head.size)} uncompressed, {len(head.identity.layers)} layers")
    k = free_subnet()
    cluster = NetnsCluster(Path(f"/run/sfc-{k}"), k).start()
    rows: dict[str, dict] = {}
    reg = None
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
        state = work / "state"

        def note(name: str, seconds: float, moved: int, what: str) -> None:
            rows[name] = {"seconds": seconds, "bytes": moved, "what": what}
            print(f"  {name:<44} {seconds:7.1f} s  {gb(moved):>10}  {what}")

        def deploy_to(name: str, targets, image) -> deploy.Deployment:
            settle()
            dep = deploy.deploy_registry(image, targets, reg, state_dir=state)
            bad = [f"{r.node.name}: {r.error}" for r in dep.results if r.outcome == deploy.FAILED]
            if bad:
                sys.exit(f"bench-distribute: {name} failed: {'; '.join(bad)}")
            note(name, dep.seconds, dep.bytes_moved, f"{len(dep.results)} nodes pulled "
                 f"({', '.join(f'{r.node.name} {r.outcome} {r.seconds:.1f} s' for r in dep.results)})")
            return dep

        print("runs:")
        wipe(cluster)
        settle()
        anchor = stream.deploy_stream(head, nodes, state_dir=state)
        if not anchor.ok:
            sys.exit(f"bench-distribute: stream failed: {[r.error for r in anchor.results if r.error]}")
        note("anchor: docker save | ssh docker load, 3 nodes", anchor.seconds, anchor.bytes_moved,
             "bytes piped into the 3 loads")
        for compression in ("gzip", "none", "zstd"):
            wipe(cluster)
            repo_image = head  # every kind of push goes to an empty repository of its own
            image = images.HeadImage(f"bench-{compression}/{head.tag.partition('/')[2]}",
                                         f"bench-{compression}/{head.moving_tag.partition('/')[2]}",
                                         repo_image.image_id, repo_image.size, repo_image.identity)
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
        zimage = with_record(images.HeadImage(
            f"bench-zstd/{head.tag.partition('/')[2]}", f"bench-zstd/{head.moving_tag.partition('/')[2]}",
            head.image_id, head.size, head.identity), state)

        # one install-phase mod changed: rebuild (only the mod layers), push with zstd, deploy.
        mods = work / "mods"
        shutil.copytree(ROOT / "mods", mods)
        mod = plan_of().mods_in("install")[0]
        with open(mods / mod.name / "mod.yaml", "a", encoding="utf-8") as f:
            f.write("# edited by bench-distribute: a new mod digest, hence a new tag\n")
        sparkforge("--images", str(IMAGES), "--mods", str(mods), "build", VARIANT, "--base", BASE, "--ca-cert", CA)
        built = images.head_image(plan_of(mods), state)
        changed = images.HeadImage(f"bench-zstd/{built.tag.partition('/')[2]}", zimage.moving_tag,
                                       built.image_id, built.size, built.identity)
        subprocess.run(["docker", "tag", built.image_id, changed.tag], check=True, capture_output=True)
        settle()
        pushed = push.push_to(changed, reg, "zstd", state_dir=state)
        note(f"push after mod {mod.name} changed (zstd)", pushed.seconds, pushed.bytes_pushed,
             f"{pushed.layers_pushed} layers sent, {pushed.layers_present} already there")
        changed = with_record(changed, state)
        after = deploy_to("deploy after one mod changed, 3 nodes", nodes, changed)

        r = rows
        first = r["push zstd"]["seconds"] + r["cold deploy from zstd, 3 nodes"]["seconds"]
        first_gzip = r["push gzip"]["seconds"] + r["cold deploy from gzip, 3 nodes"]["seconds"]
        first_none = r["push none"]["seconds"] + r["cold deploy from none, 3 nodes"]["seconds"]
        base_s = r["anchor: docker save | ssh docker load, 3 nodes"]["seconds"]
        per_node = after.bytes_moved / max(1, len(after.results))
        t31 = r["cold deploy from zstd, 3 nodes"]["seconds"] / r["cold deploy from zstd, 1 node"]["seconds"]
        ratios = {
            "first_deploy_zstd_incl_push_over_anchor": first / base_s,
            "first_deploy_gzip_incl_push_over_anchor": first_gzip / base_s,
            "first_deploy_none_incl_push_over_anchor": first_none / base_s,
            "push_zstd_over_push_gzip": r["push zstd"]["seconds"] / r["push gzip"]["seconds"],
            "mod_change_bytes_per_node_over_image": per_node / head.size,
            "time_3_nodes_over_1_node": t31,
        }
        print("ratios (one run, side by side):")
        print(f"  first deploy incl. push / anchor:  zstd {ratios['first_deploy_zstd_incl_push_over_anchor']:.2f}"
              f"   none {ratios['first_deploy_none_incl_push_over_anchor']:.2f}"
              f"   gzip {ratios['first_deploy_gzip_incl_push_over_anchor']:.2f}   (target <= 0.8)")
        print(f"  push zstd / push gzip = {ratios['push_zstd_over_push_gzip']:.2f}")
        print(f"  bytes per node after one mod change / image = {ratios['mod_change_bytes_per_node_over_image']:.5f}"
              f" ({ratios['mod_change_bytes_per_node_over_image'] * 100:.3f} %, target < 1 %)")
        print(f"  cold deploy 3 nodes / 1 node = {t31:.2f} (target < 1.5)")
        print(f"  (machine: {os.cpu_count()} CPUs; the head, the registry and all nodes share it)")
        out = ROOT / "bench" / "out"
        out.mkdir(parents=True, exist_ok=True)
        (out / "deploy.json").write_text(json.dumps({"image": head.tag, "size": head.size, "runs": rows,
                                                         "ratios": ratios}, indent=2) + "\n")
    finally:
        refs = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                              text=True).stdout.split()
        mine = [ref for ref in refs if ref.startswith("bench-") or ref.startswith(f"{cluster.head.address}:")]
        if mine:
            subprocess.run(["docker", "rmi", *mine], capture_output=True)
        if reg is not None:
            cluster.head.exec(*registry_command("stop", reg), env=env, timeout=60, check=False)
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
