#!/usr/bin/env python3
"""Fetch one commit of a git repository into a folder, through a blob-less mirror. Stdlib only.

It runs inside image builds (copied to /opt/sparkforge/gitfetch.py, with the mirrors in a BuildKit
cache mount) and on the host for `lock`. A ref is resolved to the one commit it names:

- a full commit is fetched as it is (servers configured as GitHub is allow any reachable SHA);
- a branch or tag is fetched by name, and an annotated tag is peeled to its commit;
- a short SHA, when that is all a recipe knows, is looked up among the commits of every branch
  and tag (a blob-less clone of all refs), and refused when it names no commit or several.

Mirrors are keyed by the repository URL, so a recipe moved to a fork never reuses upstream's.

Every command has a time limit and runs in a process group of its own, which is stopped whole (git's
remote helper with it) on the limit and on Ctrl-C: it runs through inimage/proc.py, sparkforge's one way to
run a process. In an image this file runs as a script, with a copy of proc.py beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

try:  # on the host: the package's one way to run a process
    from .inimage.proc import CommandError, run as run_to_end
except ImportError:  # in an image, run as a script: the copy of inimage/proc.py beside it
    from proc import CommandError, run as run_to_end  # type: ignore[no-redef,import-not-found]

FULL = re.compile(r"[0-9a-f]{40}")
SHORT = re.compile(r"[0-9a-f]{7,39}")
COMMIT_MARK = ".sparkforge-commit"
# Time limits, in seconds. A step that talks to the remote (fetch, and archive, which fetches the blobs
# of a blob-less mirror) gets an hour: a first fetch of a large repository's history over a slow link
# inside a build is slow but finite, and past an hour a remote that stopped sending is given up instead
# of holding the build forever. A step on local files only (init, config, rev-parse, cat-file, tar)
# gets ten minutes, far more than a healthy disk needs.
NETWORK_TIMEOUT = 3600.0
LOCAL_TIMEOUT = 600.0


class FetchError(Exception):
    """The ref cannot be fetched or resolved; the message says why, in one line."""


def mirror_path(cache: Path, repo: str) -> Path:
    """The mirror of a repository in the cache: named by a hash of its URL, and its last path part."""
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", repo.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))[:40]
    return cache / f"{tail}-{hashlib.sha256(repo.encode()).hexdigest()[:16]}.git"


def _run(argv: list[str], what: str, timeout: float, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """argv to its end within timeout (proc.run: its process group stopped whole on the limit and on Ctrl-C);
    a command that cannot run, or runs past its limit, is one FetchError."""
    try:
        return run_to_end(argv, what=what, timeout=timeout, **kw)
    except CommandError as exc:
        raise FetchError(str(exc)) from None


def _git(mirror: Path, *args: str, timeout: float | None = None) -> str:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0")
    if timeout is None:
        timeout = NETWORK_TIMEOUT if args[0] == "fetch" else LOCAL_TIMEOUT
    proc = _run(["git", "-C", str(mirror), *args], f"git {args[0]}", timeout, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()] or [f"exit code {proc.returncode}"]
        raise FetchError(f"git {args[0]}: {lines[-1].removeprefix('fatal: ').removeprefix('error: ')}")
    return str(proc.stdout)


def open_mirror(cache: Path, repo: str) -> Path:
    """The repository's bare, blob-less mirror, created empty on first use."""
    mirror = mirror_path(cache, repo)
    if not (mirror / "HEAD").exists():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=cache))
        _git(staging, "init", "--quiet", "--bare")
        _git(staging, "config", "remote.origin.url", repo)
        _git(staging, "config", "remote.origin.promisor", "true")
        _git(staging, "config", "remote.origin.partialclonefilter", "blob:none")
        os.replace(staging, mirror)
    return mirror


def _peel(mirror: Path, rev: str) -> str:
    return _git(mirror, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()


def resolve_short(mirror: Path, repo: str, short: str) -> str:
    """The one commit a short SHA names among every branch and tag of the repository."""
    _git(mirror, "fetch", "--quiet", "--filter=blob:none", "--tags", "origin", "+refs/heads/*:refs/heads/*")
    try:
        listed = _git(mirror, "rev-parse", "--disambiguate=" + short).split()
    except FetchError:
        listed = []
    commits = sorted(o for o in listed if _git(mirror, "cat-file", "-t", o).strip() == "commit")
    if not commits:
        raise FetchError(f"no commit starting with {short} on any branch or tag of {repo}")
    if len(commits) > 1:
        raise FetchError(f"{short} is ambiguous in {repo}: it names {len(commits)} commits "
                         f"({', '.join(c[:12] for c in commits[:4])}); give more digits or the full commit")
    return commits[0]


def resolve(cache: Path, repo: str, ref: str, commit: str | None = None) -> tuple[Path, str]:
    """(mirror, full commit) for a ref, fetching what is missing; with `commit`, check the ref gives it."""
    mirror = open_mirror(cache, repo)
    if commit is not None:
        if not FULL.fullmatch(commit):
            raise FetchError(f"{commit!r} is not a full 40-hex commit")
        _git(mirror, "fetch", "--quiet", "--filter=blob:none", "origin", commit)
        return mirror, _peel(mirror, commit)
    if SHORT.fullmatch(ref) or FULL.fullmatch(ref):
        if FULL.fullmatch(ref):
            _git(mirror, "fetch", "--quiet", "--filter=blob:none", "origin", ref)
            return mirror, _peel(mirror, ref)
        return mirror, resolve_short(mirror, repo, ref)
    _git(mirror, "fetch", "--quiet", "--filter=blob:none", "origin", ref)
    return mirror, _peel(mirror, "FETCH_HEAD")


def export(mirror: Path, commit: str, dest: Path) -> None:
    """Write the tree of a commit into dest (blobs are fetched as needed), and mark it with the commit."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tarball:
        env = dict(os.environ, GIT_TERMINAL_PROMPT="0")
        proc = _run(["git", "-C", str(mirror), "archive", "--format=tar", commit], "git archive", NETWORK_TIMEOUT,
                    stdout=tarball, stderr=subprocess.PIPE, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
            raise FetchError(f"git archive {commit[:12]}: {tail.removeprefix('fatal: ')}")
        tarball.seek(0)
        untar = _run(["tar", "-x", "-C", str(dest)], "tar", LOCAL_TIMEOUT, stdin=tarball, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        if untar.returncode != 0:
            raise FetchError(f"tar: {untar.stderr.strip()}")
    (dest / COMMIT_MARK).write_text(commit + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, type=Path, help="folder of the mirrors")
    ap.add_argument("--repo", required=True)
    ap.add_argument("--ref", required=True, help="branch, tag, full commit or short SHA")
    ap.add_argument("--commit", help="the full commit the ref must give (when the recipe pins it)")
    ap.add_argument("--dest", required=True, type=Path, help="folder to write the tree into")
    args = ap.parse_args(argv)
    try:
        mirror, commit = resolve(args.cache, args.repo, args.ref, args.commit)
        export(mirror, commit, args.dest)
    except FetchError as exc:
        print(f"gitfetch: {args.repo} {args.ref}: {exc}", file=sys.stderr)
        return 1
    print(f"gitfetch: {args.repo} {args.ref} is {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
