"""The housekeeping verbs: `wheels` shows and cleans the wheel cache, `prune` removes what builds left on the head."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from ..build.wheels import default_root, folder_size, leftovers, prune, remove_leftovers, scan
from ..distribute.prune import Leftover, prune_head
from ..errors import BuildError, ConfigError
from .app import State, WheelCache, app, out, say, write
from .usage import App

wheels_app = App(help="Show and clean the wheel cache: the vLLM wheels git-source builds compiled, by their inputs."
                 "\n\n  ./build.py wheels list\n\n  ./build.py wheels prune --older-than 30")
app.add_typer(wheels_app, name="wheels")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


@wheels_app.command("list")
def list_wheels(
    wheel_cache: WheelCache = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every entry with all its inputs as JSON.")] = False,
) -> None:
    """List the cached wheels: key, vLLM version and commit, arch list, source-phase mods, size, last use."""
    root = wheel_cache or default_root()
    if root.exists() and not root.is_dir():
        raise ConfigError("is not a folder", path=root, field="--wheel-cache")
    found, damaged = scan(root)
    if as_json:
        entries = [{"key": e.key, "wheel": e.wheel, "sha256": e.sha256, "size": e.size, "created": e.created,
                    "inputs": e.inputs} for e in found]
        write(json.dumps(entries + [{"folder": name, "damaged": why} for name, why in damaged], indent=2,
                         sort_keys=True) + "\n")
        return
    for name, why in damaged:
        say(f"damaged entry {name[:64]}: {why}; it is never used (`wheels prune` leaves it; delete the folder)")
    if not found:
        say(f"the wheel cache {root} " + ("holds no whole wheel" if damaged else "is empty"))
        return
    table = Table("key", "vllm", "commit", "arch", "source mods", "size", "created", "last used", box=None,
                  header_style="bold")
    for e in found:
        vllm = e.inputs.get("vllm", {})
        mods = ", ".join(m["name"] for m in e.inputs.get("source_mods", [])) or "-"
        used = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e.last_used))
        table.add_row(*(Text(str(x)) for x in (e.key[:12], vllm.get("version"), str(vllm.get("commit"))[:12],
                                              e.inputs.get("torch_cuda_arch_list"), mods, _size(e.size),
                                              e.created, used)))
    out.print(table)
    say(f"{len(found)} wheels, {_size(sum(e.size for e in found))}, in {root}")


@wheels_app.command("prune")
def prune_wheels(
    wheel_cache: WheelCache = None,
    older_than: Annotated[float | None, typer.Option("--older-than", min=0, metavar="DAYS", help="Remove wheels no "
                                                        "build has used for DAYS days.")] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="KEY", help="Remove the wheel whose key starts with "
                                               "this.")] = None,
    everything: Annotated[bool, typer.Option("--all", help="Remove every wheel.")] = False,
    dry: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")] = False,
) -> None:
    """Remove wheels from the cache: by age of last use, by key, or all. A later build compiles again.

    Each prune also removes what killed builds left in the cache (compile exports, half-stored entries) once no one has
    touched it for a day.
    """
    if not (everything or older_than is not None or key):
        raise ConfigError("say what to remove: --older-than DAYS, --key KEY or --all", field="wheels prune")
    if everything and (older_than is not None or key):
        raise ConfigError("--all removes every wheel; leave out --older-than and --key", field="--all")
    root = wheel_cache or default_root()
    gone = prune(root, older_than_days=older_than, key=key, dry_run=dry)
    verb = "would remove" if dry else "removed"
    for e in gone:
        say(f"{verb} {e.key[:12]} vllm {e.inputs.get('vllm', {}).get('version')} ({_size(e.size)})")
    say(f"{verb} {len(gone)} wheels, {_size(sum(e.size for e in gone))}, from {root}")
    stale = leftovers(root)
    if stale:
        sizes = {f: folder_size(f) for f in stale}
        if not dry:
            stale = remove_leftovers(stale)
        say(f"{verb} {len(stale)} folders that interrupted builds left, {_size(sum(sizes[f] for f in stale))}")


@app.command("prune")
def prune_cmd(
    wheel_cache: WheelCache = None,
    wheels: Annotated[bool, typer.Option(
        "--wheels", help="Also remove the wheel cache's entries no variant here would use, and the downloaded wheel "
        "sets no lock here names (other machines sharing the cache may use them).")] = False,
    build_cache: Annotated[bool, typer.Option(
        "--build-cache", help="Also remove BuildKit's cache records that name sparkforge (its steps, its pip and git "
        "caches): the next build of every variant runs cold.")] = False,
    dry: Annotated[bool, typer.Option("--dry-run", help="List what would go and its size; remove nothing.")] = False,
) -> None:
    """Remove what sparkforge's builds left on this machine that nothing names any more.

    That is: candidates (TAG-candidate: a build before its smoke test, or one that failed it) and kept builds
    (TAG.<12 hex>) no deploy record names; with --wheels, wheel-cache entries no variant's build would use and
    downloaded wheel sets no lock names; with --build-cache, BuildKit's cache of sparkforge's steps. An image a moving
    tag, a variant's current tag or a deploy record names is never removed, nor the candidate of a running build.

      ./build.py prune --dry-run
      ./build.py prune --wheels --build-cache
    """
    root = (wheel_cache or default_root()) if wheels else None
    verb = "would remove" if dry else "removed"

    found, failed = prune_head(State.layout, wheel_root=root, build_cache=build_cache, dry_run=dry,
                               say=lambda item: say(_leftover_line(verb, item)))
    if dry:
        for item in found.leftovers:
            say(_leftover_line(verb, item))
    for name, why in found.left:
        say(f"kept {name}: {why}")
    refused = {item for item, _ in failed}
    gone = [x for x in found.leftovers if x not in refused]
    n = len(gone)
    say(f"{verb} {n} {'item' if n == 1 else 'items'}, {_size(sum(x.size for x in gone if not x.shared))}"
        if n else "nothing to remove")
    if failed:
        item, why = failed[0]
        raise BuildError(f"{len(failed)} could not be removed, the first {item.name}: {why}", field="prune")


def _leftover_line(verb: str, item: Leftover) -> str:
    size = "its image stays under another tag" if item.shared else _size(item.size)
    if item.kind == "build cache":
        return f"{verb} BuildKit's {item.name} that name sparkforge ({size})"
    if item.kind == "wheel set":
        return f"{verb} wheel set {Path(item.name).name[:12]} and its downloads no other set shares ({size})"
    return f"{verb} {item.kind} {item.name[:12] if item.kind == 'wheel' else item.name} ({size})"
