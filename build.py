#!/usr/bin/env python3
"""sparkforge command line. Run it as a script: `python build.py --help`."""

from sparkforge.cli import run

if __name__ == "__main__":
    run()
