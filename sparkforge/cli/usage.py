"""How the command line shows itself: help that names values by the words a user types, and usage errors as one line.

typer's Rich help shows a value type beside every parameter (`--help <bool>`) and a required argument in braces
(`{VARIANT}`); here a flag shows no type, an argument only its metavar, and an option its metavar (`--base REF`).
"""

from __future__ import annotations

import inspect
import re
from typing import Any, TypeVar
from collections.abc import Callable

import typer
from typer._click.core import Context, Parameter
from typer._click.exceptions import BadParameter, MissingParameter, NoSuchOption, UsageError
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption


class _Argument(TyperArgument):
    """An argument shown by its metavar alone: VARIANT when required, [VARIANTS]... when optional."""

    def display_type_rich(self, ctx: Context) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")


def readable(param: Parameter) -> Parameter:
    """The parameter as help shows it: an argument by its metavar, a flag without a value type."""
    if isinstance(param, TyperArgument) and not isinstance(param, _Argument):
        param.__class__ = _Argument  # the same object and state; only how help names it differs
    elif isinstance(param, TyperOption) and (param.is_flag or param.count) and param.metavar is None:
        param.metavar = ""  # a flag takes no value, so help shows no type for it
    return param


class _Readable:
    """What Command and Group share: their parameters and --help shown by readable(), their help flowed."""

    params: list[Parameter]
    help: str | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            readable(param)
        if self.help is not None:
            # Rich help keeps every line break: a paragraph's lines are joined so that the terminal wraps them, but a
            # paragraph with indented lines (`Examples:` and its commands) keeps its lines.
            paragraphs = inspect.cleandoc(self.help).split("\n\n")
            self.help = "\n\n".join(p if p.startswith(" ") or "\n " in p else " ".join(p.split()) for p in paragraphs)

    def get_help_option(self, ctx: Context) -> TyperOption | None:
        # The mixin's super() is click's Command in the classes that use it; readable() gives back what it is given.
        option = super().get_help_option(ctx)  # type: ignore[misc]
        return None if option is None else readable(option)  # type: ignore[return-value]


class Command(_Readable, TyperCommand):
    """A verb of the command line."""

    invoked: Context | None = None  # the verb that runs: what the user gave it, and the command line above it

    def invoke(self, ctx: Context) -> Any:
        Command.invoked = ctx
        return super().invoke(ctx)


class Group(_Readable, TyperGroup):
    """The command line itself, and a verb with verbs of its own (`mod`, `wheels`)."""


Verb = TypeVar("Verb", bound=Callable[..., Any])


class App(typer.Typer):
    """typer.Typer whose verbs and groups show themselves as above, and show their help when given no verb."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=Group, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                         **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Verb], Verb]:
        return super().command(*args, **{"cls": Command, **kwargs})


def usage_error_line(exc: UsageError, prog: str) -> str:
    """A usage error as one line in the style of every other error: the verb, what is wrong in lower case,
    and the usage to follow (`diff: missing argument B; usage: ./build.py diff [OPTIONS] A B`)."""
    ctx = exc.ctx
    words = ctx.command_path.split()[1:] if ctx is not None else []
    where = f"{' '.join(words)}: " if words else ""
    if isinstance(exc, MissingParameter) and exc.param is not None:
        what = f"missing {exc.param_type or exc.param.param_type_name} {_name(exc.param)}"
    elif isinstance(exc, NoSuchOption):
        what = f"no such option {exc.option_name}"
        if exc.possibilities:
            what += f" (did you mean {' or '.join(sorted(exc.possibilities))}?)"
    elif isinstance(exc, BadParameter) and exc.param is not None:
        what = f"{_name(exc.param)}: {_lower(exc.message.removeprefix('Value error, '))}"
    else:
        what = _lower(exc.format_message())
    if ctx is None:
        return f"{where}{what}"
    pieces = " ".join(ctx.command.collect_usage_pieces(ctx))
    usage = " ".join([prog, *words, pieces])
    more = f"`{' '.join([prog, *words])} --help` says more" if words else f"`{prog} --help` lists the commands"
    return f"{where}{what}; usage: {usage} ({more})"


def _name(param: Parameter) -> str:
    if isinstance(param, TyperOption) and param.opts:
        return max(param.opts, key=len)
    return param.metavar or (param.name or "").upper()


def _lower(text: str) -> str:
    """A library's sentence as the rest of an error line: lower case first, no full stop, one line, and its
    suggestion in parentheses (`no such command 'lsit' (did you mean 'list'?)`)."""
    text = _SUGGESTION.sub(r" (did you mean \1?)", " ".join(text.split())).rstrip(".")
    return text[:1].lower() + text[1:] if text[1:2].islower() or len(text) < 2 else text


_SUGGESTION = re.compile(r"\.? Did you mean (.+?)\?$")
