"""The path users walk, end to end, as they walk it: a non-root member of the `docker` group, in a
fresh copy of the project, on the head's engine (Docker 28.5 on the containerd image store, as a new
Docker 29 install is), locks a git-source variant, runs `make image` (which makes .venv), pushes to
the TLS registry on the head's LAN address, deploys over ssh to two namespace hosts (node2 an older
Docker 26 on the classic store, node3 the containerd store) and asks for status; then looks inside the
image, builds a second build, deploys it, rolls back with `deploy --previous` and asks again.

The user is `sparkforge-user` (SPARKFORGE_TEST_USER names another), made by .ci/provision. Its
home holds the copy, the ssh key, the CA bundle and every cache; the copy is removed at the end.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.cluster.clusterkit import node_docker
from tests.support.paths import ROOT
from tests.support.gitsource import VARIANT, GitSource
from tests.support.users import docker_user, login_env

pytestmark = [pytest.mark.cluster, pytest.mark.docker, pytest.mark.network, pytest.mark.root]


@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    return docker_user()


@pytest.fixture(scope="module")
def workspace(user: pwd.struct_passwd, git_setup: GitSource):
    """A copy of the project's tracked files in the user's home, with the git-source variant in its images/."""
    home = Path(user.pw_dir)
    ws = home / f"sparkforge-{uuid.uuid4().hex[:8]}"
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True,
                               check=True)
        for name in filter(None, files.stdout.split("\0")):
            src, dst = ROOT / name, ws / name
            if not src.is_symlink() and not src.exists():
                continue  # deleted in the working tree
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
        # Its own image repository: the git-source tests build the same variant on this engine at the same
        # time, and every build of a variant moves that variant's moving tag.
        recipe = (git_setup.images / f"{VARIANT}.yaml").read_text()
        assert "\nimage: sparkforge-test/vllm\n" in recipe
        (ws / "images" / f"{VARIANT}.yaml").write_text(
            recipe.replace("\nimage: sparkforge-test/vllm\n", "\nimage: sparkforge-test/userpath\n"))
        shutil.copytree(git_setup.mods / "probe-source-mark", ws / "mods" / "probe-source-mark")
        shutil.copy(git_setup.ca_bundle, ws / "ca-bundle.crt")
        (ws / "ssh").mkdir()
        yield ws
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _chown(path: Path, user: pwd.struct_passwd) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, user.pw_uid, user.pw_gid, follow_symlinks=False)


# The first `make image` of the git-source variant on a CI machine's 2 cores that the other test groups keep
# busy: past 30 minutes once, 24 in a whole run (the same build takes 5 on those cores idle).
FIRST_IMAGE_TIMEOUT = 3000


def as_user(user: pwd.struct_passwd, ws: Path, *argv: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run argv in the workspace as the user, with a login's plain environment (no root's variables)."""
    # A private git server's CA, as the user configures git for it; BuildKit gets it as --ca-cert.
    env = login_env(user, GIT_SSL_CAINFO=str(ws / "ca-bundle.crt"))
    proc = subprocess.run(["runuser", "-u", user.pw_name, "--", "env", "-i", *env, *argv], cwd=ws,
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def test_a_docker_group_member_locks_builds_pushes_deploys_and_sees_status(
        user, workspace: Path, git_setup: GitSource, cluster, cluster_file: Path, registry) -> None:
    ws = workspace
    # The cluster file, with the ssh key, known_hosts and registry certificates in the user's own files, and
    # two nodes: node2 (an older engine, Docker 26) and node3 (the users' own store, containerd). node1, a
    # classic-store 28.5, is what the cluster tests deploy to besides; each node pulls the whole 1.9 GB image.
    nodes = [host for host in cluster.nodes if host.name != "node1"]
    assert [host.name for host in nodes] == ["node2", "node3"]
    shutil.copy(cluster.client_key, ws / "ssh" / "id_ed25519")
    shutil.copy(cluster.known_hosts, ws / "ssh" / "known_hosts")
    shutil.copytree(cluster_file.parent / "tls", ws / "tls")
    text = re.sub(r"\n  node1:\n    endpoint: [^\n]*", "", cluster_file.read_text())
    assert "node1" not in text and "node3:" in text, text
    (ws / "cluster.yaml").write_text(text
                                     .replace(str(cluster.client_key), str(ws / "ssh" / "id_ed25519"))
                                     .replace(str(cluster.known_hosts), str(ws / "ssh" / "known_hosts"))
                                     .replace(str(cluster_file.parent / "tls"), str(ws / "tls")))
    _chown(ws, user)
    os.chmod(ws / "ssh" / "id_ed25519", 0o600)
    py = str(ws / ".venv" / "bin" / "python")

    # No GB10 here: the lock pins the commits and the epoch, the packages stay unresolved, as in images/.
    venv = as_user(user, ws, "make", "venv")
    assert venv.returncode == 0, venv.stdout[-2000:] + venv.stderr[-2000:]
    lock = as_user(user, ws, py, "build.py", "lock", VARIANT, "--no-build")
    assert lock.returncode == 0, lock.stdout + lock.stderr
    locked = json.loads((ws / "images" / f"{VARIANT}.lock.json").read_text())
    assert locked["vllm"]["commit"] == git_setup.commit
    assert locked["components"]["sparkprobe"]["commit"] == git_setup.probe

    # With the lock, every command names one tag: the plan `show` prints, the dry run's, and the one the build makes.
    plan = json.loads(as_user(user, ws, py, "build.py", "show", VARIANT, "--json").stdout)
    dry = as_user(user, ws, py, "build.py", "build", VARIANT, "--locked", "--dry-run", "--ca-cert",
                  str(ws / "ca-bundle.crt"))
    assert dry.returncode == 0 and dry.stdout.splitlines()[0].split()[1] == plan["tag"], dry.stdout + dry.stderr
    image = as_user(user, ws, "make", "image", f"VARIANT={VARIANT}", f"ARGS=--locked --ca-cert {ws / 'ca-bundle.crt'}",
                    timeout=FIRST_IMAGE_TIMEOUT)
    assert image.returncode == 0, image.stdout[-4000:] + image.stderr[-4000:]
    assert "vLLM wheel: compiling" in image.stdout or "from the wheel cache" in image.stdout, image.stdout[-3000:]
    assert f"tagged {plan['tag']}" in image.stdout

    args = ("--cluster", str(ws / "cluster.yaml"))
    push = as_user(user, ws, py, "build.py", "push", VARIANT, *args)
    assert push.returncode == 0, push.stdout + push.stderr
    deploy = as_user(user, ws, py, "build.py", "deploy", VARIANT, *args)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    assert "2 updated, 0 current, 0 failed" in deploy.stdout, deploy.stdout
    status = as_user(user, ws, py, "build.py", "status", VARIANT, *args)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "all 2 nodes match" in status.stdout, status.stdout

    # On each node's own engine (node3: the containerd store) the moving tag is this build, compiled from the commit.
    for host in nodes:
        run = node_docker(cluster, host, "run", "--rm", "--network", "none", "--entrypoint", "cat",
                          plan["moving_tag"], "/opt/sparkforge/build-record.json")
        assert run.returncode == 0, run.stderr.decode()
        record = json.loads(run.stdout)
        assert record["vllm"]["built_commit"] == git_setup.commit, host.name
        assert record["plan_hash"] == plan["plan_hash"], host.name
    # The wheel came through the user's own wheel cache, in the default place under their home.
    key = record["vllm"]["installed_wheel"]["cache_key"]
    assert (Path(user.pw_dir) / ".cache" / "sparkforge" / "wheels" / key / "entry.json").is_file(), key
    assert (ws / ".venv").stat().st_uid == user.pw_uid  # the copy's own environment, made by make

    # What the engine built, looked at by the verbs that name images (on this store, by manifest digest).
    seen = as_user(user, ws, py, "build.py", "inspect", plan["tag"])
    assert seen.returncode == 0 and plan["plan_hash"] in seen.stdout, seen.stdout + seen.stderr
    static = as_user(user, ws, py, "build.py", "test", VARIANT, "--tier", "static")
    assert static.returncode == 0, static.stdout + static.stderr

    # A second build (one install-phase mod fewer: the cached wheel, no compile), locked again, pushed and
    # deployed; then back to the first with --previous, which status reports as current.
    recipe = ws / "images" / f"{VARIANT}.yaml"
    recipe.write_text(recipe.read_text().replace("  - serve-torchrun\n", ""))
    relock = as_user(user, ws, py, "build.py", "lock", VARIANT, "--no-build")
    assert relock.returncode == 0, relock.stdout + relock.stderr
    again = as_user(user, ws, "make", "image", f"VARIANT={VARIANT}", f"ARGS=--locked --ca-cert {ws / 'ca-bundle.crt'}")
    said = [line for line in again.stdout.splitlines() if line.startswith("vLLM wheel:")]
    assert again.returncode == 0 and "from the wheel cache" in again.stdout, (said, again.stdout[-3000:],
                                                                             again.stderr[-2000:])
    second = json.loads(as_user(user, ws, py, "build.py", "show", VARIANT, "--json").stdout)
    assert second["tag"] != plan["tag"]
    for verb in ("push", "deploy"):
        proc = as_user(user, ws, py, "build.py", verb, VARIANT, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    history = as_user(user, ws, py, "build.py", "history", VARIANT)
    assert history.returncode == 0, history.stdout + history.stderr
    assert plan["tag"].partition(":")[2] in history.stdout and second["tag"].partition(":")[2] in history.stdout
    back = as_user(user, ws, py, "build.py", "deploy", VARIANT, "--previous", *args)
    assert back.returncode == 0, back.stdout + back.stderr
    status = as_user(user, ws, py, "build.py", "status", VARIANT, *args)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "all 2 nodes match" in status.stdout and f"compared with {plan['tag']}" in status.stdout, status.stdout
    for host in nodes:
        run = node_docker(cluster, host, "run", "--rm", "--network", "none", "--entrypoint", "cat",
                          plan["moving_tag"], "/opt/sparkforge/build-record.json")
        assert json.loads(run.stdout)["plan_hash"] == plan["plan_hash"], host.name


def test_a_docker_group_member_makes_the_test_variant_and_looks_inside(user, workspace: Path, base_image) -> None:
    """The README's try-it command, as written, as the user, on the head's containerd store."""
    from tests.support.paths import BASE, CA

    _chown(workspace, user)
    venv = as_user(user, workspace, "make", "venv")
    assert venv.returncode == 0, venv.stdout[-2000:] + venv.stderr[-2000:]
    image = as_user(user, workspace, "make", "image", "VARIANT=testvllm", "IMAGES=tests/variants",
                    f"ARGS=--base {BASE} --ca-cert {CA}")
    assert image.returncode == 0, image.stdout[-3000:] + image.stderr[-3000:]
    py = str(workspace / ".venv" / "bin" / "python")
    show = as_user(user, workspace, py, "build.py", "--images", "tests/variants", "show", "testvllm", "--base", BASE,
                   "--json")
    tag = json.loads(show.stdout)["tag"]
    assert f"tagged {tag}" in image.stdout, image.stdout[-2000:]
    for argv in (("inspect", tag), ("test", "testvllm", "--tier", "static", "--base", BASE),
                 ("history", "testvllm", "--base", BASE)):
        proc = as_user(user, workspace, py, "build.py", "--images", "tests/variants", *argv)
        assert proc.returncode == 0, (argv, proc.stdout + proc.stderr)
