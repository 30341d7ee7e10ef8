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
import threading
import time
import unittest

from launcher_common import (PY, clean_env, finish, free_port, port_open, proc_util, require_launcher, run, start,
                             wait_until)
from store_wire import OpenStore


def write_record(folder, value):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "dtrain_trace_rank_0"), "wb") as f:
        f.write(pickle.dumps(value, 2))


def expanding_bytes(rows=1000000):
    """2 MB a million rows, whose memo references expand to 17 values a row (within the budget: 8.5
    values per byte): 340 MiB of the analysis' memory a million rows."""
    return pickle.dumps([list(range(16))] * rows, 2)


def expanding(folder):
    write_record(folder, pickle.loads(expanding_bytes()))


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



def peak_rss_mib(pid):
    """VmHWM of a running process, in MiB (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class HostileRecordThroughTheStore(unittest.TestCase):
    """Node 0 analyses the records it gathers from the store (Note [Bounded flight analysis]); on an
    open store anyone who reaches its port can put one there in a node's name."""

    def setUp(self):
        require_launcher(self)
        self.tmp = tempfile.TemporaryDirectory(prefix="dtrain-flight-store-")

    def tearDown(self):
        self.tmp.cleanup()

    def test_a_record_planted_for_a_failed_rank_stops_at_the_memory_limit_of_node_0s_analysis(self):
        port = free_port()
        common = ["--nnodes", 2, "--nproc_per_node", 1, "--master_addr", "127.0.0.1", "--master_port", port,
                  "--rdzv_timeout", 20, "--monitor_interval", 0.1, "--grace_period", 1]
        # Node 0's rank writes a record of its own (node 0 gathers the others' only when it has one)
        # and waits; node 1's rank fails without a record, which a stranger's takes the place of.
        own = ("import os, pickle, time; d = os.environ['DTRAIN_FLIGHT_DIR']; "
               "open(os.path.join(d, 'dtrain_trace_rank_0'), 'wb').write(pickle.dumps({'rank': 0, 'entries': []}, 2)); "
               "time.sleep(60)")
        env = clean_env(TMPDIR=self.tmp.name)
        n0 = start(["--node_rank", 0] + common + [PY, "-c", own], env=env)
        n1 = None
        try:
            self.assertTrue(wait_until(lambda: port_open(port), 10), "node 0's store never came up")
            # 13 MB expanding to 2.2 GiB: past the analysis' default memory limit of 2048 MiB.
            stranger = OpenStore(port)
            stranger.set("flight/0/1", expanding_bytes(6500000))
            stranger.close()
            peak = [0.0]

            def watch():  # node 0's launcher's peak memory, until it exits
                while n0.poll() is None:
                    peak[0] = max(peak[0], peak_rss_mib(n0.pid) or 0)
                    time.sleep(0.05)

            watcher = threading.Thread(target=watch)
            watcher.start()
            n1 = start(["--node_rank", 1] + common + ["sh", "-c", "sleep 1; exit 3"], env=env)
            t0 = time.monotonic()
            (rc0, _, err0), (rc1, _, err1) = finish(n0, n1, timeout=60)
            took = time.monotonic() - t0
            watcher.join()
        finally:
            for p in (n0, n1):
                if p and p.poll() is None:
                    proc_util.kill_session(p)
        self.assertEqual(rc1, 1, err1)
        self.assertEqual(rc0, 1, err0)  # the job's failure, not a crash nor a signal
        limit_lines = [line for line in err0.splitlines() if "stopped at its memory limit of 2048 MiB" in line]
        self.assertEqual(len(limit_lines), 1, err0)
        self.assertIn("the flight records in ", limit_lines[0])
        self.assertIn("could not be analysed", limit_lines[0])
        self.assertIn("exited with code 3", err0.strip().splitlines()[-1], err0)
        # Node 1 fails after 1 s; node 0 stops its rank (1 s of grace), gathers (5 s at most) and
        # analyses (30 s at most; the memory limit comes first).
        self.assertLess(took, 40, err0)
        self.assertGreater(peak[0], 0, "node 0's memory was never read")
        self.assertLess(peak[0], 256, f"node 0's launcher peaked at {peak[0]:.0f} MiB")


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
