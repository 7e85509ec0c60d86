"""The Docker side of the tests: the arguments of a test build, image IDs, and a
real registry (Debian's docker-registry, run by scripts/registry.sh) on a free loopback port."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.cli import run_cli
from tests.support.paths import BASE, CA, ROOT, VARIANTS


def build_args(variant: str, *extra: str, images: Path = VARIANTS, mods: Path | None = None) -> list[str]:
    """`build VARIANT` on the local base, with the CA bundle as a BuildKit secret."""
    args = ["--images", str(images)]
    if mods is not None:
        args += ["--mods", str(mods)]
    return args + ["build", variant, "--base", BASE, "--ca-cert", CA, *extra]


@dataclass(frozen=True)
class BuiltImage:
    variant: str
    tag: str
    moving_tag: str
    image_id: str


def image_id(ref: str) -> str | None:
    """The ID of the head's image `ref`, None when the engine says there is none; any other answer fails
    the test with the engine's own words."""
    proc = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode == 0:
        return proc.stdout.strip()
    assert "no such image" in proc.stderr.lower() or "not found" in proc.stderr.lower(), (
        f"docker image inspect {ref}: exit {proc.returncode}: {proc.stderr}")
    return None


BUILD_TAG = re.compile(r"-[0-9a-f]{12}(\.[0-9a-f]{12}|-candidate)?$")  # a plan's tag, a build kept beside it, a candidate


def variant_tags(repo: str, variant: str) -> list[str]:
    """The head's tags a build of `variant` into `repo` makes: the moving tag, the plan's immutable tag, a build
    kept beside it (`.<hex>`) and a failed build's candidate."""
    proc = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
                          capture_output=True, text=True, timeout=120, check=True)
    tags = [ref.removeprefix(repo + ":") for ref in proc.stdout.split() if ref.startswith(repo + ":")]
    return [f"{repo}:{tag}" for tag in tags
            if tag == variant or (tag.startswith(variant) and BUILD_TAG.fullmatch(tag[len(variant):]))]


def forget_earlier_builds(prefix: str = "sparkforge-test/") -> list[str]:
    """Untag every image that earlier runs' builds left under the tests' repositories (those with a build's
    `io.sparkforge.plan-hash` label; the test bases have none). A build whose immutable tag already names an
    earlier build of the plan (made by other code, as a run of an older commit leaves it) moves no tag, and a test
    would look at that older image; and an old image whose moving tag a build moves stays on the engine as a
    dangling image, which on the containerd store holds its layers until pruned. Untagged, the images go at once,
    and each plan's first build of the run, served from BuildKit's cache (left as it is), tags what this code
    made. The refs untagged."""
    proc = subprocess.run(["docker", "image", "ls", "--filter", "label=io.sparkforge.plan-hash", "--format",
                           "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True, timeout=120, check=True)
    stale = [ref for ref in proc.stdout.split() if ref.startswith(prefix) and not ref.endswith(":<none>")]
    for at in range(0, len(stale), 50):
        subprocess.run(["docker", "image", "rm", "--no-prune", *stale[at:at + 50]], capture_output=True, timeout=600)
    return stale


@contextmanager
def fresh_variant(repo: str, variant: str) -> Iterator[None]:
    """A test variant's tags are gone before the test (an interrupted earlier run may have left them, and a
    build whose immutable tag names another image moves no tag) and after it."""
    def forget() -> None:
        tags = variant_tags(repo, variant)
        if tags:
            subprocess.run(["docker", "image", "rm", "--no-prune", *tags], capture_output=True, timeout=300)
        assert not variant_tags(repo, variant), f"{repo}:{variant}: tags left after docker image rm"

    forget()
    try:
        yield
    finally:
        forget()


def config_digest(ref: str, host: str | None = None) -> str:
    """The config digest of an image, read from its `docker save` (streamed, nothing written): the ID a
    classic-store engine shows for it, which a containerd-store engine does not show of itself."""
    import tarfile

    save = subprocess.Popen(["docker", *(["-H", host] if host else []), "save", ref], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=save.stdout, mode="r|") as tar:
            for member in tar:
                if member.name == "manifest.json":
                    entry = json.load(tar.extractfile(member))[0]  # type: ignore[arg-type]
                    config: str = entry["Config"]  # the config blob's path in the archive
                    return "sha256:" + config.rpartition("/")[2]
    finally:
        save.kill()
        save.wait()
    raise AssertionError(f"docker save {ref} has no manifest.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) of an AF_INET socket
        return port


@dataclass
class Registry:
    """Debian's docker-registry on 127.0.0.1:port, run by scripts/registry.sh (a real process)."""

    port: int
    state: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _script(self, action: str) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, SPARKFORGE_STATE=str(self.state))
        return subprocess.run(["bash", str(ROOT / "scripts" / "registry.sh"), action, str(self.port)],
                              capture_output=True, text=True, env=env, timeout=60)

    def start(self) -> None:
        proc = self._script("start")
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def stop(self) -> None:
        proc = self._script("stop")
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def has_tag(self, repository: str, tag: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/{repository}/tags/list", timeout=5) as resp:
                return tag in (json.load(resp).get("tags") or [])
        except OSError:
            return False


__all__ = ["BASE", "CA", "VARIANTS", "BuiltImage", "Registry", "build_args", "config_digest", "free_port",
           "forget_earlier_builds", "fresh_variant", "image_id", "variant_tags"]


def built(variant: str, base: str = BASE, mods: Path | None = None, *extra: str) -> BuiltImage:
    """Build a test variant on the local base with the real command line; the image it made."""
    proc = run_cli(*build_args(variant, *extra, mods=mods))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    show = run_cli("--images", str(VARIANTS), *(["--mods", str(mods)] if mods else []), "show", variant, "--base",
                   base, "--json")
    plan = json.loads(show.stdout)
    ident = image_id(plan["tag"])
    assert ident, f"{plan['tag']} missing after build"
    return BuiltImage(variant, plan["tag"], plan["moving_tag"], ident)
