#!/usr/bin/env bash
# The main job on the embedded defaults: install, start the service (SQLite + local storage),
# train a small Keras model, kill it mid-epoch, resume from the last good position, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "server,tf"
exec .venv/bin/python scripts/demo.py "$@"
