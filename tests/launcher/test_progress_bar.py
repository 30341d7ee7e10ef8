"""dtrain-run on a terminal: rank 0's progress bar is drawn in place (Note [Launcher bar] in
tools/dtrain-run/output.h), other ranks' lines print above it whole, and pipes and log files get
plain lines only.

The worker is a Python stand-in for dtrain::Progress (whose own markers monitor_test checks): it
writes the marked lines when dtrain-run gives it DTRAIN_PROGRESS_TTY=1, plain lines otherwise.
The launcher runs on a pseudo-terminal; tests/common/pty_screen.py replays the captured bytes as a
terminal would.
"""
import os
import re
import shutil
import sys
import tempfile
import unittest

from launcher_common import PY, DTRAIN_RUN, clean_env, require_launcher, run, run_folder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from pty_screen import Screen, run_on_pty  # noqa: E402

STEPS = 12
# Rank 0: a bar state per step ("\r" lines), a plain line per step for the logs ("\v" lines), a
# normal line in the middle, and the end of the bar; the other ranks: normal lines meanwhile.
WORKER = f"""
import os, sys, time
r = int(os.environ["RANK"]); bar = os.environ.get("DTRAIN_PROGRESS_TTY") == "1"
print(f"start {{r}} tty={{os.environ.get('DTRAIN_PROGRESS_TTY')}}", flush=True)
for s in range(1, {STEPS} + 1):
    time.sleep(0.03)
    if r == 0:
        text = "BAR [" + "=" * s + " " * ({STEPS} - s) + "] %d/{STEPS}" % s
        sys.stdout.write(("\\r" + text + "\\n" + "\\vplain " + text + "\\n") if bar else "plain " + text + "\\n")
        if s == 6:
            sys.stdout.write("halfway from rank 0\\n")
            sys.stderr.write("a warning from rank 0\\n")
        sys.stdout.flush(); sys.stderr.flush()
    else:
        print(f"line {{s}} of rank {{r}} " + "x" * 40, flush=True)
if r == 0 and bar:
    sys.stdout.write("\\r\\n"); sys.stdout.flush()
print(f"done {{r}}", flush=True)
"""
BAR_RE = re.compile(r"^\[rank 0\] BAR \[(=*) *\] (\d+)/%d$" % STEPS)


class ProgressBarTest(unittest.TestCase):
    def setUp(self):
        require_launcher(self)
        self.tmp = tempfile.mkdtemp(prefix="dtrain_bar_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_pty(self, *extra, cols=200):
        rc, raw = run_on_pty([DTRAIN_RUN, "--standalone", "--nproc_per_node", 3, *extra, PY, "-c", WORKER],
                             clean_env(), timeout=60, cols=cols)
        self.assertEqual(rc, 0, raw.decode(errors="replace"))
        return raw, Screen(raw).text()

    def test_bar_updates_in_place_on_a_terminal(self):
        raw, screen = self.run_pty()
        shown = "\n".join(screen)
        # The final screen: exactly one bar line, in its last state, and no plain progress line.
        bars = [l for l in screen if "BAR" in l]
        self.assertEqual(len(bars), 1, shown)
        m = BAR_RE.match(bars[0])
        self.assertTrue(m and m.group(2) == str(STEPS), bars[0])
        self.assertNotIn("plain", shown)
        # The capture: the bar was drawn in many states (each erased before the next).
        states = set(re.findall(rb"\[rank 0\] BAR \[=* *\] (\d+)/", raw))
        self.assertGreaterEqual(len(states), STEPS // 2, raw[-2000:])
        # Every other line arrived whole, in order, each on its own line; rank 0's own stdout and
        # stderr lines too. The bar stayed below them: the done lines follow it only after its end.
        for r in (1, 2):
            mine = [l for l in screen if l.startswith(f"[rank {r}] line ")]
            self.assertEqual(mine, [f"[rank {r}] line {s} of rank {r} " + "x" * 40 for s in range(1, STEPS + 1)],
                             shown)
        self.assertIn("[rank 0] halfway from rank 0", screen)
        self.assertIn("[rank 0] a warning from rank 0", screen)
        self.assertIn("[rank 0] start 0 tty=1", screen)
        self.assertIn("[rank 1] start 1 tty=0", screen, "only rank 0 draws the bar")
        self.assertLess(screen.index(bars[0]), screen.index("[rank 0] done 0"), shown)

    def test_bar_is_cut_to_the_terminal_width(self):
        # A bar wider than the terminal would wrap, and erasing would then clear only its last row.
        raw, screen = self.run_pty(cols=20)
        states = re.findall(rb"\x1b\[2K(\[rank 0\] BAR[^\r\n\x1b]*)", raw)
        self.assertGreaterEqual(len(states), STEPS // 2, raw[-2000:])
        for state in states:
            self.assertLessEqual(len(state), 19, state)

    def test_tee_file_gets_plain_lines(self):
        # --tee 1: the terminal has the bar, rank 0's stdout.log the plain lines, no '\r' at all.
        raw, screen = self.run_pty("--log_dir", self.tmp, "--tee", 1)
        self.assertEqual(len([l for l in screen if "BAR" in l]), 1, "\n".join(screen))
        with open(os.path.join(run_folder(self.tmp), "attempt_0", "0", "stdout.log"), "rb") as f:
            log = f.read()
        self.assertNotIn(b"\r", log)
        self.assertNotIn(b"\v", log)
        self.assertEqual(log.count(b"plain BAR"), STEPS, log)
        self.assertIn(b"halfway from rank 0\n", log)

    def test_pipe_gets_plain_lines(self):
        # No terminal: rank 0 is told so, and the output holds plain lines only.
        r = run(["--standalone", "--nproc_per_node", 3, PY, "-c", WORKER], timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("\r", r.stdout)
        self.assertIn("[rank 0] start 0 tty=0", r.stdout)
        self.assertEqual(len([l for l in r.stdout.splitlines() if l.startswith("[rank 0] plain BAR")]), STEPS)

    def test_redirected_stdout_gets_no_bar(self):
        # --redirects 1: rank 0's stdout goes to the log file only, so there is no bar to draw.
        raw, screen = self.run_pty("--log_dir", self.tmp, "--redirects", 1)
        self.assertNotIn(b"BAR", raw)
        with open(os.path.join(run_folder(self.tmp), "attempt_0", "0", "stdout.log"), "rb") as f:
            log = f.read()
        self.assertIn(b"start 0 tty=0", log)
        self.assertNotIn(b"\r", log)


if __name__ == "__main__":
    unittest.main()
