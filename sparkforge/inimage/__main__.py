"""Run the image's tool: `python3 -I -B /opt/sparkforge/inimage COMMAND ...` in an image, or
`python -m sparkforge.inimage COMMAND ...` on the host."""

import importlib
import importlib.util
import os
import sys


def _package_name() -> str:
    """The name the folder is imported under; run as a folder, it is loaded by path as `inimage`."""
    if __package__:
        return __package__
    here = os.path.dirname(os.path.abspath(__file__))
    # Python put the folder itself first on sys.path; its modules are read only as the package's.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.util.spec_from_file_location("inimage", os.path.join(here, "__init__.py"),
                                                  submodule_search_locations=[here])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {here} as the package inimage")
    package = importlib.util.module_from_spec(spec)
    sys.modules["inimage"] = package
    spec.loader.exec_module(package)
    return "inimage"


if __name__ == "__main__":
    sys.exit(importlib.import_module(_package_name() + ".cli").main())
