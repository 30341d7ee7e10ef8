"""dtrain-run's analysis of flight records from elsewhere (see Note [Bounded flight analysis]): records
node 0 gets from other nodes, and `dtrain-run --analyze DIR` of a folder collected elsewhere, are
analysed in a child process with a time and a memory limit, and a signal stops it. Each record here
is within the pickle reader's budget (Note [Pickle budget]) and hostile all the same. And the
temporary folder a launcher without --log_dir gives its workers for their records is removed at its
exit unless a worker wrote into it.
"""
import os
import pickle
import signal
import tempfile
import time
import unittest

from launcher_common import PY, clean_env, proc_util, require_launcher, run, start, wait_until


def write_record(folder, value):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "dtrain_trace_rank_0"), "wb") as f:
        f.write(pickle.dumps(value, 2))


def expanding(folder):
    """2 MB whose memo references expand to 17 M values (within the budget: 8.5 values per byte)."""
    write_record(folder, [list(range(16))] * 1000000)


def slow(folder):
    """280 kB of one group of 100000 members (all rank 0) and 3000 calls: the mismatch search looks up
    every member's call at every sequence number, 10^12 steps."""
    write_record(folder, {"rank": 0, "pg_config": {"default": {"ranks": "[" + "0," * 99999 + "0]"}},
                          "entries": [{"collective_seq_id": i, "process_group": ["default"], "state": "completed"}
                                      for i in range(3000)]})


class BoundedAnalysis(unittest.TestCase):
    def setUp(self):
        require_launcher(self)
        self.tmp = tempfile.TemporaryDirectory(prefix="dtrain-flight-analysis-")
        self.dir = os.path.join(self.tmp.name, "flight")

    def tearDown(self):
        self.tmp.cleanup()

    def test_a_record_that_expands_stops_at_the_memory_limit(self):
        expanding(self.dir)
        r = run(["--analyze", self.dir, "--memory_limit_mb", 64])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stderr, f"dtrain-run: the analysis of the flight records in {self.dir} stopped at its "
                         "memory limit of 64 MiB (a hostile or damaged record? run dtrain-run --analyze DIR "
                         "--memory_limit_mb N for more)\n")

    def test_a_record_that_takes_long_stops_at_the_time_limit(self):
        slow(self.dir)
        start_s = time.monotonic()
        r = run(["--analyze", self.dir, "--time_limit", 2])
        self.assertLess(time.monotonic() - start_s, 10)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("stopped at its time limit of 2 s (a hostile or damaged record?", r.stderr)

    def test_a_signal_stops_the_analysis_and_its_child(self):
        slow(self.dir)
        p = start(["--analyze", self.dir, "--time_limit", 600])
        try:
            child = []
            self.assertTrue(wait_until(lambda: child.extend(proc_util.children(p.pid)) or child, 10),
                            "the analysis' child did not start")
            os.kill(p.pid, signal.SIGTERM)
            _, err = p.communicate(timeout=10)
        finally:
            if p.poll() is None:
                proc_util.kill_session(p)
        self.assertEqual(p.returncode, -signal.SIGTERM, err)
        self.assertIn("stopped: a signal interrupted it", err)
        self.assertFalse(proc_util.alive(child[0]), "the analysis' child outlived the launcher")



class TemporaryFlightFolder(unittest.TestCase):
    def setUp(self):
        require_launcher(self)
        self.tmp = tempfile.TemporaryDirectory(prefix="dtrain-flight-folder-")

    def tearDown(self):
        self.tmp.cleanup()

    def left(self):
        return [n for n in os.listdir(self.tmp.name) if n.startswith("dtrain-run-flight-")]

    def test_an_empty_one_is_removed_and_one_with_a_record_kept(self):
        for worker, rc in ([PY, "-c", "pass"], 0), ([PY, "-c", "import sys; sys.exit(3)"], 1):
            r = run(["--standalone", "--nproc_per_node", 2] + worker, env=clean_env(TMPDIR=self.tmp.name))
            self.assertEqual(r.returncode, rc, r.stderr)
            self.assertEqual(self.left(), [], "a launcher left its empty flight folder")
        # A worker that wrote a record into it, as a rank whose collective failed does: the analysis
        # names the folder, so it stays.
        write = ("import os, pickle, sys; d = os.environ['DTRAIN_FLIGHT_DIR']; "
                 "open(os.path.join(d, 'dtrain_trace_rank_' + os.environ['RANK']), 'wb')"
                 ".write(pickle.dumps({'rank': int(os.environ['RANK']), 'entries': []}, 2)); sys.exit(3)")
        r = run(["--standalone", "--nproc_per_node", 1, PY, "-c", write], env=clean_env(TMPDIR=self.tmp.name))
        self.assertEqual(r.returncode, 1, r.stderr)
        kept = self.left()
        self.assertEqual(len(kept), 1, r.stderr)
        self.assertTrue(os.path.exists(os.path.join(self.tmp.name, kept[0], "attempt_0", "flight",
                                                    "dtrain_trace_rank_0")))


if __name__ == "__main__":
    unittest.main()
