#!/usr/bin/env python3
"""Fails when the last ctest run in a build tree skipped a test that should have run on this machine.

ctest counts a skipped test as not failed, and a test file whose cases skip one by one still reports
Passed, so a missing tool or a broken setup can silently turn the suite into fewer tests. After each
ctest run (scripts/test.sh calls this), this reads what the run skipped and compares it with
tests/skips_allowed.txt, the tests that may skip and on which machines.

  scripts/check_skips.py BUILD_DIR

What counts as skipped, from BUILD_DIR/Testing/Temporary:
  * a ctest test reported Skipped (LastTestsDisabled.log, when written by the run LastTest.log holds),
    or one that printed `SKIPPED: REASON` (the tests/gpu programs, before they exit 77);
  * inside a test's output (LastTest.log): `dtrain-test: skipped ID: REASON` lines from
    tests/common/run_unittest.py, and GoogleTest's `[  SKIPPED ] Suite.Name (N ms)` lines.
Exit status: 0 every skip is allowed here, 1 some skip is not, 2 no ctest log to read.
"""
import fnmatch
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = os.path.join(ROOT, "tests", "skips_allowed.txt")
sys.path.insert(0, os.path.join(ROOT, "tests", "common"))
from proc_util import non_loopback_ipv4  # noqa: E402  (the tests' own test for the same fact)

RANK_PREFIX = re.compile(r"^\[rank \d+\] ")  # dtrain-run's prefix on each worker's line
TEST_START = re.compile(r"^\d+/\d+ Test: (.+)$")
RUNNER_SKIP = re.compile(r"^(?:\[rank \d+\] )?dtrain-test: skipped (.+?): (.*)$")
GTEST_SKIP = re.compile(r"^(?:\[rank \d+\] )?\[  SKIPPED \] (\S+) \(\d+ ms\)$")
# A reason a program printed itself before exiting 77 (tests/gpu), shown with the skip.
OWN_REASON = re.compile(r"^(?:\[rank \d+\] )?SKIPPED: (.*)$")


