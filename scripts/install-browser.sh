#!/usr/bin/env bash
# What tests/acceptance/test_browser.py needs: Debian's Chromium and the playwright Python package.
# Playwright's own browser download (`playwright install`) is never used: the tests launch
# the system binary. Idempotent; safe to call on every CI run.
#
#   scripts/install-browser.sh            # uses .venv/bin/python
#   PY=/path/to/python scripts/install-browser.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CHROMIUM="${DA_CHROMIUM:-/usr/bin/chromium}"
PY="${PY:-.venv/bin/python}"

if [ ! -x "$CHROMIUM" ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: no $CHROMIUM and no apt-get; install Chromium and set DA_CHROMIUM" >&2
    exit 1
  fi
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  # Fonts too, so that screenshots do not depend on what else the machine happens to have.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    chromium fonts-dejavu-core fonts-liberation >/dev/null
fi

# requirements.txt lists playwright, so `make venv` normally installed it already.
if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "playwright>=1.40"
fi

"$CHROMIUM" --version 2>/dev/null
"$PY" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
