#!/usr/bin/env bash
# Create or update the project environment from requirements.lock (every package pinned and hashed).
#
# Usage: scripts/venv.sh VENV PYTHON
#   VENV    the environment's folder (the Makefile uses .venv)
#   PYTHON  the interpreter to base it on (python3 >= 3.10)
#
# Nothing is installed outside VENV: no system packages, no user site, no other Python. With uv on
# PATH it is used (faster, and it needs no python3-venv package); otherwise `PYTHON -m venv` and pip.
# The checkout itself is not installed: build.py and the tests import sparkforge from the checkout.
set -euo pipefail

VENV=${1:?usage: scripts/venv.sh VENV PYTHON}
PYTHON=${2:?usage: scripts/venv.sh VENV PYTHON}
LOCK="$(cd "$(dirname "$0")/.." && pwd)/requirements.lock"
die() { echo "venv: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "$PYTHON not found; give another with PYTHON=... (3.10 or newer)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$PYTHON is $("$PYTHON" -V 2>&1); sparkforge needs 3.10 or newer (give one with PYTHON=...)"

# A half-made environment is never left to look whole: the stamp is written last, by the Makefile.
if command -v uv >/dev/null; then
  echo "venv: $VENV from requirements.lock with $(uv --version)"
  [ -x "$VENV/bin/python" ] || uv venv --quiet --python "$PYTHON" "$VENV"
  uv pip sync --quiet --require-hashes --python "$VENV/bin/python" "$LOCK"
else
  echo "venv: $VENV from requirements.lock with $("$PYTHON" -V) -m venv and pip"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" 2>/dev/null || {
      rm -rf "$VENV"
      die "$PYTHON -m venv failed (on Debian and Ubuntu it needs the python3-venv package); or install uv"
    }
  fi
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install --quiet --require-hashes \
    --no-deps -r "$LOCK" || die "installing requirements.lock into $VENV failed (see pip's message above)"
fi
