"""Runs Python unittest modules as one ctest test and tells ctest whether anything actually ran.

`python3 -m unittest` exits 0 when every test skipped, so ctest would show a file whose tests all
skipped (no binary, wrong LibTorch, not root) as Passed. This runner exits instead with:

  0   every test that ran passed and at least one ran; each skipped test is listed with its reason
  77  nothing ran: every test skipped (ctest reports the test as Skipped through SKIP_RETURN_CODE)
  1   a test failed or errored, or the modules hold no test at all (a typo in a name is not a pass)

Every skipped test gets one line `dtrain-test: skipped <test id>: <reason>`; scripts/check_skips.py
reads those lines from ctest's log to fail CI when a test skipped that must run on this machine.

  cd tests/dist && python3 ../common/run_unittest.py test_shm [test_other ...]
"""
import os
import sys
import time
import unittest

SKIP_RETURN_CODE = 77  # tests/dist and tests/launcher's CMakeLists.txt set SKIP_RETURN_CODE to this
MARKER = "dtrain-test:"


def skipped_id(test):
    """The id of a skipped test; a skip raised in setUpClass / setUpModule is reported by unittest
    on a placeholder whose description names the class or module."""
    return test.id() if isinstance(test, unittest.TestCase) else str(test)


class TimedResult(unittest.TextTestResult):
    """Records each test's wall time, so that a slow file says which of its tests to look at."""

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        self.durations.append((time.monotonic() - self._started, test.id()))


def main(names):
    if not names:
        print(f"usage: {sys.argv[0]} MODULE [MODULE ...]", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())  # the test modules live in ctest's WORKING_DIRECTORY
    suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    collected = suite.countTestCases()
    TimedResult.durations = []
    result = unittest.TextTestRunner(verbosity=2, resultclass=TimedResult).run(suite)
    sys.stderr.flush()

    # Tests skipped one by one still count in testsRun; those under a skipped class or module never
    # start, and unittest records one placeholder for all of them.
    skipped_tests = sum(isinstance(test, unittest.TestCase) for test, _ in result.skipped)
    ran = result.testsRun - skipped_tests
    for test, reason in result.skipped:
        print(f"{MARKER} skipped {skipped_id(test)}: {reason}")
    for seconds, test_id in sorted(TimedResult.durations, reverse=True)[:5]:
        if seconds >= 1.0:
            print(f"{MARKER} took {seconds:.1f} s: {test_id}")
    if collected == 0:
        print(f"{MARKER} FAILED: no test found in {' '.join(names)}")
        return 1
    if not result.wasSuccessful():
        print(f"{MARKER} FAILED: {len(result.failures)} failure(s), {len(result.errors)} error(s), "
              f"{len(result.unexpectedSuccesses)} unexpected success(es)")
        return 1
    if ran == 0:
        print(f"{MARKER} SKIPPED: none of the {collected} test(s) ran (reasons above)")
        return SKIP_RETURN_CODE
    print(f"{MARKER} {ran} test(s) ran and passed, {len(result.skipped)} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
