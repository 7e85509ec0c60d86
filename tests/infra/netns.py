"""A cluster of hosts that are hosts: network namespaces on a private bridge, each with its own engine and sshd.

Layout (ADDR = 10.213.K.0/24, K picked per cluster so two clusters do not meet)::

    root namespace ── bridge sfbr<K> (.254) ──┬── head   (.1)   the registry of the cluster
                                              ├── node1  (.11)  dockerd + sshd
                                              ├── node2  (.12)  dockerd + sshd
                                              └── node3  (.13)  dockerd + sshd  (one may use the containerd store)

A namespace has no route but its /24: traffic goes only to loopback and these hosts. Every
sshd has its own host key, key auth only, and ``SetEnv DOCKER_HOST=unix://<that node's socket>``,
so ``ssh root@ADDR -p 2222 docker …`` (and ``docker -H ssh://root@ADDR:2222``) reaches that
node's engine. The cluster writes the client key and a known_hosts with every host key.

The root namespace keeps the machine's engine (the one that builds), which reaches the hosts
over the bridge. :meth:`NetnsCluster.close` stops every process and removes every namespace,
link and file it made, also after a failure half-way through :meth:`start`.

Needs root, ``ip netns``, ``/usr/sbin/sshd`` and ``dockerd``; :func:`missing` says which is absent.
Stdlib only.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from tests.infra.nodes import OLD_DOCKERD, Node, NodeError, _alive, engine_roots, with_store

SSHD = "/usr/sbin/sshd"
SSH_PORT = 2222


def missing() -> str | None:
    """Why a namespace cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge, sshd)"
    for tool, why in ((shutil.which("ip"), "ip (iproute2)"), (shutil.which("dockerd"), "dockerd"),
                      (shutil.which(OLD_DOCKERD), f"{OLD_DOCKERD} (the older engine of one node; .ci/provision)"),
                      (shutil.which("docker"), "the docker CLI"), (shutil.which("ssh"), "ssh"),
                      (shutil.which("ssh-keygen"), "ssh-keygen")):
        if tool is None:
            return f"{why} is not installed"
    if not os.access(SSHD, os.X_OK):
        return "sshd is not installed (apt-get install -y openssh-server)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def engine_certs_dirs() -> list[Path]:
    """The certs.d folders the engines here read: each engine root's (they run chrooted, as .ci/provision
    runs them), or the machine's own."""
    return [root / "etc" / "docker" / "certs.d" for root in engine_roots() or [Path("/")]]


