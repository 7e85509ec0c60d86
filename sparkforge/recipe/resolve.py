"""Ask registries and git remotes for the pins a recipe leaves open: a full digest or commit, or `Unreachable`."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable

from .. import gitfetch, registry
from ..errors import mask_secrets
from ..imageref import ImageRef
from ..inimage.proc import CommandError, run
from .lockfile import Pinned
from .plan import Plan
from .sources import cache_dir


class Unreachable(Exception):
    """A fact cannot be asked from here; the message says why."""


class NotFound(Unreachable):
    """The source answered: it has no such tag, branch or image (an answer, not a failure to ask)."""


def split_repository(repository: str) -> tuple[str, str]:
    """(registry host, repository name on it), with Docker Hub's defaults."""
    ref = ImageRef(repository)
    if ref.registry is not None:
        return ref.registry, ref.path
    return "registry-1.docker.io", repository if "/" in repository else f"library/{repository}"


def registry_digest(repository: str, tag: str, *, timeout: float = 15, ca_cert: Path | None = None) -> str:
    """The digest a registry gives for repository:tag (a multi-arch index when there is one), trusting ca_cert
    when given; no read waits longer than `timeout` seconds, no request four times that."""
    host, name = split_repository(repository)
    endpoint = registry.Endpoint.of(host)
    if ca_cert is not None and endpoint.scheme == "https":
        endpoint = replace(endpoint, ca=str(ca_cert))
    client = registry.Client(endpoint, deadline=timeout * 4, window=timeout)
    try:
        return client.manifest_digest(name, tag)
    except registry.RegistryError as exc:
        if exc.status == 404:
            raise NotFound(f"{host} has no {name}:{tag}") from None
        raise Unreachable(str(exc)) from None


ASKS = 2  # times a git remote is asked before `lock` takes it as not answering
ASK_AGAIN_AFTER = 2.0  # seconds


def git_commit(repo: str, ref: str, *, timeout: float = 30) -> str:
    """The commit a branch, tag or short SHA names on a git remote (a tag is peeled to its commit); a short SHA,
    which a remote cannot be asked for, is looked up in the cached blob-less mirror."""
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0")
    if gitfetch.SHORT.fullmatch(ref):
        try:
            return gitfetch.resolve(cache_dir() / "git", repo, ref)[1]
        except gitfetch.FetchError as exc:
            raise Unreachable(f"cannot resolve the short commit {ref} in {repo}: {exc}") from None
    failure = ""
    for attempt in range(ASKS):  # a remote that failed (a dropped connection, a busy server) is asked once more
        if attempt:
            time.sleep(ASK_AGAIN_AFTER)
        try:
            proc = run(["git", "ls-remote", repo, ref, f"{ref}^{{}}"], what=f"git ls-remote {repo}",
                       capture_output=True, text=True, timeout=timeout, env=env)
        except CommandError as exc:
            failure = str(exc)
            continue
        if proc.returncode == 0:
            break
        tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        failure = f"cannot ask {repo} for {ref}: {tail.removeprefix('fatal: ')}"
    else:
        raise Unreachable(f"{failure} (asked {ASKS} times)")
    refs = {name: sha for sha, _, name in (line.partition("\t") for line in proc.stdout.splitlines() if "\t" in line)}
    for name in (f"refs/tags/{ref}^{{}}", f"refs/tags/{ref}", f"refs/heads/{ref}", ref):
        if name in refs:
            return refs[name]
    raise NotFound(f"{repo} has no branch or tag {ref}")


def today_epoch() -> int:
    """Midnight UTC of the day the lock is made: nothing in a locked image claims to be newer."""
    now = int(time.time())
    return now - now % 86400


def resolve_pins(plan: Plan, say: Callable[[str], None] = lambda _: None,
                 ca_cert: Path | None = None) -> dict[str, Pinned]:
    """The base digest and the git commits the recipe leaves open, asked; why one stays open has its URLs masked."""
    pins: dict[str, Pinned] = {}
    b = plan.base
    if b.digest.value:
        pins["base.digest"] = Pinned(b.digest.value)
    else:
        try:
            pins["base.digest"] = Pinned(registry_digest(b.repository, b.tag, ca_cert=ca_cert))
            say(f"base {b.repository}:{b.tag} is {pins['base.digest'].value}")
        except Unreachable as exc:
            pins["base.digest"] = Pinned(None, mask_secrets(f"{exc}; lock again where the registry answers"),
                                         answered=isinstance(exc, NotFound))
            say(f"base {b.repository}:{b.tag}: unresolved: {exc}")
    gits = [("vllm.commit", plan.vllm.repo, plan.vllm.ref, plan.vllm.commit)] if plan.vllm.source == "git" else []
    gits += [(f"components.{c.name}.commit", c.repo, c.ref, c.commit) for c in plan.components if c.kind == "git"]
    for name, repo, ref, pin in gits:
        if pin.value:
            pins[name] = Pinned(pin.value)
            continue
        try:
            pins[name] = Pinned(git_commit(str(repo), str(ref)))
        except Unreachable as exc:
            pins[name] = Pinned(None, mask_secrets(f"{exc} (recipe: {pin.unknown})"), answered=isinstance(exc, NotFound))
        say(f"{name}: {pins[name].show()}")
    return pins


