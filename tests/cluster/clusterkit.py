"""Helpers of the namespace-cluster tests: a test CA, and the docker CLI on a host's own engine."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only
    from tests.infra.netns import Host, NetnsCluster
    from tests.support.docker import BuiltImage

REGISTRY_PORT = 5443
OLD = "sparkforge-test/old:1"
VARIANT = "testsmall"  # what the cluster tests move (tests/variants); the path is the same for any image


def make_ca(d: Path, address: str) -> dict[str, Path]:
    """A test CA and a registry certificate for address (an IP), made with openssl."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (d / n for n in ("ca.key", "ca.crt", "registry.key", "registry.csr",
                                                    "registry.crt"))
    ext = d / "san.ext"
    ext.write_text(f"subjectAltName=IP:{address}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
    for argv in (
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
         "-days", "2", "-subj", "/CN=sparkforge test CA"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
         "-subj", f"/CN={address}"],
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-out", str(cert), "-days", "2", "-extfile", str(ext)],
    ):
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return {"ca": ca, "cert": cert, "key": key}


def node_docker(cluster: NetnsCluster, host: Host, *args: str,
                input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """The docker CLI on a host's own engine, over the unix socket (no ssh involved)."""
    assert host.engine is not None, f"{host.name} has no engine"  # every node of a started cluster has one
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "DOCKER_CONTEXT")}
    return subprocess.run(["docker", "-H", host.engine.endpoint, *args], capture_output=True, input=input,
                          timeout=300, env=env)


def make_stale(cluster: NetnsCluster, host: Host, test_image: BuiltImage) -> str:
    """Remove the test image from a host and put its moving tag on a tiny older image; its ID."""
    for ref in (test_image.tag, test_image.moving_tag):
        node_docker(cluster, host, "rmi", "-f", ref)
    node_docker(cluster, host, "image", "prune", "-af")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = f"old image of {host.name}\n".encode()
        info = tarfile.TarInfo("old.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    node_docker(cluster, host, "import", "-", OLD, input=buf.getvalue())
    node_docker(cluster, host, "tag", OLD, test_image.moving_tag)
    ident = node_id(cluster, host, test_image.moving_tag)
    assert ident is not None, f"{test_image.moving_tag} missing on {host.name} after tagging it"
    return ident


def node_id(cluster: NetnsCluster, host: Host, ref: str) -> str | None:
    proc = node_docker(cluster, host, "image", "inspect", "--format", "{{.Id}}", ref)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None
