#!/usr/bin/env python3
"""Fetch one commit of a git repository into a folder, through a blob-less mirror. Stdlib only.

It runs in image builds (a script, with a copy of inimage/proc.py beside it) and on the host for `lock`. Mirrors
are keyed by the repository URL (a fork never reuses upstream's); every command runs through proc.run: a time
limit, its process group (git's remote helper with it) stopped whole on the limit and on Ctrl-C.
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
# Time limits, in seconds. A step that talks to the remote (fetch, and archive, which fetches the blobs of a
# blob-less mirror) gets an hour: a first fetch of a large history over a slow link is slow but finite. A step
# on local files only gets ten minutes, far more than a healthy disk needs.
NETWORK_TIMEOUT = 3600.0
LOCAL_TIMEOUT = 600.0


class FetchError(Exception):
    """The ref cannot be fetched or resolved; the message says why, in one line."""


def mirror_path(cache: Path, repo: str) -> Path:
    """The mirror of a repository in the cache: named by a hash of its URL, and its last path part."""
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", repo.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))[:40]
    return cache / f"{tail}-{hashlib.sha256(repo.encode()).hexdigest()[:16]}.git"


def _run(argv: list[str], what: str, timeout: float, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """argv to its end within timeout through proc.run; one that cannot run, or runs past its limit, is a FetchError."""
    try:
        return run_to_end(argv, what=what, timeout=timeout, **kw)
    except CommandError as exc:
        raise FetchError(str(exc)) from None


def _git(mirror: Path, *args: str, stdout: Any = subprocess.PIPE, what: str = "") -> str:
    what = what or f"git {args[0]}"
    timeout = NETWORK_TIMEOUT if args[0] in ("fetch", "archive") else LOCAL_TIMEOUT
    proc = _run(["git", "-C", str(mirror), *args], what, timeout, stdout=stdout, stderr=subprocess.PIPE, text=True,
                errors="replace", env=dict(os.environ, GIT_TERMINAL_PROMPT="0"))
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()] or [f"exit code {proc.returncode}"]
        raise FetchError(f"{what}: {lines[-1].removeprefix('fatal: ').removeprefix('error: ')}")
    return str(proc.stdout)


def resolve(cache: Path, repo: str, ref: str, commit: str | None = None) -> tuple[Path, str]:
    """(mirror, full commit) for a ref, fetching what is missing; with `commit`, check the ref gives it."""
    mirror = mirror_path(cache, repo)
    if not (mirror / "HEAD").exists():  # the repository's bare, blob-less mirror, created empty on first use
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=cache))
        _git(staging, "init", "--quiet", "--bare")
        _git(staging, "config", "remote.origin.url", repo)
        _git(staging, "config", "remote.origin.promisor", "true")
        _git(staging, "config", "remote.origin.partialclonefilter", "blob:none")
        os.replace(staging, mirror)
    if commit is not None and not FULL.fullmatch(commit):
        raise FetchError(f"{commit!r} is not a full 40-hex commit")
    if commit is None and SHORT.fullmatch(ref):  # the one commit a short SHA names among every branch and tag
        _git(mirror, "fetch", "--quiet", "--filter=blob:none", "--tags", "origin", "+refs/heads/*:refs/heads/*")
        try:
            listed = _git(mirror, "rev-parse", "--disambiguate=" + ref).split()
        except FetchError:
            listed = []
        commits = sorted(o for o in listed if _git(mirror, "cat-file", "-t", o).strip() == "commit")
        if not commits:
            raise FetchError(f"no commit starting with {ref} on any branch or tag of {repo}")
        if len(commits) > 1:
            raise FetchError(f"{ref} is ambiguous in {repo}: it names {len(commits)} commits "
                             f"({', '.join(c[:12] for c in commits[:4])}); give more digits or the full commit")
        return mirror, commits[0]
    # A full commit is fetched as it is (servers configured as GitHub is allow any reachable SHA); a branch or
    # tag by name, an annotated tag peeled to its commit.
    wanted = commit or ref
    _git(mirror, "fetch", "--quiet", "--filter=blob:none", "origin", wanted)
    peeled = wanted if commit or FULL.fullmatch(ref) else "FETCH_HEAD"
    return mirror, _git(mirror, "rev-parse", "--verify", "--quiet", f"{peeled}^{{commit}}").strip()


def export(mirror: Path, commit: str, dest: Path) -> None:
    """Write the tree of a commit into dest (blobs are fetched as needed), and mark it with the commit."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tarball:
        _git(mirror, "archive", "--format=tar", commit, stdout=tarball, what=f"git archive {commit[:12]}")
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
