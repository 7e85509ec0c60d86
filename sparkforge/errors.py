"""The one exception family of sparkforge: every message names the file and the field at fault."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Hint:
    """A command to run next, as its verb and arguments (`build testvllm`), and the words before it
    ("build it first with"). The library names only what it knows; the command line writes the whole
    command, with the options the user gave that name the same variant, image and cluster
    (`--images`, `--base`, ...), so that it can be pasted."""

    lead: str
    words: tuple[str, ...]

    def plain(self) -> str:
        """The command as far as the library knows it."""
        return shlex.join(("build.py", *self.words))


class SparkforgeError(Exception):
    """A user-facing error; the CLI prints it on one line and exits with code 2."""

    exit_code = 2

    def __init__(self, message: str, *, path: Path | str | None = None, field: str | None = None,
                 hint: Hint | None = None):
        self.path = str(path) if path is not None else None
        self.field = field
        self.detail = message
        self.hint = hint
        super().__init__(message)

    def __str__(self) -> str:
        return self.render()

    def render(self, command: Callable[[Hint], str] = Hint.plain) -> str:
        """The one line; `command` writes the hint's command (the command line adds the user's options)."""
        where = ""
        if self.path:
            where = _display(self.path)
            if self.field:
                where += f": {self.field}"
            where += ": "
        elif self.field:
            where = f"{self.field}: "
        hint = f"; {self.hint.lead} `{command(self.hint)}`" if self.hint else ""
        return _one_line(f"{where}{self.detail}{hint}")


class ConfigError(SparkforgeError):
    """A recipe or mod.yaml is malformed, mistyped or refers to something that does not exist."""


class BuildError(SparkforgeError):
    """An image build, tag or smoke test failed."""

    exit_code = 1


class DownloadError(SparkforgeError):
    """A file named by URL could not be fetched (network, TLS, HTTP status): not bad input, so exit 1."""

    exit_code = 1


class DistributeError(SparkforgeError):
    """Moving an image to the nodes of a cluster failed."""

    exit_code = 1


def _one_line(text: str) -> str:
    """The message on one line: a line break or any other control character that came from a file or a
    tool is shown escaped, and a password in a URL is masked."""
    return visible(text, keep_newlines=False)


_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_NAMED = {"\t": "\\t", "\r": "\\r", "\n": "\\n"}
# scheme://user:password@host: the part before '@' goes nowhere, not even into an error message (a
# web URL's user alone may be a token); an ssh node's user name alone is no secret and stays.
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#\s]*)@")  # up to the last @ before the host


def _mask(m: re.Match) -> str:
    scheme, userinfo = m.group(1), m.group(2)
    keep = scheme.lower() == "ssh://" and ":" not in userinfo
    return f"{scheme}{userinfo if keep else '***'}@"


def mask_secrets(text: str) -> str:
    """text with the password of every URL in it, and the user of every URL but ssh's, replaced by `***`."""
    return _USERINFO.sub(_mask, text)


def visible(text: str, *, keep_newlines: bool = True) -> str:
    """External text made safe for a terminal: every control character (an escape sequence's ESC, a
    carriage return, a bell) is shown as its escape (`\\x1b`), and URL passwords are masked. The one
    helper for everything printed: error lines and, through the CLI's console, every table and line."""
    def shown(match: re.Match[str]) -> str:
        ch = match.group()
        return _NAMED.get(ch) or f"\\x{ord(ch):02x}"

    text = _CONTROL.sub(shown, mask_secrets(text))
    return text if keep_newlines else text.replace("\n", "\\n")


def _display(path: str) -> str:
    """Show a path relative to the working directory when it lies below it; a name longer than any file name
    can be (255) is cut in the middle."""
    p = Path(path)
    try:
        shown = str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        shown = str(p)
    return "/".join(part if len(part) <= 255 else f"{part[:40]}...{part[-20:]}" for part in shown.split("/"))
