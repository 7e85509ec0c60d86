"""Distribution benchmark: bytes moved and wall time to put one image on three real nodes.

In one run, on the test variant (real vLLM 0.17.0 wheel) and three extra dockerd nodes:
  1. the peer approach: a full `docker save | docker load` to each node (sparkforge's stream mode);
  2. a cold deploy through a registry;
  3. a deploy after one install-phase mod changed (rebuild, push, deploy).
Plus a cold registry deploy to one node, to compare with run 2's three nodes.

Bytes are measured, not computed: a counting TCP proxy on loopback sits in front of the registry
(every push and pull goes through it), and stream mode counts the bytes it pipes into each
`docker load`. Run with `make bench-distribute` (root, Docker up, `make base-local`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "infra"))

from nodes import start_nodes, stop_nodes  # noqa: E402

from sparkforge import distribute  # noqa: E402
from sparkforge.cluster import Node  # noqa: E402
from sparkforge.plan import Layout, plan_variant  # noqa: E402

BASE = "sparkforge/base-local:bookworm"
CA = "/etc/ssl/certs/ca-certificates.crt"
VARIANT = "testvllm"
IMAGES = ROOT / "tests" / "variants"


class CountingProxy:
    """A TCP relay on 127.0.0.1 that counts the bytes it carries in each direction."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.to_registry = 0  # bytes sent by clients (pushes)
        self.from_registry = 0  # bytes sent back to clients (pulls)
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.to_registry, self.from_registry

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_registry: bool) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(view[:n])
                with self._lock:
                    if to_registry:
                        self.to_registry += n
                    else:
                        self.from_registry += n
        except OSError:
            pass
        finally:
            for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    s.shutdown(how)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sparkforge(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench-distribute: build.py {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def wipe(node) -> None:
    """Remove every image from a node, so that the next deploy starts cold."""
    ids = node.docker("images", "-qa").stdout.decode().split()
    if ids:
        node.docker("rmi", "-f", *sorted(set(ids)), check=False)
    node.docker("image", "prune", "-af")
    assert not node.docker("images", "-qa").stdout.strip(), f"{node.name} still has images"


def gb(n: int) -> str:
    return distribute.human_bytes(n)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="sfbench-", dir="/tmp"))
    state = work / "state"
    reg_port = free_port()
    env_state = {"SPARKFORGE_STATE": str(state)}
    registry_sh = ["bash", str(ROOT / "scripts" / "registry.sh")]

    env = dict(os.environ, **env_state)
    pushed_refs: list[str] = []
    print(f"bench-distribute: variant {VARIANT} (real vLLM 0.17.0 wheel) on {BASE}, 3 dockerd nodes")
    # BuildKit can hold several cache records for one step (one per earlier --no-cache build, for
    # instance), and a later build may continue from any of them; the classic image store cannot
    # make those layers bit-identical. Start from an empty build cache, so that the head and the
    # mod-changed build of run 3 share one chain, as on a machine that built only this image.
    subprocess.run(["docker", "builder", "prune", "--all", "--force"], check=True, capture_output=True)
    sparkforge("--images", str(IMAGES), "build", VARIANT, "--base", BASE, "--ca-cert", CA)
    layout = Layout.default(ROOT, images_dir=IMAGES)
    head = distribute.head_image(plan_variant(layout, VARIANT, base=BASE))
    print(f"  image {head.tag} {head.image_id[:19]}, {gb(head.size)} uncompressed")

    subprocess.run([*registry_sh, "start", str(reg_port)], check=True, env=env, capture_output=True)
    proxy = CountingProxy(reg_port)
    registry = f"127.0.0.1:{proxy.port}"
    nodes = start_nodes(3, work / "n")
    targets = [Node(n.name, n.endpoint) for n in nodes]
    rows: list[dict] = []

    def record(name: str, deployment: distribute.Deployment, measured: int, what: str) -> dict:
        bad = [r for r in deployment.results if r.outcome == distribute.FAILED]
        if bad:
            sys.exit(f"bench-distribute: {name} failed on {', '.join(r.node.name + ': ' + str(r.error) for r in bad)}")
        row = {"run": name, "nodes": len(deployment.results), "bytes": measured, "seconds": deployment.seconds,
               "measured_by": what, "engine_reported_bytes": deployment.bytes_moved,
               "outcomes": [r.outcome for r in deployment.results]}
        rows.append(row)
        print(f"  {name:<34} {gb(measured):>10} moved  {deployment.seconds:7.1f} s  "
              f"({len(deployment.results)} nodes; {what})")
        return row

    try:
        print("runs:")
        # 1. the peer approach: the whole image, saved once, piped into every node's docker load.
        peer = distribute.deploy_stream(head, targets)
        # Stream mode counts exactly the bytes it writes into each node's docker load.
        run1 = record("1 peer: docker save | docker load", peer, peer.bytes_moved, "bytes piped into docker load")
        print(f"    ({run1['bytes'] / 3 / 1e9:.2f} GB per node)")
        for node in nodes:
            wipe(node)

        up0, _ = proxy.counts()
        t0 = time.monotonic()
        pushed = distribute.push_image(head, registry)
        pushed_refs.extend(pushed.refs)
        up1, _ = proxy.counts()
        print(f"  push (not a deploy run)            {gb(up1 - up0):>10} sent   {time.monotonic() - t0:7.1f} s  "
              f"({pushed.layers_pushed} layers; measured at the proxy)")

        # Cold deploy to one node, for the 3-vs-1 time ratio.
        _, d0 = proxy.counts()
        one = distribute.deploy_registry(head, targets[:1], registry)
        _, d1 = proxy.counts()
        single = record("cold registry deploy, 1 node", one, d1 - d0, "measured at the proxy")
        wipe(nodes[0])

        # 2. cold deploy through the registry to all three.
        _, d0 = proxy.counts()
        dep = distribute.deploy_registry(head, targets, registry)
        _, d1 = proxy.counts()
        run2 = record("2 cold registry deploy", dep, d1 - d0, "measured at the proxy")

        # 3. one install-phase mod changed: rebuild (only the mod layers), push, deploy.
        mods = work / "mods"
        shutil.copytree(ROOT / "mods", mods)
        plan = plan_variant(layout, VARIANT, base=BASE)
        mod = plan.mods_in("install")[0]
        with open(mods / mod.name / "mod.yaml", "a", encoding="utf-8") as f:
            f.write("# edited by bench-distribute: a new mod digest, hence a new tag\n")
        sparkforge("--images", str(IMAGES), "--mods", str(mods), "build", VARIANT, "--base", BASE, "--ca-cert", CA)
        changed = distribute.head_image(plan_variant(Layout.default(ROOT, images_dir=IMAGES, mods_dir=mods),
                                                     VARIANT, base=BASE))
        assert changed.image_id != head.image_id
        up0, _ = proxy.counts()
        pushed_refs.extend(distribute.push_image(changed, registry).refs)
        up1, d0 = proxy.counts()
        dep = distribute.deploy_registry(changed, targets, registry)
        _, d1 = proxy.counts()
        print(f"    (mod {mod.name} changed: push sent {gb(up1 - up0)}; new image {changed.image_id[:19]})")
        run3 = record("3 deploy after one mod changed", dep, d1 - d0, "measured at the proxy")
        ids = {n.docker("image", "inspect", "--format", "{{.Id}}", changed.moving_tag).stdout.decode().strip()
               for n in nodes}
        print(f"    every node's {changed.moving_tag} = {', '.join(sorted(i[:19] for i in ids))}")

        r31 = run3["bytes"] / run1["bytes"]
        r21 = run2["bytes"] / run1["bytes"]
        t31 = run2["seconds"] / single["seconds"]
        print("ratios:")
        print(f"  bytes run3/run1 = {r31:.5f} ({r31 * 100:.3f} %)   target < 1 %: {'met' if r31 < 0.01 else 'NOT met'}")
        print(f"  bytes run2/run1 = {r21:.3f}")
        print(f"  time  3 nodes / 1 node (cold registry deploy) = {t31:.2f}   "
              f"target < 1.5: {'met' if t31 < 1.5 else 'NOT met'}")
        print(f"  (machine: {os.cpu_count()} CPUs; all nodes and the registry share it)")
        out = ROOT / "bench" / "out"
        out.mkdir(parents=True, exist_ok=True)
        (out / "distribute.json").write_text(json.dumps(
            {"image": head.tag, "runs": rows, "ratios": {"bytes_run3_run1": r31, "bytes_run2_run1": r21,
                                                         "time_3_nodes_1_node": t31}}, indent=2) + "\n")
        subprocess.run(["docker", "rmi", changed.tag, changed.moving_tag], capture_output=True)
        # the test variant's moving tag goes back to the image it had before run 3
        subprocess.run(["docker", "tag", head.image_id, head.moving_tag], capture_output=True)
    finally:
        if pushed_refs:  # the head keeps no tags of a registry that is about to go away
            subprocess.run(["docker", "rmi", *pushed_refs], capture_output=True)
        try:
            stop_nodes(nodes)
        finally:
            for node in nodes:
                node.destroy()
            proxy.close()
            subprocess.run([*registry_sh, "stop", str(reg_port)], env=env, capture_output=True)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