def run(*argv: str, timeout: float = 30, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc


@dataclass
class Host:
    """One namespace of the cluster: its address, and on nodes its engine and sshd."""

    name: str
    netns: str
    address: str
    dir: Path
    engine: Node | None = None
    sshd: subprocess.Popen[bytes] | None = None
    host_key: str = ""  # the public host key line, as known_hosts wants it after the host

    @property
    def endpoint(self) -> str:
        return f"ssh://root@{self.address}:{SSH_PORT}"

    @property
    def known_hosts_line(self) -> str:
        return f"[{self.address}]:{SSH_PORT} {self.host_key}"

    def sshd_pid(self) -> int | None:
        return self.sshd.pid if self.sshd is not None and self.sshd.poll() is None else None

    def stop_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()

    def exec(self, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host's namespace."""
        return run("ip", "netns", "exec", self.netns, *argv, **kw)


@dataclass
class NetnsCluster:
    """A head and nodes in namespaces; see the module docstring."""

    base: Path
    subnet: int  # K of 10.213.K.0/24
    # Each node's engine and image store, as a cluster of Sparks may have them: (dockerd on PATH, containerd
    # store). node1 the head's Docker on the classic store, node2 an older Docker (26, classic), node3 the
    # head's Docker on the containerd store.
    engines: dict[int, tuple[str, bool]] = field(default_factory=lambda: {1: ("dockerd", False),
                                                                          2: (OLD_DOCKERD, False),
                                                                          3: ("dockerd", True)})
    count: int = 3
    head: Host | None = None
    nodes: list[Host] = field(default_factory=list)
    made: list[tuple[str, str]] = field(default_factory=list)  # what to undo, in order made
    certs: list[Path] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"sfbr{self.subnet}"

    @property
    def client_key(self) -> Path:
        return self.base / "client" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.base / "client" / "known_hosts"

    def addr(self, last: int) -> str:
        return f"10.213.{self.subnet}.{last}"

    # -- start -------------------------------------------------------------------------------
    def start(self) -> NetnsCluster:
        try:
            self._network()
            self._client()
            for host in self.nodes:
                self._engine(host)
            for host in self.nodes:
                assert host.engine is not None
                host.engine.wait_up(90)
                self._sshd(host)
            self.known_hosts.write_text("".join(h.known_hosts_line + "\n" for h in self.nodes))
            for host in self.nodes:
                self._wait_ssh(host)
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        run("ip", "addr", "add", f"{self.addr(254)}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        hosts = [("head", 1)] + [(f"node{i}", 10 + i) for i in range(1, self.count + 1)]
        for name, last in hosts:
            ns = f"sf{self.subnet}-{name}"
            run("ip", "netns", "add", ns)
            self.made.append(("netns", ns))
            outer, inner = f"sfv{self.subnet}{name[0]}{last}", "eth0"
            run("ip", "link", "add", outer, "type", "veth", "peer", "name", f"{outer}p")
            self.made.append(("link", outer))
            run("ip", "link", "set", f"{outer}p", "netns", ns)
            run("ip", "link", "set", outer, "master", self.bridge, "up")
            run("ip", "netns", "exec", ns, "ip", "link", "set", f"{outer}p", "name", inner)
            run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr(last)}/24", "dev", inner)
            run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            host = Host(name, ns, self.addr(last), self.base / name)
            host.dir.mkdir(parents=True, exist_ok=True)
            if name == "head":
                self.head = host
            else:
                self.nodes.append(host)

    def _client(self) -> None:
        (self.base / "client").mkdir(mode=0o700, exist_ok=True)
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sparkforge-test-client", "-f", str(self.client_key))

    def _engine(self, host: Host) -> None:
        dockerd, containerd = self.engines.get(int(host.name.removeprefix("node")), ("dockerd", False))
        config = with_store({"max-download-attempts": 1}, containerd)
        host.engine = Node("engine", host.dir, config, dockerd=dockerd, netns=host.netns)
        host.engine.launch()

    def _sshd(self, host: Host) -> None:
        d = host.dir / "ssh"
        d.mkdir(mode=0o700, exist_ok=True)
        key = d / "host_ed25519"
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", str(key))
        host.host_key = " ".join(Path(f"{key}.pub").read_text().split()[:2])
        auth = d / "authorized_keys"
        auth.write_text(Path(f"{self.client_key}.pub").read_text())
        auth.chmod(0o600)
        assert host.engine is not None
        (d / "sshd_config").write_text("\n".join([
            f"ListenAddress {host.address}:{SSH_PORT}",
            f"HostKey {key}",
            f"PidFile {d / 'sshd.pid'}",
            f"AuthorizedKeysFile {auth}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "AllowUsers root",
            # This host's engine: the filesystem is shared, so DOCKER_HOST tells the hosts apart.
            f"SetEnv DOCKER_HOST={host.engine.endpoint}",
            "LogLevel VERBOSE",
            "",
        ]))
        self._spawn_sshd(host)

    def _spawn_sshd(self, host: Host) -> None:
        d = host.dir / "ssh"
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        with open(d / "sshd.log", "ab") as log:  # the daemon's output; its own copy stays open
            host.sshd = subprocess.Popen(["ip", "netns", "exec", host.netns, SSHD, "-D", "-e", "-f",
                                          str(d / "sshd_config")], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def start_sshd(self, host: Host) -> None:
        """Start a host's sshd again (after a test stopped it)."""
        self._spawn_sshd(host)
        self._wait_ssh(host)

    def ssh(self, host: Host, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command on a host over ssh, as a user would (keys and known_hosts of this cluster)."""
        return run("ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o",
                   f"UserKnownHostsFile={self.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
                   "-i", str(self.client_key), "-o", "IdentitiesOnly=yes", "-p", str(SSH_PORT),
                   f"root@{host.address}", "--", " ".join(shlex.quote(c) for c in command), timeout=timeout,
                   check=False)

    def _wait_ssh(self, host: Host, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.ssh(host, "docker", "version", "--format", "{{.Server.Version}}", timeout=15)
            if proc.returncode == 0:
                return
            if host.sshd is not None and host.sshd.poll() is not None:
                raise NodeError(f"{host.name}: sshd exited: {(host.dir / 'ssh' / 'sshd.log').read_text()[-600:]}")
            if time.monotonic() > deadline:
                raise NodeError(f"{host.name}: no docker over ssh after {timeout}s: {proc.stderr.strip()[-300:]}")
            time.sleep(0.2)

    # -- registry trust ------------------------------------------------------------------------
    def trust(self, address: str, ca: Path) -> None:
        """Make every engine here (the machine's and the nodes', one chroot) trust a registry's CA."""
        for certs in engine_certs_dirs():
            d = certs / address
            d.mkdir(parents=True, exist_ok=True)
            shutil.copy(ca, d / "ca.crt")
            self.certs.append(d)

    # -- stop ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop everything and remove every namespace, link, certs.d entry and file; report leftovers."""
        problems = []
        for host in self.nodes:
            host.stop_sshd()
            if host.engine is not None:
                try:
                    host.engine.stop(kill=True)
                except NodeError as exc:
                    problems.append(str(exc))
        for kind, name in reversed(self.made):
            if kind == "netns":
                for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _wait(lambda n=name: not run("ip", "netns", "pids", n, check=False).stdout.split(), 10)
                run("ip", "netns", "del", name, check=False)
            else:
                run("ip", "link", "del", name, check=False)
        self.made.clear()
        for d in self.certs:
            shutil.rmtree(d, ignore_errors=True)
        self.certs.clear()
        shutil.rmtree(self.base, ignore_errors=True)
        if problems:
            raise NodeError("; ".join(problems))

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (empty after close)."""
        found = [ns for ns in run("ip", "netns", "list").stdout.split() if ns.startswith(f"sf{self.subnet}-")]
        # Whole names: another cluster's subnet may begin with this one's digits (sfbr1 and sfbr142).
        names = {line.split(":")[1].strip().split("@")[0] for line in run("ip", "-o", "link", "show").stdout.splitlines()
                 if line.count(":") >= 2}
        found += [f"link {name}" for name in sorted(names)
                  if name == self.bridge or re.fullmatch(rf"sfv{self.subnet}[a-z]\d+p?", name)]
        found += [f"pid {p}" for h in self.nodes if h.engine for p in h.engine.processes() if _alive(p)]
        return found


# `...`: check is called with no argument, but mypy cannot match a lambda that binds a loop variable by a
# default (close's) to Callable[[], bool] (python/mypy#15459).
def _wait(check: Callable[..., bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def free_subnet() -> int:
    """A K for 10.213.K.0/24 whose bridge does not exist yet."""
    links = run("ip", "-o", "link", "show").stdout
    for k in range(1 + os.getpid() % 200, 255):
        if f" sfbr{k}:" not in links and f" sfbr{k}@" not in links:
            return k
    raise NodeError("no free 10.213.K.0/24 for a namespace cluster")
