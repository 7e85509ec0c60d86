"""The command line: a thin typer layer whose verbs follow the pipeline stages; only it reads flags and the
environment, and no other package imports it. `app` holds what the verbs share; the verb modules register on it."""

from . import main, cluster, wheels, pins, mods  # noqa: F401, I001 - each registers its verbs on app, in this order
from .app import app

__all__ = ["app"]
