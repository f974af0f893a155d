#!/usr/bin/env bash
# The main job on the embedded defaults: install, start the service (SQLite + local storage),
# train a small Keras model, kill it mid-epoch, resume from the last good position, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[server,tf]"
exec .venv/bin/python scripts/demo.py "$@"
