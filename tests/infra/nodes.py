"""Extra, real dockerd daemons on this machine, used by tests as cluster "nodes".

Each node is a separate ``dockerd`` with its own ``--data-root``, ``--exec-root``,
``--pidfile``, unix socket and ``--config-file`` (so the host's /etc/docker/daemon.json
does not leak in), started with ``--iptables=false --ip6tables=false --bridge=none`` (the
sandbox has neither iptables nor a bridge).

containerd: no separate containerd has to be set up. A dockerd started without
``--containerd`` launches its own *managed* containerd, whose socket, state and pidfile live
under that dockerd's ``--exec-root`` (``EXEC/containerd/containerd.sock``) and whose content
store lives under its ``--data-root``. Distinct exec-roots therefore give one containerd per
node, fully isolated. The only catch is the unix socket path limit (108 bytes): the base dir
must be short (this module checks).

Usage::

    from tests.infra.nodes import start_nodes, stop_nodes
    nodes = start_nodes(3, "/tmp/sf-nodes")
    try:
        nodes[0].docker("info")
    finally:
        stop_nodes(nodes)

Needs root and ``dockerd`` on PATH (.ci/provision puts one there on CI). Stdlib only.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

# sockaddr_un.sun_path is 108 bytes including the NUL.
_MAX_SOCK_PATH = 107

# The image stores, said explicitly: Docker 29 turns the containerd store on by default, 28 and older off.
CLASSIC = {"features": {"containerd-snapshotter": False}}
CONTAINERD = {"features": {"containerd-snapshotter": True}}
# The older engine a realistic cluster has beside a new head: trixie's Docker 26 (.ci/provision puts it on PATH).
OLD_DOCKERD = "dockerd-26"
# Where .ci/provision keeps the engines' root file systems (each run through chroot).
ENGINES = Path(os.environ.get("SPARKFORGE_ENGINES", "/var/lib/sparkforge-engine"))


def engine_roots() -> list[Path]:
    """The root file systems the engines here run from; empty where dockerd is the machine's own."""
    try:
        return sorted(p for p in ENGINES.iterdir() if (p / "usr" / "sbin" / "dockerd").exists())
    except OSError:
        return []


def with_store(config: dict[str, Any] | None, containerd: bool) -> dict[str, Any]:
    """A daemon config with its image store said explicitly."""
    return {**(config or {}), **(CONTAINERD if containerd else CLASSIC)}
_DEFAULT_START_TIMEOUT = 60.0
_DEFAULT_STOP_TIMEOUT = 30.0


