"""The `sparkforge` console script, and `python -m sparkforge`: the command line as build.py runs it.

A Ctrl-C while the modules load ends the process at once, as in build.py: a KeyboardInterrupt there could land
in an importlib callback that drops it. console() puts Python's own handler back before it runs the command.
"""

import os
import signal


def _stop_at_once(_signum: int, _frame: object) -> None:
    os.write(2, b"interrupted\n")
    os._exit(130)


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # left alone where a shell ignores it
        signal.signal(signal.SIGINT, _stop_at_once)
    from .cli.app import console

    console()


if __name__ == "__main__":
    main()
