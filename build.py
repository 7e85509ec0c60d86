#!/usr/bin/env python3
"""sparkforge command line. Run it as a script: `python build.py --help`."""

import sys

if __name__ == "__main__":
    try:  # Ctrl-C while the modules load, before the CLI's own handler, is one line too
        from sparkforge.build import dockercli
        from sparkforge.cli import run

        dockercli.exit_on_sigterm()
        try:
            run()
        finally:
            dockercli.stop_all()  # a build or a save still running when the CLI is stopped
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
