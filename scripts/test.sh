#!/usr/bin/env bash
# Install everything the tests need into .venv (Python 3.11) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# One resolver run for every extra: s3fs/gcsfs/aiobotocore pins must agree with moto's botocore.
.venv/bin/python -m pip install --quiet -e ".[all,test]"
exec .venv/bin/python -m pytest "$@"
