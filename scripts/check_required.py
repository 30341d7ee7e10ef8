#!/usr/bin/env python3
"""Fails when a build tree does not register a test that every full run of such a tree must run.

ctest runs what CMake registered, and CMake registers some tests only where what they need was built
(the Python-driven tests only where the examples are, the mixed-language tests only against
LibTorch 2.x): a tree configured without them would report 100% passed with those tests absent, and
scripts/check_skips.py, which reads what ran, cannot see a test that was never there.
tests/tests_required.txt names the tests a full run must contain, and where; this compares it with
what the tree registered (`ctest -N`), before the run.

  scripts/check_required.py BUILD_DIR

tests/tests_required.txt, one entry a line: PATTERN CONDITION
  PATTERN    a ctest name; * and ? are wildcards (the pattern must match at least one test)
  CONDITION  as in tests/skips_allowed.txt (always, torch<2, torch>=2, asan, tsan, ...): the trees
             whose full run must contain it
Exit status: 0 every required test is registered, 1 some is not, 2 the tree cannot be listed.
"""
import fnmatch
import os
import subprocess
import sys

from check_skips import ROOT, holds, machine_facts

REQUIRED = os.path.join(ROOT, "tests", "tests_required.txt")


def read_required():
    entries = []
    with open(REQUIRED) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{REQUIRED}:{n}: expected PATTERN CONDITION, got {line!r}")
            entries.append((n, parts[0], parts[1]))
    return entries


def registered(build_dir):
    out = subprocess.run(["ctest", "--test-dir", build_dir, "-N"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip() or out.stdout.strip())
    names = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("Test") and ": " in line:
            names.append(line.split(": ", 1)[1].strip())
    return names


def main(argv):
    if len(argv) != 1:
        print(__doc__.split("\n\n")[2].strip(), file=sys.stderr)
        return 2
    build_dir = argv[0]
    try:
        names = registered(build_dir)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"check_required: cannot list the tests of {build_dir}: {e}", file=sys.stderr)
        return 2
    facts = machine_facts(build_dir)
    missing = [(n, pattern) for n, pattern, condition in read_required()
               if holds(condition, facts) and not any(fnmatch.fnmatchcase(t, pattern) for t in names)]
    if missing:
        print(f"check_required: {build_dir} registers no test for {len(missing)} required name(s) "
              f"(LibTorch {facts['torch_major']}, sanitizer {facts['sanitizer']}):", file=sys.stderr)
        for n, pattern in missing:
            print(f"  tests/tests_required.txt:{n}: {pattern}", file=sys.stderr)
        print("Build what registers them (scripts/setup.sh installs what the tests need; the examples and .venv "
              "must be there), or, if a test was renamed or removed on purpose, change tests/tests_required.txt.",
              file=sys.stderr)
        return 1
    print(f"check_required: {build_dir} registers every required test ({len(names)} registered)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
