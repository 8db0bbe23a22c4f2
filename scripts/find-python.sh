#!/usr/bin/env bash
# Print the path of a working python interpreter of the given minor version (e.g. 3.12),
# looking at PATH and at pyenv's versions; exit 1 if there is none.
set -u
want="$1"
candidates=("python$want")
if command -v pyenv >/dev/null 2>&1; then
  for dir in "$(pyenv root)"/versions/"$want".*/bin; do
    candidates+=("$dir/python$want")
  done
fi
for candidate in "${candidates[@]}"; do
  if "$candidate" -c 'import sys, venv' >/dev/null 2>&1; then
    command -v "$candidate" 2>/dev/null || echo "$candidate"
    exit 0
  fi
done
exit 1
