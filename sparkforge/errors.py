"""The one exception family of sparkforge: every message names the file and the field at fault."""

from __future__ import annotations

from pathlib import Path


class SparkforgeError(Exception):
    """A user-facing error; the CLI prints it on one line and exits with code 2."""

    exit_code = 2

    def __init__(self, message: str, *, path: Path | str | None = None, field: str | None = None):
        self.path = str(path) if path is not None else None
        self.field = field
        self.detail = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        where = ""
        if self.path:
            where = _display(self.path)
            if self.field:
                where += f": {self.field}"
            where += ": "
        elif self.field:
            where = f"{self.field}: "
        return _one_line(f"{where}{self.detail}")


class ConfigError(SparkforgeError):
    """A recipe or mod.yaml is malformed, mistyped or refers to something that does not exist."""


class ModError(SparkforgeError):
    """A mod did not apply, or its verify check failed."""


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
    """The message on one line: a line break that came from a file or a tool is shown escaped."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _display(path: str) -> str:
    """Show a path relative to the working directory when it lies below it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)
