#!/usr/bin/env python3
"""sparkforge command line. Run it as a script: `python build.py --help`."""

from sparkforge import dockercli
from sparkforge.cli import run

if __name__ == "__main__":
    dockercli.exit_on_sigterm()
    try:
        run()
    finally:
        dockercli.stop_all()  # a build or a save still running when the CLI is stopped
