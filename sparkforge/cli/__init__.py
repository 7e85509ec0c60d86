"""The command line: a thin typer layer whose verbs follow the pipeline stages (`build.py` runs it).

Only this package reads flags and the environment. It may import every other package of sparkforge;
none imports it. `app` holds the typer app and what the verbs share; the verb modules register on it,
imported here in the order --help lists them.
"""

from . import main, cluster, wheels, pins, mods  # noqa: F401, I001 - each registers its verbs on app, in this order
from .app import app, run

__all__ = ["app", "run"]
