#!/usr/bin/env bash
# Make sure a PostgreSQL server answers on 127.0.0.1:5432; start the local cluster if not.
set -euo pipefail
if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  exit 0
fi
if command -v pg_lsclusters >/dev/null 2>&1; then
  version=$(pg_lsclusters -h | awk '{print $1; exit}')
  if [ -n "$version" ]; then
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
fi
for _ in $(seq 1 30); do
  pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && exit 0
  sleep 1
done
echo "PostgreSQL is not reachable on 127.0.0.1:5432" >&2
exit 1
