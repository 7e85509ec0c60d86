"""The cluster file's registry and ssh sections, and the one-line reasons of an ssh failure (pure logic).

The ssh messages are the ones OpenSSH 9.2 printed in the namespace-cluster tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkforge.distribute.cluster import Node, SshOptions, resolve_cluster
from sparkforge.distribute.nodes import ssh_argv, transport_error
from sparkforge.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


NODES = "nodes:\n  a:\n    endpoint: ssh://root@10.0.0.11:2222\n"


@pytest.mark.parametrize("registry, expected", [
    ("registry:\n  address: 10.0.0.1:5000\n", "registry: 10.0.0.1:5000 is not a loopback address"),
    ("registry:\n  address: 10.0.0.1:5000\n  insecure: true\n  tls: {cert: c, key: k, ca: a}\n",
     "either tls: or insecure: true"),
    ("registry:\n  address: 10.0.0.1:5000\n  listen: everywhere\n", "registry.listen"),
    ("registry:\n  address: 10.0.0.1:5000\n  tls: {cert: nope.crt, key: k, ca: a}\n",
     "registry.tls.cert: file not found"),
    ("ssh:\n  connect_timeout: 0\n", "ssh.connect_timeout"),
])
def test_bad_registry_or_ssh_sections_name_the_file_and_field(tmp_path, registry, expected) -> None:
    path = write(tmp_path, registry + NODES)
    with pytest.raises(ConfigError) as err:
        resolve_cluster(path, None, None)
    line = str(err.value)
    assert "cluster.yaml" in line and expected in line, line
    assert "\n" not in line


def test_a_tls_registry_resolves_paths_beside_the_file_and_listens_everywhere(tmp_path) -> None:
    for name in ("r.crt", "r.key", "ca.crt", "known"):
        (tmp_path / name).write_text("x")
    path = write(tmp_path, "registry:\n  address: 10.0.0.1:5000\n  tls: {cert: r.crt, key: r.key, ca: ca.crt}\n"
                           "ssh:\n  known_hosts: known\n  connect_timeout: 4\n" + NODES)
    cluster = resolve_cluster(path, None, None)
    reg = cluster.registry_spec
    assert reg is not None and reg.listen == "0.0.0.0:5000" and reg.ca == str(tmp_path / "ca.crt")
    assert reg.url == "https://10.0.0.1:5000"
    assert cluster.nodes[0].ssh == SshOptions(str(tmp_path / "known"), None, 4)


def test_ssh_never_prompts_and_checks_host_keys() -> None:
    argv = ssh_argv(Node("a", "ssh://admin@10.0.0.11:2222", SshOptions("/k/known", "/k/id", 7)))
    pairs = {argv[i + 1] for i, a in enumerate(argv) if a == "-o"}
    assert {"BatchMode=yes", "StrictHostKeyChecking=yes", "ConnectTimeout=7", "UserKnownHostsFile=/k/known",
            "IdentitiesOnly=yes"} <= pairs
    assert not any("StrictHostKeyChecking=no" in a or "accept-new" in a for a in argv)
    assert argv[-4:] == ["-l", "admin", "--", "10.0.0.11"] and argv[argv.index("-p") + 1] == "2222"


@pytest.mark.parametrize("code, stderr, expected", [
    (255, "Host key verification failed.\r\n", "host key of root@10.0.0.11:2222 is unknown or changed"),
    (255, "ssh: connect to host 10.0.0.11 port 2222: Connection refused\r\n",
     "unreachable at ssh://root@10.0.0.11:2222: connection refused"),
    (255, "ssh: connect to host 10.0.0.11 port 2222: Connection timed out\r\n", "timed out"),
    (255, "root@10.0.0.11: Permission denied (publickey).\r\n", "refused the login"),
    (127, "bash: line 1: docker: command not found\n", "no docker CLI on root@10.0.0.11:2222"),
    (1, "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?\n",
     "the Docker engine does not answer"),
    (1, "Error response from daemon: No such image: x:1\n", None),
    # The words of each docker client release, quoted from moby's client/request.go: up to 28 (v28.5.2) ...
    (1, "permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock: "
        "Get \"http://%2Fvar%2Frun%2Fdocker.sock/v1.51/version\": dial unix /var/run/docker.sock: connect: "
        "permission denied\n", "no permission to use the Docker engine at ssh://root@10.0.0.11:2222"),
    # ... and from 29 (docker-v29.1.0): a socket it may not use, a socket that is not there, a host that does
    # not resolve, and an engine that refuses the connection.
    (1, "permission denied while trying to connect to the docker API at unix:///var/run/docker.sock\n",
     "no permission to use the Docker engine at ssh://root@10.0.0.11:2222"),
    (1, "failed to connect to the docker API at unix:///var/run/docker.sock; check if the path is correct and if "
        "the daemon is running: dial unix /var/run/docker.sock: connect: no such file or directory\n",
     "the Docker engine does not answer"),
    (1, "failed to connect to the docker API at tcp://node9:2375: lookup node9: no such host\n",
     "the Docker engine does not answer"),
    (1, "Cannot connect to the Docker daemon at tcp://10.0.0.11:2375. Is the docker daemon running?\n",
     "the Docker engine does not answer"),
])
def test_ssh_failures_become_one_line_per_node(code, stderr, expected) -> None:
    reason = transport_error(Node("a", "ssh://root@10.0.0.11:2222"), code, stderr)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason and "\n" not in reason, reason


# ---------------------------------------------------------------- every value has its full rule


@pytest.mark.parametrize("endpoint, words", [
    ('"ssh://node1\\n"', "is not a Docker endpoint"),
    ('"tcp://node4:2375\\n"', "is not a Docker endpoint"),
    ("ssh://spark2:99999", "port 99999 is not one of 1-65535"),
    ("ssh://spark2:0", "port 0 is not one of 1-65535"),
    ("tcp://spark2:02375", "port 02375 is not one of 1-65535"),
    ("ssh://010.0.0.11", "'010.0.0.11' is not an IPv4 address"),
    ("ssh://-oProxyCommand=x", "is not a Docker endpoint"),
    ("ssh://-l@spark2", "is not a Docker endpoint"),
    ("unix:///run/../tmp/docker.sock", "without '.' or '..'"),
    ("unix:///run//docker.sock", "is not a Docker endpoint"),
])
def test_an_endpoint_that_cannot_be_one_names_the_file_and_the_node(tmp_path, endpoint, words) -> None:
    path = write(tmp_path, f"nodes:\n  a:\n    endpoint: {endpoint}\n")
    with pytest.raises(ConfigError) as err:
        resolve_cluster(path, None, None)
    line = str(err.value)
    assert line.startswith(f"{path}: nodes.a.endpoint: ") or "cluster.yaml: nodes.a.endpoint: " in line, line
    assert words in line and "\n" not in line, line


@pytest.mark.parametrize("section, field", [
    ('registry: "10.0.0.1:5000\\n"\n', "registry"),
    ("registry: 10.0.0.1:0\n", "registry"),
    ("registry: 10.0.0.1:65536\n", "registry"),
    ("registry:\n  address: 10.0.0.1:5000\n  insecure: true\n  listen: 0.0.0.0:70000\n", "registry.listen"),
    ("registry:\n  address: 10.0.0.1:5000\n  insecure: true\n  listen: 0.0.0.0:05000\n", "registry.listen"),
    ("ssh:\n  known_hosts: my hosts\n", "ssh.known_hosts"),
    ('ssh:\n  identity_file: "id\\nx"\n', "ssh.identity_file"),
    ('registry:\n  address: 10.0.0.1:5000\n  tls: {cert: "r.crt\\n", key: k, ca: a}\n', "registry.tls.cert"),
])
def test_a_registry_or_ssh_value_that_cannot_be_right_is_refused(tmp_path, section, field) -> None:
    for name in ("my hosts", "id\nx", "r.crt\n", "k", "a"):  # the files exist: only the value's rule refuses them
        (tmp_path / name).write_text("x")
    path = write(tmp_path, section + NODES)
    with pytest.raises(ConfigError) as err:
        resolve_cluster(path, None, None)
    assert f"cluster.yaml: {field}" in str(err.value) or f"{path}: {field}" in str(err.value), str(err.value)


def test_a_registry_option_with_a_line_break_or_a_port_out_of_range_is_refused(tmp_path) -> None:
    for value in ("127.0.0.1:5000\n", "127.0.0.1:0", "127.0.0.1:123456"):
        with pytest.raises(ConfigError, match="--registry"):
            resolve_cluster(write(tmp_path, NODES), None, value)


# Spellings of one engine: ssh's host in any case, with or without a user, with or without port 22.
HOSTS = st.sampled_from(["spark2", "node-1.lan", "10.0.0.12"])


@st.composite
def ssh_spelling(draw, host: str, port: str | None = None) -> str:
    cased = "".join(c.upper() if draw(st.booleans()) else c for c in host)
    user = draw(st.sampled_from(["", "root@", "admin@"]))
    shown_port = port if port is not None else draw(st.sampled_from(["", ":22"]))
    return f"ssh://{user}{cased}{shown_port}"


@given(data=st.data(), host=HOSTS)
@settings(max_examples=60, deadline=None)
def test_one_engine_is_one_node_however_its_endpoint_is_spelt(tmp_path_factory, data, host) -> None:
    first, second = data.draw(ssh_spelling(host)), data.draw(ssh_spelling(host))
    folder = tmp_path_factory.mktemp("engine")
    path = write(folder, f"nodes:\n  a:\n    endpoint: {first}\n  b:\n    endpoint: {second}\n")
    with pytest.raises(ConfigError) as err:
        resolve_cluster(path, None, None)
    assert "nodes.b.endpoint" in str(err.value) and "node a" in str(err.value), str(err.value)
    # On the command line: one engine named twice is one node, and a second name for a node's engine is refused.
    assert len(resolve_cluster(None, [first, second], None).nodes) == 1
    alone = write(folder, f"nodes:\n  a:\n    endpoint: {first}\n")
    with pytest.raises(ConfigError, match="--nodes: .* reaches the engine of node a"):
        resolve_cluster(alone, ["a", second], None)
    other = data.draw(ssh_spelling(host, ":2222"))
    path = write(folder, f"nodes:\n  a:\n    endpoint: {first}\n  b:\n    endpoint: {other}\n")
    assert [n.name for n in resolve_cluster(path, None, None).nodes] == ["a", "b"]  # another port, another engine
