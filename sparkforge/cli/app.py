"""The one typer app, its consoles and what every verb shares: global and shared options, the plan, hints to paste,
and `run`, where every error becomes one line on stderr and its exit code (2 for bad input), never a traceback."""

from __future__ import annotations

import enum
import errno
import io
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from collections.abc import Callable, Iterable, Iterator

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Span, Text

# typer's bundled click: its usage errors become one line like every other bad input.
from typer._click.core import Context, ParameterSource
from typer._click.exceptions import NoArgsIsHelpError, UsageError

from .. import __version__
from ..build import dockercli
from ..build.builder import Step
from ..build.pipeline import LoadedPlan, LockPolicy, load_plan
from ..errors import ConfigError, Hint, SparkforgeError, mask_secrets, visible
from ..files import is_regular
from ..recipe import sources
from ..recipe.layout import PROJECT_ROOT, Layout
from ..recipe.plan import Plan
from .usage import App, Command, usage_error_line

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

app = App(help="Build reproducible vLLM images for DGX Spark (GB10) clusters from recipes and mods.\n\n"
          "Recipes live in images/VARIANT.yaml, mods in mods/NAME/. Typical use:\n\n"
          "  ./build.py list\n  ./build.py show ng17e\n  ./build.py render ng17e -o build/ng17e")


class _NamedFile(io.FileIO):
    """The descriptor of stdout or stderr, whose failed writes (a full disk, a broken pipe) name the stream."""

    def __init__(self, fd: int, shown: str) -> None:
        super().__init__(fd, "w", closefd=False)
        self.shown = shown

    def write(self, data: ReadableBuffer, /) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            exc.filename = self.shown
            raise


class _Closed(io.TextIOBase):
    """stdout or stderr when its descriptor was closed before the tool started: a write fails, naming it."""

    def __init__(self, shown: str) -> None:
        self.shown = shown

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF), self.shown)


def _named_stdio() -> None:
    """Make a failed write to sys.stdout or sys.stderr (a full disk, a closed or broken pipe) name it as `<stdout>`,
    one line like any other failure, never a silent drop; a character the encoding lacks is shown as its escape."""
    for attr, fd in (("stdout", 1), ("stderr", 2)):
        old, shown = getattr(sys, attr), f"<{attr}>"
        stream: io.TextIOBase = _Closed(shown)
        try:
            if old is not None:  # None: Python found the descriptor closed, and a file opened since may have its number
                old.flush()
                stream = io.TextIOWrapper(io.BufferedWriter(_NamedFile(fd, shown)), errors="backslashreplace",
                                          encoding=getattr(old, "encoding", None) or "utf-8",
                                          line_buffering=bool(getattr(old, "line_buffering", False)))
        except (OSError, ValueError):  # closed meanwhile
            pass
        setattr(sys, attr, stream)


def one_line(renderable: Any) -> Any:
    """What a console prints, every text in it (str, Text, a Table's cells and title) on one line: a break as `\\n`."""
    if isinstance(renderable, str):
        return visible(renderable, keep_newlines=False)
    if isinstance(renderable, Text):
        masked = mask_secrets(renderable.plain)
        if masked != renderable.plain:  # a URL's user and password, whatever styles cross it
            return Text(visible(masked, keep_newlines=False), style=renderable.style)
        if renderable.plain.isprintable():
            return renderable
        # Cut where any style starts or ends, so that each piece is styled alike from end to end.
        cuts = sorted({i for span in renderable.spans for i in (span.start, span.end)})
        out = renderable.blank_copy()
        for piece in renderable.divide(cuts):
            shown = Text(visible(piece.plain, keep_newlines=False), style=piece.style)
            shown.spans = [Span(0, len(shown), span.style) for span in piece.spans]
            out.append_text(shown)
        return out
    if isinstance(renderable, Table):
        for column in renderable.columns:
            column.header = one_line(column.header)
            column._cells[:] = [one_line(cell) for cell in column._cells]  # rich keeps a column's rows there
        renderable.title = one_line(renderable.title)
    return renderable


class _OneLineConsole(Console):
    """A console that prints every text as one line (one_line): a control character in a name from a recipe, a lock
    or an image must neither reach the terminal nor start a line that looks like output."""

    def __init__(self, stderr: bool = False) -> None:
        # Where output is no terminal (a log, a pipe), tables are never wrapped: each row stays one line.
        unwrapped = not Console(stderr=stderr).is_terminal
        super().__init__(stderr=stderr, highlight=False, soft_wrap=True, width=1 << 16 if unwrapped else None)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*(one_line(o) for o in objects), **kwargs)


out = _OneLineConsole()
err = _OneLineConsole(stderr=True)


class State:
    layout: Layout = Layout.default()
    platform: str | None = None  # --platform: every plan built for it instead of the recipe's


def program() -> str:
    """This program as the user started it, so that a command in a hint runs where they are."""
    name = sys.argv[0] if sys.argv and sys.argv[0] else "build.py"
    return name if "/" in name else f"./{name}"


