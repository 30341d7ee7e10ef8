"""dtrain-run --max_restarts: a failed attempt stops every worker and restarts the whole group with
DTRAIN_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT) incremented, logs per attempt; after N restarts
the job fails with the last failure's summary; a signal to the launcher is never restarted; a
SIGSTOPped worker is woken (SIGCONT) so it can act on SIGTERM. Several nodes: test_multinode.py."""
import os
import signal
import time
import unittest

from launcher_common import MarkedTestCase, PY, pids_with_marker, run, run_folder, start, wait_until


class RestartTest(MarkedTestCase):
    tmp_prefix = "dtrain_restart_"

    def test_restarts_until_an_attempt_succeeds(self):
        # Attempts 0 and 1: rank 1 fails; attempt 2 succeeds. Every worker records its attempt; rank 1
        # fails only once rank 0 has written its line, or the launcher could stop rank 0 before it did.
        script = (f'echo "$RANK $DTRAIN_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT" >> {self.tmp}/seen; '
                  f'if [ "$RANK" = 1 ] && [ "$DTRAIN_RESTART_COUNT" -lt 2 ]; then '
                  f'while ! grep -q "^0 $DTRAIN_RESTART_COUNT " {self.tmp}/seen; do sleep 0.01; done; exit 7; fi; '
                  f'if [ "$RANK" = 0 ] && [ "$DTRAIN_RESTART_COUNT" -lt 2 ]; then exec {PY} -c "import time; time.sleep(30)" {self.marker}; fi')
        r = run(["--standalone", "--nproc_per_node", 2, "--max_restarts", 3, "--grace_period", 1,
                 "--log_dir", self.tmp + "/logs", "sh", "-c", script])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr.count("restarting all workers"), 2, r.stderr)
        self.assertIn("dtrain-run: restarting all workers (restart 1 of 3) after: rank 1 (local rank 1, pid ", r.stderr)
        self.assertIn("failed first: it exited with code 7", r.stderr)
        with open(f"{self.tmp}/seen") as f:
            seen = sorted(f.read().split("\n")[:-1])
        self.assertEqual(seen, ["0 0 0", "0 1 1", "0 2 2", "1 0 0", "1 1 1", "1 2 2"])
        for attempt in range(3):  # log folders per attempt
            self.assertTrue(os.path.isdir(f"{run_folder(self.tmp + '/logs')}/attempt_{attempt}/0"), attempt)
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_gives_up_after_max_restarts_with_the_last_summary(self):
        r = run(["--standalone", "--nproc_per_node", 2, "--max_restarts", 2, "--grace_period", 1, "sh", "-c",
                 'if [ "$RANK" = 0 ]; then exit $((10 + DTRAIN_RESTART_COUNT)); fi'])
        self.assertEqual(r.returncode, 1, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        self.assertRegex(last, r"^dtrain-run: rank 0 \(local rank 0, pid \d+\) failed first: it exited with code 12; .*"
                               r"\(the last failure, after 2 restart\(s\) of --max_restarts 2\)$")
        self.assertEqual(r.stderr.count("restarting all workers"), 2, r.stderr)

    def test_no_restart_without_max_restarts(self):
        r = run(["--standalone", "--nproc_per_node", 1, "sh", "-c", "exit 4"])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertNotIn("restarting", r.stderr)

    def test_a_signal_to_the_launcher_is_not_restarted(self):
        p = start(["--standalone", "--nproc_per_node", 2, "--max_restarts", 3, "--grace_period", 1,
                   PY, "-c", "import time; print('up', flush=True); time.sleep(30)", self.marker])
        try:
            self.assertTrue(wait_until(lambda: len(pids_with_marker(self.marker)) == 2, 10))
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=20)
        finally:
            p.kill()
        self.assertEqual(p.returncode, 128 + signal.SIGTERM, err)
        self.assertNotIn("restarting", err)
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_stopped_worker_is_woken_and_stopped_within_the_grace_period(self):
        # rank 0 stops itself (SIGSTOP) and would exit 0 on SIGTERM; rank 1 fails. Without SIGCONT
        # rank 0 could only die at SIGKILL after the 20 s grace period.
        script = (f'if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; '
                  f'exec {PY} -c "import os, signal, sys, time; '
                  f'signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); '
                  f'os.kill(os.getpid(), signal.SIGSTOP); time.sleep(60)" {self.marker}')
        t0 = time.monotonic()
        r = run(["--standalone", "--nproc_per_node", 2, "--grace_period", 20, "sh", "-c", script])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertLess(time.monotonic() - t0, 10, r.stderr)


if __name__ == "__main__":
    unittest.main()
