#!/usr/bin/env python3
"""sparkforge command line: `./build.py --help` (or `python3 build.py --help`). Run it as a script.

It runs in the project environment, `.venv` beside this file, which `make venv` makes from
requirements.lock: started by any other Python, it starts itself again under `.venv/bin/python`.
Without a `.venv` it runs only where the running Python has what requirements.lock lists, and else
says in one line to run `make venv`.
"""

import os
import signal
import sys
from typing import NoReturn

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv")
# Set for the one start under .venv/bin/python, so that an environment that is not one (no pyvenv.cfg)
# cannot start itself again and again.
AGAIN = "SPARKFORGE_VENV_STARTED"


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(1)


def _in_project_env() -> bool:
    return os.path.realpath(sys.prefix) == os.path.realpath(VENV)


def _use_project_env() -> None:
    """Start again under .venv/bin/python when it exists and this is another interpreter."""
    python = os.path.join(VENV, "bin", "python")
    if _in_project_env() or os.environ.get(AGAIN) or not os.path.exists(python):
        return
    os.environ[AGAIN] = "1"
    try:
        os.execv(python, [python, sys.argv[0], *sys.argv[1:]])
    except OSError as exc:
        _fail(f"{python} cannot run ({exc.strerror}): make the environment again with `make venv`")


def _missing(exc: ModuleNotFoundError) -> NoReturn:
    """One line for a package of requirements.lock that this interpreter lacks."""
    if os.path.exists(os.path.join(VENV, "bin", "python")):
        where = f"the project environment {VENV}"
    else:
        where = f"{sys.executable}, and there is no project environment {VENV} yet"
    _fail(f"{exc.name} is not installed in {where}: run `make venv` in {HERE} (it makes .venv from "
          "requirements.lock), then run build.py again")


def _stop_at_once(_signum: int, _frame: object) -> None:
    """Ctrl-C while the modules load: nothing is written yet, so the process ends here. A KeyboardInterrupt
    raised there could land in one of importlib's own callbacks, which print and drop it, and the command
    would go on as if no Ctrl-C had come."""
    os.write(2, b"interrupted\n")
    os._exit(130)


if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # left alone where a shell ignores it
        signal.signal(signal.SIGINT, _stop_at_once)  # console() puts Python's own back once it runs
    try:
        _use_project_env()
        os.environ.pop(AGAIN, None)  # not for the processes this one starts
        try:
            from sparkforge.cli.app import console
        except ModuleNotFoundError as exc:
            if not exc.name or exc.name.partition(".")[0] == "sparkforge":
                raise
            _missing(exc)

        console()  # as the installed `sparkforge` script runs it
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
