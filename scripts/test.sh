#!/usr/bin/env bash
# Install everything the tests need into .venv (Python 3.11) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "all,test"
exec .venv/bin/python -m pytest "$@"