class NodeError(RuntimeError):
    """A node did not start or stop as asked."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket, enough to ask the Engine API for /_ping."""

    def __init__(self, path: str, timeout: float = 2.0):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Node:
    """One dockerd daemon with everything under ``base_dir/name``."""

    def __init__(self, name: str, base_dir: str | os.PathLike[str], daemon_config: dict[str, Any] | None = None,
                 dockerd: str = "dockerd", netns: str | None = None):
        self.name = name
        self.dir = Path(base_dir).absolute() / name
        self.data_root = self.dir / "data"
        self.exec_root = self.dir / "exec"
        self.pidfile = self.dir / "dockerd.pid"
        self.sock = str(self.dir / "docker.sock")
        self.endpoint = f"unix://{self.sock}"
        self.log_path = self.dir / "dockerd.log"
        self.config_file = self.dir / "daemon.json"
        self.daemon_config = dict(daemon_config or {})
        self.dockerd = dockerd
        self.netns = netns  # run dockerd inside this network namespace (`ip netns exec`)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        containerd_sock = self.exec_root / "containerd" / "containerd.sock"
        for path in (self.sock, str(containerd_sock)):
            if len(path.encode()) > _MAX_SOCK_PATH:
                raise NodeError(f"{name}: socket path too long for a unix socket ({len(path)} bytes): "
                                f"{path}; use a shorter base_dir")

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.endpoint!r}, up={self.is_up()})"

    # -- state ---------------------------------------------------------------------------
    def pid(self) -> int | None:
        """Pid of this node's dockerd if it is alive."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.pid
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) and "dockerd" in _cmdline(pid) else None

    def is_up(self) -> bool:
        """True when the Engine API answers /_ping on this node's socket."""
        conn = _UnixHTTPConnection(self.sock)
        try:
            conn.request("GET", "/_ping")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def processes(self) -> list[int]:
        """Pids of every process belonging to this node: dockerd, its containerd, shims.

        Found by the node's own paths on their command lines, so it also sees processes
        whose dockerd was killed (an orphaned containerd, say).
        """
        marks = (str(self.exec_root), str(self.data_root), self.sock)
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            cmd = _cmdline(int(entry))
            if any(m in cmd for m in marks):
                found.append(int(entry))
        return sorted(found)

    # -- lifecycle -----------------------------------------------------------------------
    def launch(self) -> None:
        """Start dockerd without waiting for it (see :meth:`wait_up`)."""
        if self.is_up():
            self._t0 = None  # already running: no start time to measure
            return
        if shutil.which(self.dockerd) is None:
            raise NodeError(f"{self.dockerd} not found on PATH")
        for d in (self.data_root, self.exec_root):
            d.mkdir(parents=True, exist_ok=True)
        # Own config file: otherwise dockerd reads /etc/docker/daemon.json of the host daemon.
        self.config_file.write_text(json.dumps(self.daemon_config))
        # A pidfile left by a killed dockerd makes the next one refuse to start.
        if self.pidfile.exists() and self.pid() is None:
            self.pidfile.unlink()
        # After a SIGKILLed dockerd, its managed containerd's pidfile stays. If that pid is
        # still a zombie (pid 1 here reaps late) dockerd takes it for a live containerd and
        # spends ~10 s of health checks on it before starting a new one: drop a dead pidfile.
        ctd_pidfile = self.exec_root / "containerd" / "containerd.pid"
        try:
            ctd_pid = int(ctd_pidfile.read_text().strip())
        except (OSError, ValueError):
            ctd_pid = None
        if ctd_pid is not None and not (_alive(ctd_pid) and "containerd" in _cmdline(ctd_pid)):
            ctd_pidfile.unlink(missing_ok=True)
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd = [
            *prefix,
            self.dockerd,
            "--data-root", str(self.data_root),
            "--exec-root", str(self.exec_root),
            "--pidfile", str(self.pidfile),
            "--config-file", str(self.config_file),
            "-H", self.endpoint,
            "--iptables=false", "--ip6tables=false", "--bridge=none",
        ]
        self._t0 = time.monotonic()
        with open(self.log_path, "ab") as log:  # the daemon's output; its own copy stays open
            # New session: a Ctrl-C in the test runner must not reach the daemons half-way.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout: float = _DEFAULT_START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_up():
            if self.proc is not None and self.proc.poll() is not None:
                raise NodeError(f"{self.name}: dockerd exited with {self.proc.returncode}; "
                                f"log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise NodeError(f"{self.name}: dockerd not answering after {timeout}s; "
                                f"log tail:\n{self.log_tail()}")
            time.sleep(0.1)
        t0 = getattr(self, "_t0", None)
        if t0 is not None and self.start_seconds is None:
            self.start_seconds = time.monotonic() - t0

    def start(self, timeout: float = _DEFAULT_START_TIMEOUT) -> Node:
        self.start_seconds = None
        self.launch()
        self.wait_up(timeout)
        return self

    def crash(self) -> None:
        """SIGKILL dockerd only, as a crash would; its containerd and shims are left as they are."""
        pid = self.pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid], 10.0)
        if self.proc is not None:
            self.proc.wait()
        self.proc = None

    def stop(self, kill: bool = False, timeout: float = _DEFAULT_STOP_TIMEOUT) -> None:
        """Stop the node and make sure none of its processes is left.

        kill=False: SIGTERM, dockerd shuts down its containers and its containerd.
        kill=True: SIGKILL dockerd at once. In both cases anything of this node still
        running afterwards (orphaned containerd, shims) is SIGKILLed.
        """
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
            if not _wait_gone([pid], timeout):
                os.kill(pid, signal.SIGKILL)
                _wait_gone([pid], 10.0)
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        leftovers = self.processes()
        for p in leftovers:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not _wait_gone(leftovers, 10.0):
            raise NodeError(f"{self.name}: processes still alive after stop: {self.processes()}")
        # dockerd leaves mounts under exec-root (netns) when killed; unmount so rm works.
        _umount_under(self.exec_root)
        _umount_under(self.data_root)

    def destroy(self) -> None:
        """Stop and delete everything of this node (images included)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------
    def docker(self, *args: str, check: bool = True, capture: bool = True,
               input: bytes | None = None, timeout: float | None = 600) -> subprocess.CompletedProcess[bytes]:
        """Run the docker CLI against this node."""
        env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "DOCKER_CONTEXT")}
        return subprocess.run(["docker", "-H", self.endpoint, *args], check=check,
                              capture_output=capture, input=input, timeout=timeout, env=env)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_nodes(n: int, base_dir: str | os.PathLike[str], daemon_config: dict[str, Any] | None = None,
                timeout: float = _DEFAULT_START_TIMEOUT, prefix: str = "node", dockerd: str = "dockerd") -> list[Node]:
    """Start n nodes in parallel under base_dir (prefix0..prefixN-1); all up or none. daemon_config must say
    its image store (CLASSIC or CONTAINERD, see with_store)."""
    if "containerd-snapshotter" not in (daemon_config or {}).get("features", {}):
        raise NodeError("say the nodes' image store: daemon_config=with_store(config, containerd=...)")
    nodes = [Node(f"{prefix}{i}", base_dir, daemon_config, dockerd=dockerd) for i in range(n)]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_up(timeout)
    except BaseException:
        stop_nodes(nodes)
        raise
    return nodes


def stop_nodes(nodes: list[Node], kill: bool = False) -> None:
    """Stop every node, reporting all failures at the end rather than at the first."""
    errors = []
    for node in nodes:
        try:
            node.stop(kill=kill)
        except Exception as exc:  # noqa: BLE001 - collect and re-raise below
            errors.append(f"{node.name}: {exc}")
    if errors:
        raise NodeError("; ".join(errors))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _umount_under(root: Path) -> None:
    """Lazily unmount root and every mount point below it, deepest first.

    dockerd bind-mounts parts of its roots; a killed dockerd leaves them, and the next
    start stacks another on top, so repeat until none is left.
    """
    # A chrooted dockerd (as .ci/provision runs it) makes its mounts below its engine root, where this
    # namespace sees them under the root's prefix.
    tops = [str(root)] + [str(chroot) + str(root) for chroot in engine_roots()]
    for _ in range(20):
        try:
            with open("/proc/self/mounts") as f:
                points = [line.split()[1] for line in f]
        except OSError:
            return
        mine = [p for p in points if any(p == top or p.startswith(top + "/") for top in tops)]
        if not mine:
            return
        for point in sorted(mine, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
