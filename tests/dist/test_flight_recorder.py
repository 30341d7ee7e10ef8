"""The flight recorder (src/comm/flight_recorder.h) and dtrain-run's analysis of its records
(tools/dtrain-run/flight.h, src/common/flight_analysis.h): a rank of a DDP training loop misbehaves
once, and dtrain-run must name the rank, the operation and the call's number within the collective
timeout + 10 s. Timeouts are 5 s (DTRAIN_TIMEOUT_S) to keep the file short.

  FLIGHT_PROGRAM  tests/dist/flight_program.cpp (the loop and its faults)
  DTRAIN_RUN      the launcher
  VENV_PYTHON     a Python with PyTorch 2.x, whose flight-recorder analyzer must read dtrain's records
"""
import glob
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

from harness import DistTestCase, binary, clean_env, free_port, launcher

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from netns_hosts import Hosts, netns_unavailable  # noqa: E402

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 10  # the bound: caught within the timeout + 10 s


def program():
    path = binary("FLIGHT_PROGRAM", "flight_program")
    if not path:
        raise unittest.SkipTest("flight_program is not built (tests/dist; or set FLIGHT_PROGRAM)")
    return path


class OneHost(DistTestCase):
    """Three ranks on this host (shared memory), one dtrain-run."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="dtrain_flight_")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def run_job(self, fault, nproc=3, **env):
        argv = [launcher(), "--nproc_per_node", nproc, "--log_dir", self.tmp, "--run_id", "job",
                "--master_port", free_port(), program(), "--fault", fault]
        r = self.run_one(argv, clean_env(DTRAIN_TIMEOUT_S=TIMEOUT_S, **env), timeout=60)
        self.assertNotEqual(r.rc, 0, f"the job should fail:\n{r}")
        self.assertLess(r.seconds, BOUND_S, f"not caught within the timeout + 10 s:\n{r}")
        return r

    def analysis(self, r):
        """The lines dtrain-run printed under 'flight records of N ranks in DIR:'."""
        lines = r.err.splitlines()
        for i, line in enumerate(lines):
            if "dtrain-run: flight records of" in line:
                return [l[len("dtrain-run:   "):] for l in lines[i + 1:] if l.startswith("dtrain-run:   ")]
        self.fail(f"dtrain-run printed no analysis:\n{r}")

    def flight_dir(self):
        """attempt_0/flight in the run's log folder (<log_dir>/job_<random>, made when the job starts)."""
        runs = glob.glob(os.path.join(self.tmp, "job_*"))
        return os.path.join(runs[0] if runs else os.path.join(self.tmp, "job_"), "attempt_0", "flight")

    def test_a_rank_that_skips_one_all_reduce_of_a_ddp_loop(self):
        r = self.run_job("skip")
        self.assertRegex(self.analysis(r)[0], r"^rank 1 skipped all_reduce #\d+ of group 'default' \(\[4\] Float\)")

    def test_a_rank_stopped_during_training(self):
        r = self.run_job("stop")
        self.assertRegex(self.analysis(r)[0], r"^hang in group 'default' at all_reduce #\d+: ranks 0, 2 entered it "
                                              r"[\d.]+ s ago; rank 1 left no record \(stopped")

    def test_a_rank_computing_outside_dtrain_while_the_others_wait(self):
        # Its record comes from dtrain-run's request (SIGUSR1): it is in no call that could fail.
        lines = self.analysis(self.run_job("compute"))
        self.assertRegex(lines[0], r"^hang in group 'default' at all_reduce #(\d+): ranks 0, 2 entered it [\d.]+ s "
                                   r"ago; rank 1 completed #\d+ and has not entered #\1$")
        self.assertRegex(lines[1], r"^rank 1 has made no call for [\d.]+ s while the others wait: it is computing or "
                                   r"stuck outside dtrain$")

    def test_a_rank_that_calls_another_operation(self):
        r = self.run_job("other_op")
        self.assertRegex(self.analysis(r)[0],
                         r"^ranks disagree at #(\d+) of group 'default': rank 1 calls broadcast, the others all_reduce$")
        # The same analysis from the folder alone, as for records collected elsewhere.
        again = self.run_one([launcher(), "--analyze", self.flight_dir()], clean_env())
        self.assertEqual(again.rc, 0, str(again))
        self.assertIn(self.analysis(r)[0], again.out)

    def test_a_recv_whose_send_never_comes_in_a_pipeline(self):
        r = self.run_job("p2p")
        self.assertRegex(self.analysis(r)[0], r"^recv with no matching send in group 'default': rank 2 waits in "
                                              r"recv #6 from rank 1 \(tag 0\) for [\d.]+ s; rank 1 made 5 matching sends")

    def test_the_stall_watchdog_dumps_while_the_collective_still_waits(self):
        # A long collective timeout: only the watchdog (2 s without progress) writes the records.
        argv = [launcher(), "--nproc_per_node", 3, "--log_dir", self.tmp, "--run_id", "job",
                "--master_port", free_port(), program(), "--fault", "stop"]
        job = self.spawn(argv, clean_env(DTRAIN_TIMEOUT_S=120, DTRAIN_FLIGHT_STALL_S=2))
        deadline = time.monotonic() + 30
        paths = []
        while not paths or not all(os.path.exists(p) for p in paths):
            paths = [os.path.join(self.flight_dir(), f"dtrain_trace_rank_{r}") for r in (0, 2)]
            if time.monotonic() > deadline:
                self.fail(f"no stall dumps:\n{job.finish(0)}")
            time.sleep(0.2)
        with open(paths[0], "rb") as f:
            self.assertIn("no call changed state for 2 s", pickle.load(f)["dtrain"]["reason"])
        got = self.run_one([launcher(), "--analyze", self.flight_dir(), "--world_size", 3], clean_env())
        self.assertRegex(got.out, r"hang in group 'default' at all_reduce #\d+: ranks 0, 2 entered it [\d.]+ s ago; "
                                  r"rank 1 left no record")

    def test_an_unwaited_call_that_completed_is_no_stall(self):
        # Every rank drops an asynchronous all_reduce unwaited and computes for 3 s: with a 1-s stall
        # time, a recorder that only learns of completion from wait() would dump a stall here.
        argv = [launcher(), "--nproc_per_node", 2, "--log_dir", self.tmp, "--run_id", "job",
                "--master_port", free_port(), program(), "--fault", "unwaited", "--steps", 8]
        r = self.run_one(argv, clean_env(DTRAIN_TIMEOUT_S=60, DTRAIN_FLIGHT_STALL_S=1), timeout=60)
        self.assertEqual(r.rc, 0, str(r))
        self.assertIn("flight_program: done", r.out)
        self.assertNotIn("wrote its flight record", r.err)
        self.assertEqual(glob.glob(os.path.join(self.flight_dir(), "dtrain_trace_rank_*")), [], str(r))

    def test_sigusr1_dumps_a_running_job_and_analyze_rejects_a_bad_folder(self):
        argv = [launcher(), "--nproc_per_node", 2, "--log_dir", self.tmp, "--run_id", "job",
                "--master_port", free_port(), program(), "--fault", "none", "--steps", 1000000]
        job = self.spawn(argv, clean_env())
        deadline = time.monotonic() + 30
        while len(self.worker_pids(job.pid)) < 2:
            self.assertLess(time.monotonic(), deadline, "the workers did not start")
            time.sleep(0.1)
        time.sleep(2)  # past init_process_group, training
        for pid in self.worker_pids(job.pid):
            os.kill(pid, 10)  # SIGUSR1
        path = os.path.join(self.flight_dir(), "dtrain_trace_rank_1")
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                self.fail(f"no dump on SIGUSR1:\n{job.finish(0)}")
            time.sleep(0.1)
        with open(path, "rb") as f:
            d = pickle.load(f)
        self.assertEqual(d["dtrain"]["reason"], "SIGUSR1")
        self.assertGreater(len(d["entries"]), 10)
        self.assertEqual(d["entries"][-1]["profiling_name"], "gloo:all_reduce")
        bad = self.run_one([launcher(), "--analyze", os.path.join(self.tmp, "nowhere")], clean_env())
        self.assertEqual(bad.rc, 1, str(bad))
        self.assertRegex(bad.err, r"^dtrain-run: cannot read the folder '.*nowhere' of flight records: pass the folder")

    def test_a_bad_knob_is_one_line_naming_the_value_and_the_remedy(self):
        for var, value, allowed in [("DTRAIN_FLIGHT_ENTRIES", "-1", "an integer from 0 to 1000000: use 0 to turn "
                                     "the flight recorder off"),
                                    ("DTRAIN_FLIGHT_STALL_S", "0", "a positive number of seconds: leave it unset")]:
            r = self.run_one([launcher(), "--nproc_per_node", 1, "--master_port", free_port(), program()],
                             clean_env(**{var: value}))
            self.assertNotEqual(r.rc, 0, str(r))
            # One line (which dtrain-run repeats in its tail of the rank's stderr).
            lines = sorted({l for l in r.err.splitlines() if "flight_program: error:" in l})
            self.assertEqual(len(lines), 1, str(r))
            self.assertIn(f"{var}='{value}' is not {allowed}", lines[0])

    @staticmethod
    def worker_pids(launcher_pid):
        out = subprocess.run(["pgrep", "-P", str(launcher_pid)], stdout=subprocess.PIPE, text=True).stdout
        return [int(p) for p in out.split()]

    def test_pytorch_analyzer_reads_dtrains_records(self):
        python = os.environ.get("VENV_PYTHON", "")
        if not python or not os.access(python, os.X_OK):
            raise unittest.SkipTest(f".venv's python is missing ({python!r}): run scripts/setup.sh")
        self.run_job("other_op")
        got = subprocess.run([python, "-m", "torch.distributed.flight_recorder.fr_trace", self.flight_dir()],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(got.returncode, 0, got.stdout)
        self.assertRegex(got.stdout, r"Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective "
                                     r"type: 'all_reduce' does not match found collective type: 'broadcast'")


class TwoHosts(DistTestCase):
    """One rank on each of two network-namespace hosts: Gloo's TCP, no shared-memory checks."""

    def test_a_size_mismatch_over_gloo_between_hosts(self):
        why = netns_unavailable()
        if why:
            self.skipTest(why)
        hosts = Hosts(2)
        self.addCleanup(hosts.close)
        tmp = tempfile.mkdtemp(prefix="dtrain_flight_hosts_")
        self.addCleanup(shutil.rmtree, tmp, True)
        port = free_port()
        start = time.monotonic()
        nodes = []
        for i in range(2):
            argv = [launcher(), "--nnodes", 2, "--node_rank", i, "--nproc_per_node", 1, "--master_addr",
                    hosts.addr[0], "--master_port", port, "--rdzv_timeout", 30, "--log_dir",
                    os.path.join(tmp, f"node{i}"), "--run_id", "job", program(), "--fault", "size"]
            nodes.append(hosts.launch(i, argv, clean_env(DTRAIN_SHM=0, DTRAIN_TIMEOUT_S=TIMEOUT_S)))
        outs = []
        for p in nodes:
            try:
                outs.append(p.communicate(timeout=60))
            except subprocess.TimeoutExpired:
                for q in nodes:
                    q.kill()
                self.fail("a launcher hung")
        elapsed = time.monotonic() - start
        err0 = outs[0][1]
        self.assertLess(elapsed, BOUND_S + 5, err0)  # + node 1's records through the store
        self.assertRegex(err0, r"dtrain-run:   sizes differ at #\d+ of group 'default' \(all_reduce\): rank 1 passes "
                               r"\[5\], rank 0 \[4\]")


if __name__ == "__main__":
    unittest.main()