def _print_version(value: bool) -> None:
    # Eager, so that it answers before typer asks for a command.
    if value:
        say(f"sparkforge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    images: Annotated[Path | None, typer.Option("--images", metavar="DIR",
                                                   help="Folder of variant recipes (default: images/).")] = None,
    mods: Annotated[Path | None, typer.Option("--mods", metavar="DIR", help="Folder of mods (default: mods/).")]
    = None,
    platform: Annotated[str | None, typer.Option(
        "--platform", metavar="OS/ARCH", help="Build for, and look for images of, this platform instead of the "
        "recipe's (linux/arm64 for a Spark): linux/amd64 for a test on an x86-64 machine. Changes the tag.")] = None,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    for option, folder in (("--images", images), ("--mods", mods)):
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ConfigError("is not a folder", path=folder, field=option)
    State.layout = Layout.default(PROJECT_ROOT, images_dir=images, mods_dir=mods)
    State.platform = platform
    sources.announce = tell_step  # downloads of release sources


# ------------------------------------------------------------------ what several verbs take, defined once

Variant = Annotated[str, typer.Argument(metavar="VARIANT", help="The variant (images/VARIANT.yaml), e.g. ng17e.")]
Base = Annotated[str | None, typer.Option("--base", metavar="REF", help="Swap the base image: REPOSITORY:TAG, with "
                                          "@sha256:DIGEST after it to pin it (changes the tag).")]
CaCert = Annotated[Path | None, typer.Option(
    "--ca-cert", metavar="FILE", help="Full CA bundle (system + yours) for a proxy or a private server: used to "
    "download patches and wheels named by URL, and given to BuildKit as a secret for its own downloads, never "
    "stored in a layer.")]
WheelCache = Annotated[Path | None, typer.Option(
    "--wheel-cache", metavar="DIR", envvar="SPARKFORGE_WHEEL_CACHE", show_envvar=False, help="Folder of the wheel "
    "cache, compiled vLLM wheels by their inputs, shareable by several machines (default: $SPARKFORGE_WHEEL_CACHE, "
    "else ~/.cache/sparkforge/wheels).")]
LogDir = Annotated[Path, typer.Option("--log-dir", metavar="DIR", help="Where build logs go (default: build/logs).",
                                      show_default=False)]
DEFAULT_LOG_DIR = PROJECT_ROOT / "build" / "logs"


class Network(str, enum.Enum):
    """The network of a build's RUN steps."""

    host = "host"
    none = "none"
    default = "default"  # BuildKit's own


NetworkOption = Annotated[Network, typer.Option("--network", help="Network of RUN steps: host, none, or default "
                                                "(BuildKit's own).")]


def ca_bundle(path: Path | None) -> Path | None:
    if path is not None and not is_regular(path):
        raise ConfigError("CA bundle not found" if not path.exists() else "is not a regular file", path=path,
                          field="--ca-cert")
    return path


# ------------------------------------------------------------------ the plan, and what to print

def load(variant: str, base: str | None = None, policy: LockPolicy = LockPolicy.AUTO) -> LoadedPlan:
    """The variant's plan as every command sees it (pipeline.load_plan); warnings go to stderr."""
    return warned(load_plan(State.layout, variant, base=base, platform=State.platform, lock_policy=policy))


def warned(loaded: LoadedPlan) -> LoadedPlan:
    for warning in loaded.warnings:
        tell(f"warning: {warning}")
    return loaded


def emit(lines: Iterable[Any]) -> None:
    for line in lines:
        out.print(line)


def say(text: str) -> None:
    """One line of plain text: paths and names in it are never read as Rich markup."""
    out.print(text, markup=False)


def tell(line: str) -> None:
    """A line of progress or a warning on stderr, never read as markup."""
    err.print(line, markup=False)


def tell_step(line: str) -> None:
    """A step of a longer job on stderr, indented under the line that started it."""
    tell(f"  {line}")


def write(text: str, *, stderr: bool = False) -> None:
    """Text as it is, to stdout (or stderr): a JSON document, or lines already made safe by errors.visible."""
    (sys.stderr if stderr else sys.stdout).write(text)


def plan_of(variant: str, base: str | None = None, policy: LockPolicy = LockPolicy.AUTO) -> Plan:
    return load(variant, base, policy).plan


def progress_printer(label: str) -> Callable[[Step, float], None]:
    """Show each BuildKit step that runs as it starts (none from the cache): live on a terminal, a line each in logs."""

    def show(step: Step, elapsed: float) -> None:
        if step.name.startswith(("internal", "context ")):
            return
        mins, secs = divmod(int(elapsed), 60)
        what = f"... {visible(step.said, keep_newlines=False)[:100]}" if step.said else step.command[:100]
        tell_step(f"{label} {mins:02d}:{secs:02d} [{step.name}] {what}")

    return show


