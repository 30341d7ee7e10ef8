#!/usr/bin/env python3
"""Prints the slowest tests of the last ctest run in a build tree, and the run's total test time.

  scripts/slowest_tests.py BUILD_DIR [N]      (N: how many, default 15)

scripts/test.sh calls it after each tree's ctest, so that CI's log shows where the time went (the
per-test times are in ctest's own lines above it); docs/benchmarks.md keeps the list of a fresh run.
It reads BUILD_DIR/Testing/Temporary/LastTest.log: each test's "N/M Test: NAME" header and the
"Test time = S sec" line after it. Exit status 2 when there is no log to read.
"""
import os
import re
import sys

TEST_START = re.compile(r"^\d+/\d+ Test: (.+)$")
TEST_TIME = re.compile(r"^Test time =\s*([0-9.]+) sec$")


def times(log_path):
    """[(seconds, name)] of every test in the log, in the order they ran."""
    out, name = [], None
    with open(log_path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = TEST_START.match(line)
            if m:
                name = m.group(1)
                continue
            m = TEST_TIME.match(line)
            if m and name is not None:
                out.append((float(m.group(1)), name))
                name = None
    return out


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    log = os.path.join(sys.argv[1], "Testing", "Temporary", "LastTest.log")
    n = int(sys.argv[2]) if len(sys.argv) == 3 else 15
    if not os.path.exists(log):
        print(f"slowest_tests: no ctest log at {log}", file=sys.stderr)
        return 2
    rows = times(log)
    total = sum(s for s, _ in rows)
    print(f"=== {sys.argv[1]}: {len(rows)} tests, {total:.0f} s of test time; the {min(n, len(rows))} slowest:")
    for s, name in sorted(rows, reverse=True)[:n]:
        print(f"  {s:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
