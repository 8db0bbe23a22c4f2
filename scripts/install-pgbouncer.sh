#!/usr/bin/env bash
# What the PgBouncer variants of tests/acceptance/test_crash.py need: Debian's pgbouncer binary. The tests
# start their own private PgBouncer (tests/pgbouncer.py); the Debian service is never started
# here. Idempotent; safe to call on every CI run.
#
#   scripts/install-pgbouncer.sh
set -euo pipefail
cd "$(dirname "$0")/.."

find_pgbouncer() {
  command -v pgbouncer 2>/dev/null || { [ -x /usr/sbin/pgbouncer ] && echo /usr/sbin/pgbouncer; }
}

if ! find_pgbouncer >/dev/null; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-pgbouncer: no pgbouncer and no apt-get; install PgBouncer and put it on PATH" >&2
    exit 1
  fi
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  # Keep the package's service from starting: a policy-rc.d that refuses every start, unless
  # the machine already has one (container images usually do). Removed again on exit.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    trap '$sudo rm -f "$policy"' EXIT
  fi
  if ! apt-cache show pgbouncer >/dev/null 2>&1; then
    $sudo apt-get update -qq
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq pgbouncer >/dev/null || {
    # A stale package list: refresh it once and retry.
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq pgbouncer >/dev/null
  }
fi

"$(find_pgbouncer)" --version | head -n 1
