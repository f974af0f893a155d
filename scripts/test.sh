#!/usr/bin/env bash
# Install everything the tests need into .venv (Python 3.11) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "all,test"
# The dashboard tests drive Debian's Chromium; the replica tests put Debian's nginx in front.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium chromium-driver)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then apt_get="apt-get"; else apt_get="sudo apt-get"; fi
  $apt_get update -qq && DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq "${missing[@]}" >/dev/null
fi
# The habits that keep the code this way: lint, format and types (strict on ckptstore/), then the suite.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The few long soak and outage runs are marked `slow` and left out, so the whole run stays within 30
# minutes on 2 cores; `bash scripts/test.sh -m slow` runs them (a later -m replaces this one). Two
# workers, each taking whole test files (module fixtures stay shared): most tests wait on the processes
# they start, and the suite runs in two thirds of the time (`-n 0` runs it in one process).
exec .venv/bin/python -m pytest -m "not slow" -n 2 --dist loadfile --durations=40 "$@"
