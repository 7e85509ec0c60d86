"""The one exception family of sparkforge: every message names the file and the field at fault."""

from __future__ import annotations

import re
import shlex
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable


@dataclass(frozen=True)
class Hint:
    """A command to run next (`build testvllm`) and the words before it ("build it first with"); the command
    line adds the user's options that name the same variant, image and cluster, so that it can be pasted."""

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
        # Lines the command line shows above the error (a failed build step's last output), each as it was written.
        self.context: tuple[str, ...] = ()
        super().__init__(message)

    def __str__(self) -> str:
        return self.render()

    def render(self, command: Callable[[Hint], str] = Hint.plain) -> str:
        """The one line; `command` writes the hint's command (the command line adds the user's options)."""
        where = f"{_display(self.path)}: " if self.path else ""
        where += f"{self.field}: " if self.field else ""
        hint = f"; {self.hint.lead} `{command(self.hint)}`" if self.hint else ""
        return visible(f"{where}{self.detail}{hint}", keep_newlines=False)


class ConfigError(SparkforgeError):
    """A recipe or mod.yaml is malformed, mistyped or refers to something that does not exist."""


class BuildError(SparkforgeError):
    """An image build, tag or smoke test failed."""

    exit_code = 1


class DownloadError(SparkforgeError):
    """Something named by URL (a file, a registry, a git remote) could not be fetched: not bad input, so exit 1."""

    exit_code = 1


class DistributeError(SparkforgeError):
    """Moving an image to the nodes of a cluster failed."""

    exit_code = 1


# Characters that are not text on a terminal: controls (C0, DEL, C1: an escape sequence's ESC, a bell, a
# carriage return), format characters (bidirectional overrides that reorder what a line shows, zero-width
# marks), line and paragraph separators, and lone surrogates (a file name's undecodable bytes).
_NOT_TEXT = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\t": "\\t", "\r": "\\r", "\n": "\\n"}
# Everything between a URL's `://` and its last `@` is its user and password, whatever it holds (a `/`, `#`, `@`
# not percent-encoded): it goes nowhere, not even into an error message (a user alone may be a token); an ssh
# node's user name alone is no secret and stays. In free text a URL ends at the first blank.
_WORD = re.compile(r"[^ \t\n\r\f\v]+")
_SCHEME_END = re.compile(r"[a-zA-Z0-9+.-]://")  # the end of a URL's scheme; found in one pass, whatever the text
_SSH = re.compile(r"(?:.*[^a-zA-Z0-9+.-])?ssh", re.IGNORECASE | re.DOTALL)


def mask_url(text: str) -> str:
    """One URL (or one word of free text; blanks included) as it may be shown: as mask_secrets, for its first URL."""
    found = _SCHEME_END.search(text) if "@" in text else None
    if found is None:
        return text
    end = found.end()
    userinfo, at, rest = text[end:].rpartition("@")
    if not at:
        return text
    keep = ":" not in userinfo and _SSH.fullmatch(text, max(0, end - 7), end - 3) is not None
    return f"{text[:end]}{userinfo if keep else '***'}@{rest}"


def mask_secrets(text: str) -> str:
    """text with the password of every URL in it, and the user of every URL but ssh's, replaced by `***`."""
    return _WORD.sub(lambda word: mask_url(word.group()), text) if "@" in text else text


def escaped(ch: str) -> str:
    """One character as shown: itself when it is text, else its escape (`\\n`, `\\x1b`, `\\u202e`; an
    undecodable byte of a file name, `\\xff`)."""
    if ch.isprintable() or ch == " " or unicodedata.category(ch) not in _NOT_TEXT:
        return ch
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000
                              else f"\\U{code:08x}")


def visible(text: str, *, keep_newlines: bool = True) -> str:
    """External text made safe for a terminal, the one rule for everything printed: every character not text
    (_NOT_TEXT) escaped, URL passwords masked; error lines and the CLI's tables keep no line break."""
    text = mask_secrets(text)
    if text.isprintable():
        return text
    return "".join(ch if ch == "\n" and keep_newlines else escaped(ch) for ch in text)


def _display(path: str) -> str:
    """A path relative to the working directory when below it; a part longer than a file name can be is cut."""
    p = Path(path)
    try:
        shown = str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        shown = str(p)
    return "/".join(part if len(part) <= 255 else f"{part[:40]}...{part[-20:]}" for part in shown.split("/"))
