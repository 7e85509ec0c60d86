"""The one typer app, its consoles and what every verb shares: the global options, the plan as every
command sees it, the help strings, and `run`, where every SparkforgeError becomes one line on stderr and
its exit code (2 for bad input), never a traceback.

The verbs register themselves on `app` in the modules beside this one (main, cluster, wheels, pins); the
package imports them in the order --help lists them.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

# typer's bundled click: its usage errors become one line like every other bad input.
from typer._click.exceptions import NoArgsIsHelpError, UsageError

from .. import __version__
from ..build.pipeline import LoadedPlan, LockPolicy, load_plan
from ..errors import ConfigError, SparkforgeError, mask_secrets, visible
from ..files import is_regular
from ..recipe.plan import PROJECT_ROOT, Layout, Plan

app = typer.Typer(
    help="Build reproducible vLLM images for DGX Spark (GB10) clusters from recipes and mods.\n\n"
    "Recipes live in images/<variant>.yaml, mods in mods/<name>/. Typical use:\n\n"
    "  python build.py list\n\n"
    "  python build.py show ng17e\n\n"
    "  python build.py render ng17e -o build/ng17e",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _SafeConsole(Console):
    """A console that shows every control character of what it prints as its escape (errors.visible):
    names, paths and messages come from recipes, mods, caches and downloads, and an escape sequence in
    one must not reach the terminal. Rich's own styles and cursor moves are not text, so they pass.
    A URL's user and password are masked in every text before it is cut into lines (a table's cell)."""

    def render(self, renderable, options=None):
        if isinstance(renderable, Text) and mask_secrets(renderable.plain) != renderable.plain:
            renderable = renderable.copy()
            renderable.plain = mask_secrets(renderable.plain)
        for segment in super().render(renderable, options):
            if segment.control is None and segment.text and not segment.text.isprintable() and segment.text != "\n":
                segment = Segment(visible(segment.text), segment.style)
            yield segment


def _console(stderr: bool = False) -> Console:
    # Tables stay readable in logs and pipes, where there is no terminal width to fit.
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else 200
    return _SafeConsole(stderr=stderr, highlight=False, soft_wrap=True, width=width)


out = _console()
err = _console(stderr=True)


class State:
    layout: Layout = Layout.default()


def _print_version(value: bool) -> None:
    # Eager, so that it answers before typer asks for a command.
    if value:
        say(f"sparkforge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    images: Optional[Path] = typer.Option(None, "--images", help="Folder of variant recipes (default: images/)."),
    mods: Optional[Path] = typer.Option(None, "--mods", help="Folder of mods (default: mods/)."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    for option, folder in (("--images", images), ("--mods", mods)):
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ConfigError("is not a folder", path=folder, field=option)
    State.layout = Layout.default(PROJECT_ROOT, images_dir=images, mods_dir=mods)


def load(variant: str, base: Optional[str] = None, *, locked: bool = False,
          policy: Optional[LockPolicy] = None) -> LoadedPlan:
    """The variant's plan as every command sees it (pipeline.load_plan); warnings go to stderr."""
    return warned(load_plan(State.layout, variant, base=base,
                             lock_policy=policy or (LockPolicy.LOCKED if locked else LockPolicy.AUTO)))


def warned(loaded: LoadedPlan) -> LoadedPlan:
    for warning in loaded.warnings:
        err.print(f"warning: {warning}", markup=False)
    return loaded


def emit(lines) -> None:
    for line in lines:
        out.print(line)


def say(text: str) -> None:
    """One line of plain text: paths and names in it are never read as Rich markup."""
    out.print(text, markup=False)


def plan_of(variant: str, base: Optional[str] = None, *, locked: bool = False,
          policy: Optional[LockPolicy] = None) -> Plan:
    return load(variant, base, locked=locked, policy=policy).plan


BASE_HELP = "Swap the base image, as REPOSITORY:TAG[@sha256:DIGEST] (changes the tag)."
WHEEL_CACHE_HELP = ("Folder of the wheel cache: compiled vLLM wheels by their inputs; a shared folder serves several "
                    "machines (default: $SPARKFORGE_WHEEL_CACHE, else ~/.cache/sparkforge/wheels).")
CA_HELP = ("CA bundle for a proxy or a private server: used to download patches and wheels named by URL, and given to "
           "BuildKit as a secret for its own downloads, never stored in a layer. Give a full bundle (system + yours).")


def ca_bundle(path: Optional[Path]) -> Optional[Path]:
    if path is not None and not is_regular(path):
        raise ConfigError("CA bundle not found" if not path.exists() else "is not a regular file", path=path,
                          field="--ca-cert")
    return path


def progress_printer(label: str):
    """Show each BuildKit step as it starts: live on a terminal, one line per step in logs."""
    from ..build.builder import Step

    def show(step: Step, elapsed: float) -> None:
        if step.name.startswith(("internal", "context ")):
            return
        mins, secs = divmod(int(elapsed), 60)
        err.print(f"  {label} {mins:02d}:{secs:02d} [{step.name}] {step.command[:100]}", markup=False)

    return show


def run() -> None:
    """Entry point: a usage error or a sparkforge error becomes one line on stderr and its exit code."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        say(exc.format_message())
        code = 2
    except UsageError as exc:
        command = f"{exc.ctx.info_name}: " if exc.ctx is not None and exc.ctx.parent is not None else ""
        err.print(f"error: {command}{' '.join(exc.format_message().split())}", markup=False)
        code = exc.exit_code
    except SparkforgeError as exc:
        err.print(f"error: {exc}", markup=False)
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        err.print("interrupted", markup=False)
        code = 130
    except OSError as exc:  # the world (disk full, read-only, permissions) or a path the user gave that cannot be one
        err.print(f"error: {os_error_line(exc)}", markup=False)
        code = 2 if exc.errno in INPUT_ERRNOS else 1
    except RecursionError:
        err.print("error: input nested too deeply to read", markup=False)
        code = 2
    sys.exit(code if isinstance(code, int) else 0)


# Errors of a path as given, not of the world: a name too long, a file where a folder must be, ...
INPUT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP})


def os_error_line(exc: OSError) -> str:
    """An OSError as one line naming the path(s) it is about: `cache/x: No space left on device`."""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    reason = exc.strerror or str(exc) or type(exc).__name__
    if paths:
        return visible(f"{' -> '.join(_short_path(p) for p in paths)}: {reason}", keep_newlines=False)
    return visible(reason, keep_newlines=False)


def _short_path(path: str) -> str:
    """A path as typed, cut in the middle when it is absurdly long (a 300-character name)."""
    return path if len(path) <= 160 else f"{path[:100]}...{path[-50:]}"