# ------------------------------------------------------------------ hints: commands to paste

# The options that say which recipes, mods, base, cluster and proxy a command means. A hint's command repeats
# each one the user gave, where its verb takes it, so that it names the same plan, tag and nodes.
CARRIED = ("images", "mods", "base", "ca_cert", "cluster", "nodes", "registry")


def command_line(hint: Hint) -> str:
    """The hint's command as the user would type it here: this program, the global options they gave, the
    verb and its arguments, then the options they gave this verb that the hinted one takes too."""
    ctx = Command.invoked
    if ctx is None:
        return shlex.join([program(), *hint.words])
    root = ctx.find_root()
    target = root.command
    for word in hint.words:  # down to the hinted verb: `mod save` is a verb of the group `mod`
        sub = getattr(target, "get_command", lambda c, name: None)(root, word)
        if sub is None:
            break
        target = sub
    takes = {p.name for p in target.params if p.name}  # a group (`mod`, `wheels`) takes no option of its own
    return shlex.join([program(), *_given(root, set(CARRIED)), *hint.words, *_given(ctx, takes)])


def _given(ctx: Context, takes: set[str]) -> Iterator[str]:
    """The carried options given on the command line to ctx's command that `takes` holds, as words."""
    for param in ctx.command.params:
        if (param.name is None or param.name not in CARRIED or param.name not in takes or not param.opts
                or ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE):
            continue
        value = ctx.params.get(param.name)
        for one in value if isinstance(value, (list, tuple)) else [value]:
            if one is not None:
                yield from (param.opts[-1], str(getattr(one, "value", one)))


def next_step(lead: str, *words: str) -> str:
    """`lead `COMMAND``: a step to take next, written as a command to paste."""
    return f"{lead} `{command_line(Hint(lead, words))}`"


# ------------------------------------------------------------------ run

def console() -> None:
    """The command line as build.py and sparkforge.__main__ run it: a usage or sparkforge error, or output that cannot
    be written (exit 1), becomes one line on stderr; SIGTERM stops it, and the builds it started, as Ctrl-C does."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # from here a Ctrl-C unwinds, and cleans up
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        dockercli.exit_on_sigterm()
        _named_stdio()
        try:
            code = _run_app()
            if sys.stdout is not None:  # None: it failed, and said so
                sys.stdout.flush()
        except OSError as exc:  # output that cannot be written, where _run_app was not the one to say so
            code = _world_failed(exc)
        finally:
            dockercli.stop_all(exiting=True)
        sys.exit(code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(INTERRUPTED)


INTERRUPTED = 130  # the exit code of Ctrl-C (128 + SIGINT), as a shell gives it


def _run_app() -> int:
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        for line in exc.format_message().splitlines():  # the help text: our own lines
            say(line)
        return 2
    except UsageError as exc:
        return _report(f"error: {usage_error_line(exc, program())}", exc.exit_code)
    except SparkforgeError as exc:
        for line in exc.context:
            _report(f"  | {mask_secrets(visible(line, keep_newlines=False))}", 0)
        return _report(f"error: {exc.render(command_line)}", exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        code = INTERRUPTED
    except OSError as exc:  # the world (disk full, read-only, permissions) or a path the user gave that cannot be one
        return _world_failed(exc)
    except RecursionError:
        return _report("error: input nested too deeply to read", 2)
    if code == INTERRUPTED:  # also typer's Exit(130) for a Ctrl-C inside a verb, which comes back here as the code
        return _report("interrupted", INTERRUPTED)
    return code if isinstance(code, int) else 0


def _world_failed(exc: OSError) -> int:
    """An OSError as one line naming its path(s) (`cache/x: No space left on device`), and its exit code. A broken
    pipe on stdout (`| head` read what it wanted) is exit 1 without a line, as typer treats one during a command."""
    if exc.filename == "<stdout>":
        _drop("stdout")
        if exc.errno == errno.EPIPE:
            return 1
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    shown = " -> ".join(p if len(p) <= 160 else f"{p[:100]}...{p[-50:]}" for p in paths)  # a 300-character name: cut
    reason = exc.strerror or str(exc) or type(exc).__name__
    line = visible(f"{shown}: {reason}" if paths else reason, keep_newlines=False)
    return _report(f"error: {line}", 2 if exc.errno in INPUT_ERRNOS else 1)


def _report(line: str, code: int) -> int:
    try:
        tell(line)
    except OSError:  # stderr cannot be written either: the exit code is all that is left to say it
        _drop("stderr")
    return code


def _drop(attr: str) -> None:
    """No more output to a stream that failed: what its buffer still holds is not written again at exit."""
    file = getattr(sys, attr)
    if isinstance(file, io.TextIOWrapper):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, file.fileno())
        os.close(null)
    setattr(sys, attr, None)


# Errors of a path as given, not of the world: a name too long, a file where a folder must be, ...
INPUT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP})