def machine_facts(build_dir):
    """What the CONDITION column of tests/skips_allowed.txt can test."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        gpus = sum(line.startswith("GPU ") for line in out.splitlines())
    except (OSError, subprocess.SubprocessError):
        gpus = 0
    torch_major, sanitize, fuzz_missing, per_case = None, "OFF", "", False
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            cache = f.read()
        m = re.search(r"^DTRAIN_TORCH_MAJOR:INTERNAL=(\d+)$", cache, re.M)
        torch_major = int(m.group(1)) if m else None
        m = re.search(r"^DTRAIN_SANITIZE:\w+=(.*)$", cache, re.M)
        sanitize = m.group(1) if m else "OFF"
        # Why the configure found no clang++ able to build libFuzzer targets (tests/fuzz/CMakeLists.txt).
        m = re.search(r"^DTRAIN_FUZZ_MISSING:INTERNAL=(.*)$", cache, re.M)
        fuzz_missing = m.group(1) if m else ""
        # Whether each GoogleTest case of the unit programs is a ctest test (tests/CMakeLists.txt).
        per_case = re.search(r"^DTRAIN_TEST_PER_CASE:BOOL=(ON|TRUE|1|YES)$", cache, re.M | re.I) is not None
    except OSError:
        pass
    # The tree's sanitizers (CMakeLists.txt: DTRAIN_SANITIZE ON is AddressSanitizer + UBSan).
    sanitizer = {"thread": "tsan"}.get(sanitize, "asan" if sanitize.upper() in ("ON", "TRUE", "1", "YES") else None)
    return {"root": os.geteuid() == 0, "gpus": gpus, "torch_major": torch_major,
            "loopback_only": non_loopback_ipv4() is None, "sanitizer": sanitizer,
            "no_libfuzzer": bool(fuzz_missing), "per_case": per_case}


def holds(condition, facts):
    if "," in condition:  # a,b: both hold
        return all(holds(c, facts) for c in condition.split(","))
    if condition in ("per-case", "whole-programs"):  # the unit programs' cases as tests, or each program
        return facts["per_case"] == (condition == "per-case")
    if condition == "always":
        return True
    if condition in ("root", "not-root"):
        return facts["root"] == (condition == "root")
    if condition == "loopback-only":
        return facts["loopback_only"]
    if condition in ("asan", "tsan"):
        return facts["sanitizer"] == condition
    if condition == "no-libfuzzer":
        return facts["no_libfuzzer"]
    m = re.fullmatch(r"gpus<(\d+)", condition)
    if m:
        return facts["gpus"] < int(m.group(1))
    m = re.fullmatch(r"torch(<|>=)(\d+)", condition)
    if m:
        major = facts["torch_major"]
        if major is None:
            return False
        return major < int(m.group(2)) if m.group(1) == "<" else major >= int(m.group(2))
    raise ValueError(f"{ALLOWED}: unknown condition {condition!r}")


def read_allowed():
    entries = []
    with open(ALLOWED) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 2)
            if len(parts) < 3:
                raise ValueError(f"{ALLOWED}:{n}: expected PATTERN CONDITION REASON, got {line!r}")
            entries.append(tuple(parts))
    return entries


def test_outputs(log_path):
    """{ctest name: its output lines} from LastTest.log."""
    outputs, current = {}, None
    with open(log_path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = TEST_START.match(line)
            if m:
                current = outputs.setdefault(m.group(1), [])
            elif current is not None:
                current.append(line)
    return outputs


def skipped_ctests(tmp, log_path, names):
    """ctest names the run reported Skipped. ctest rewrites LastTestsDisabled.log only when a run
    skipped something, within milliseconds of closing LastTest.log: a file more than a second older
    belongs to an earlier run (every skip in this suite also prints a line, read separately)."""
    path = os.path.join(tmp, "LastTestsDisabled.log")
    if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(log_path) - 1.0:
        return set()
    with open(path) as f:
        return {line.strip().split(":", 1)[1] for line in f if ":" in line} & set(names)


def collect_skips(build_dir):
    """[(ctest name, test id or None, reason)] for everything the last run skipped."""
    tmp = os.path.join(build_dir, "Testing", "Temporary")
    log_path = os.path.join(tmp, "LastTest.log")
    outputs = test_outputs(log_path)
    skips = []
    for name, lines in outputs.items():
        inner = {}
        for i, line in enumerate(lines):
            m = RUNNER_SKIP.match(line)
            if m:
                inner.setdefault(m.group(1), m.group(2))
            m = GTEST_SKIP.match(line)
            if m:  # GoogleTest prints the GTEST_SKIP() message on the line before
                inner.setdefault(m.group(1), RANK_PREFIX.sub("", lines[i - 1]) if i else "")
        skips += [(name, test, reason) for test, reason in sorted(inner.items())]
    inside = {name for name, _, _ in skips}
    own = {name: [m.group(1) for m in map(OWN_REASON.match, lines) if m] for name, lines in outputs.items()}
    whole = skipped_ctests(tmp, log_path, outputs) | {name for name, reasons in own.items() if reasons}
    for name in sorted(whole - inside):
        skips.append((name, None, own[name][0] if own[name] else "(no reason printed)"))
    return skips


def allowed_by(name, test, entries, facts):
    for pattern, condition, reason in entries:
        if not holds(condition, facts):
            continue
        if fnmatch.fnmatchcase(name, pattern) or (test and fnmatch.fnmatchcase(f"{name}:{test}", pattern)):
            return reason
        # A bare GoogleTest name: the case, whether ctest runs it alone or inside its whole program
        # (tests/CMakeLists.txt, DTRAIN_TEST_PER_CASE).
        if test and ":" not in pattern and fnmatch.fnmatchcase(test, pattern):
            return reason
    return None


def main(argv):
    if len(argv) != 1:
        print(__doc__.split("\n\n")[2].strip(), file=sys.stderr)
        return 2
    build_dir = argv[0]
    if not os.path.exists(os.path.join(build_dir, "Testing", "Temporary", "LastTest.log")):
        print(f"check_skips: no ctest log in {build_dir}/Testing/Temporary: run ctest there first",
              file=sys.stderr)
        return 2
    facts = machine_facts(build_dir)
    entries = read_allowed()
    unexpected = []
    for name, test, reason in collect_skips(build_dir):
        label = f"{name}:{test}" if test and test != name else name  # gtest_discover_tests: the same
        why = allowed_by(name, test, entries, facts)
        if why:
            print(f"check_skips: skipped as expected here: {label} ({why})")
        else:
            unexpected.append(f"  {label}: {reason}")
    if unexpected:
        sys.stdout.flush()  # the expected skips above, before the verdict
        print(f"check_skips: {len(unexpected)} test(s) skipped that should run on this machine "
              f"(root={facts['root']}, GPUs={facts['gpus']}, LibTorch {facts['torch_major']}):", file=sys.stderr)
        print("\n".join(unexpected), file=sys.stderr)
        print("Fix what they need (the reason says what), or, if they cannot run on such a machine, add "
              "them to tests/skips_allowed.txt with the condition and the reason.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
