"""Mods whose patch is named by URL or GitHub pull request (`patch: {url|pr, sha256}`), and `mod new` of one.

The plan never needs the network: the mod's content digest covers mod.yaml, and so the sha256.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import inimage
from ..inimage.patch import check_patch
from ..errors import ConfigError, DownloadError
from ..files import write_atomic
from . import download
from ..inimage.seam import ModDoc, PatchOrigin
from .config import REMOTE_PATCH_FILE, mod_document, mod_yaml_text
from .fields import NAME_RE, PATCH_URL_RE, PR_RE, specifier_error
from .schema import RemotePatch, pr_diff_url
from .plan import Mod
from .sources import cache_dir


def materialize(mod: Mod, ca_cert: Path | None = None) -> tuple[ModDoc, Path]:
    """The mod as the applier reads it (mod.json) and its folder: for a patch named by URL, a cached copy of the
    mod's files plus the fetched, hash-checked diff (REMOTE_PATCH_FILE), read from then on as a local patch."""
    remote = mod.spec.patch
    if not isinstance(remote, RemotePatch):
        return mod_document(mod.spec, remote), Path(mod.folder)
    url = remote.source_url
    spec = mod_document(mod.spec, REMOTE_PATCH_FILE, PatchOrigin(url=url, pr=remote.pr, sha256=remote.sha256))
    target = cache_dir() / "mods" / f"{mod.name}-{mod.digest.removeprefix('sha256:')[:12]}"
    if target.is_dir():
        return spec, target
    meta = Path(mod.folder) / "mod.yaml"
    field = "patch.url" if remote.url else "patch.pr"
    try:  # the pinned patch, from the download cache or fetched into it
        fetched = download.fetch(url, remote.sha256, REMOTE_PATCH_FILE, ca_cert=ca_cert)
    except download.HashMismatch as exc:
        raise ConfigError(f"{url} sent a file with sha256 {exc.got}, not the pinned {remote.sha256}: the patch "
                          f"changed upstream, or the URL is not the one meant; read what it sends now, and pin "
                          f"its hash only if it is the patch you want", path=meta, field="patch.sha256") from None
    except download.DownloadFailed as exc:
        raise DownloadError(f"cannot fetch the patch of mod {mod.name}: {exc}", path=meta, field=field) from None
    try:
        check_diff(fetched.read_bytes())
    except inimage.ModFailure as exc:
        download.forget(remote.sha256, REMOTE_PATCH_FILE)
        raise ConfigError(f"{url}: {exc}", path=meta, field=field) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tree = staging / "mod"
        shutil.copytree(mod.folder, tree, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copyfile(fetched, tree / REMOTE_PATCH_FILE)
        try:
            inimage.check_static(spec, tree)
        except inimage.ModFailure as exc:
            raise ConfigError(f"{url}: {exc}", path=meta, field=field) from None
        try:
            os.replace(tree, target)
        except OSError:
            if not target.is_dir():  # else: made at the same time by another run, from the same bytes
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return spec, target


def check_diff(data: bytes) -> list[inimage.FilePatch]:
    """The file changes of a unified diff; ModFailure for none, a path outside its tree, or a non-text change."""
    try:
        check_patch(data)
        return inimage.parse_diff(data)  # which also refuses a header naming a path outside the tree
    except inimage.ModFailure as exc:
        if str(exc) == "the patch file holds no file changes":
            raise inimage.ModFailure("is not a unified diff (no '--- a/FILE' / '+++ b/FILE' header with a "
                                       "hunk): is this the raw diff, e.g. a pull request's .diff URL?") from None
        raise


@dataclass(frozen=True)
class NewMod:
    """A mod folder that `mod new` wrote."""

    folder: Path
    url: str
    sha256: str
    files: tuple[str, ...]  # the files the patch changes


def new_mod(mods_dir: Path, name: str, *, versions: str, url: str | None = None, pr: str | None = None,
            component: str = "vllm", phase: str = "install", ca_cert: Path | None = None) -> NewMod:
    """Write mods/NAME/mod.yaml for the diff at url (or of pull request pr); a failure leaves no folder behind."""
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a mod name (lowercase letters, digits and '-')", field="NAME")
    folder = mods_dir / name
    if folder.exists():
        raise ConfigError("already exists: choose another name, or edit that mod's mod.yaml", path=folder)
    if (url is None) == (pr is None):
        raise ConfigError("give either --from-url URL or --pr OWNER/REPO#NUMBER", field="--from-url")
    if url is not None and not PATCH_URL_RE.fullmatch(url):
        raise ConfigError(f"{url!r} is not an https URL of a patch", field="--from-url")
    if pr is not None and not PR_RE.fullmatch(pr):
        raise ConfigError(f"{pr!r} is not a pull request: write OWNER/REPO#NUMBER", field="--pr")
    if not NAME_RE.fullmatch(component):
        raise ConfigError(f"{component!r} is not a component name (vllm, image, or one a recipe lists)",
                          field="--component")
    if phase not in ("source", "install"):
        raise ConfigError(f"unknown phase {phase!r}; choose install (the installed package) or source "
                          f"(the vLLM tree before its compile)", field="--phase")
    if problem := specifier_error(versions):
        raise ConfigError(problem, field="--versions")
    source = url or pr_diff_url(pr or "")
    try:
        path, sha256 = download.fetch_new(source, REMOTE_PATCH_FILE, ca_cert=ca_cert)
    except download.DownloadFailed as exc:
        raise DownloadError(f"cannot fetch the patch: {exc}", field="--pr" if pr else "--from-url") from None
    try:
        return _write_new_mod(folder, name, path, sha256, source, url=url, pr=pr, versions=versions,
                              component=component, phase=phase)
    except BaseException:
        download.forget(sha256, REMOTE_PATCH_FILE)  # nothing of a failed `mod new` stays in the cache
        raise


def _write_new_mod(folder: Path, name: str, path: Path, sha256: str, source: str, *, url: str | None,
                   pr: str | None, versions: str, component: str, phase: str) -> NewMod:
    data = path.read_bytes()
    try:
        files = tuple(fp.path for fp in check_diff(data))
    except inimage.ModFailure as exc:
        raise ConfigError(f"{source}: {exc}", field="--pr" if pr else "--from-url") from None
    origin = f"pull request {pr} ({source})" if pr else source
    check = verify_check(data, component)
    if check is None:
        raise ConfigError(f"{source}: the patch adds and removes no line a check could look for (only blank lines, "
                          "or lines it moves); write this mod by hand", field="--pr" if pr else "--from-url")
    text = mod_yaml_text({
        "name": name,
        "summary": f"Upstream patch: {pr or source}",
        "description": (f"The diff of {origin}, pinned by its sha256.\n"
                        f"It changes {', '.join(files)}.\n"
                        "Written by `./build.py mod new`: say here what it fixes and why this image needs "
                        "it, check the targets and the verify check, then add the mod to a variant and run "
                        "check-mods.\n"),
        "component": component,
        "targets": {"versions": versions},
        "phase": phase,
        "kind": "patch",
        "patch": ({"pr": pr} if pr else {"url": url}) | {"sha256": sha256},
        "verify": [check],
    }, path=folder / "mod.yaml")
    folder.mkdir(parents=True)  # fails when the folder appeared meanwhile: nothing of another is touched
    try:
        write_atomic(folder / "mod.yaml", text.encode())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return NewMod(folder, source, sha256, files)


def verify_check(diff: bytes, component: str) -> dict[str, str] | None:
    """A check that the patch took effect: a line it adds (the component's package first), else a Python check
    that a removed line is gone; None when there is no such line."""
    package = component.replace("-", "_") + "/"
    changed: dict[str, dict[str, list[str]]] = {}  # per file, its added ("+") and removed ("-") lines
    current = None
    for raw in diff.decode("utf-8", "replace").splitlines():
        if raw.startswith("+++ "):
            current = raw[4:].split("\t")[0].removeprefix("b/")
            changed.setdefault(current, {"+": [], "-": []})
        elif current is not None and not raw.startswith("--- ") and raw[:1] in ("+", "-") and raw[1:].strip():
            changed[current][raw[0]].append(raw[1:].strip())
    order = sorted(changed, key=lambda path: not path.startswith(package))
    for path in order:
        new = [line for line in changed[path]["+"] if line not in changed[path]["-"]]
        if new:
            return {"file": path, "contains": new[0]}
    for path in order:
        gone = [line for line in changed[path]["-"] if line not in changed[path]["+"]]
        if gone and path != "/dev/null":
            return {"python": f"import pathlib; assert {gone[0]!r} not in pathlib.Path({path!r}).read_text()"}
    return None
