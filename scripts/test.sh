#!/usr/bin/env bash
# Install everything the tests need into .venv (Python 3.11) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "all,test"
# The dashboard tests drive Debian's Chromium (packages chromium, chromium-driver).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then apt_get="apt-get"; else apt_get="sudo apt-get"; fi
  $apt_get update -qq && DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq chromium chromium-driver >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
