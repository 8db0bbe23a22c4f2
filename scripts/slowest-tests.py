"""Print the slowest tests of a `make test` (what the passes wrote to DA_TEST_TIMES); with
--budget, fail when one took longer than that (CI: 60 s, what a test of the default run may
take).

    python scripts/slowest-tests.py test-times.txt [--top 30] [--budget 60]

Each line of the file is "seconds<TAB>database<TAB>test id" (tests/conftest.py writes them);
a test's time is its setup, call and teardown together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("times", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--budget", type=float, default=None, help="seconds a test may take")
    args = parser.parse_args()
    if not args.times.exists():
        print(f"{args.times}: no test times were written", file=sys.stderr)
        return 1
    rows = []
    for line in args.times.read_text(encoding="utf-8").splitlines():
        seconds, database, test = line.split("\t", 2)
        rows.append((float(seconds), database, test))
    rows.sort(reverse=True)
    total = sum(seconds for seconds, _, _ in rows)
    print(f"The {min(args.top, len(rows))} slowest of {len(rows)} tests ({total:.0f} s in all):")
    for seconds, database, test in rows[: args.top]:
        print(f"  {seconds:7.2f} s  {database:<10} {test}")
    over = [row for row in rows if args.budget is not None and row[0] > args.budget]
    if over:
        print(f"{len(over)} test(s) took longer than {args.budget:.0f} s, what a test may take:")
        for seconds, database, test in over:
            print(f"  {seconds:7.2f} s  {database:<10} {test}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
