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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from harness import DistTestCase, binary, clean_env, free_port, launcher, scaled

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from netns_hosts import Hosts, netns_unavailable  # noqa: E402

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + scaled(10)  # the bound: caught within the timeout + 10 s

# flight_program's calls in group 'default', numbered as the records number them (from 1; the same on
# every rank): DDP's construction makes two, #1 (its model check's all_gather) and #2 (the parameters'
# broadcast); then step k (from 0) makes two more, the gradients' all_reduce (one bucket of 2762
# values) and the loss's all_reduce ([4]).
BEFORE_LOOP, PER_STEP = 2, 2
AT_STEP = 5  # flight_program's --at_step


def grads_call(step):
    return BEFORE_LOOP + PER_STEP * step + 1


def loss_call(step):
    return BEFORE_LOOP + PER_STEP * step + 2


def call_kind(n):
    """(profiling name, input sizes) of flight_program's call #n."""
    if n == 1:
        return "gloo:all_gather", [[1]]
    if n == 2:
        return "gloo:broadcast", [[2762]]
    return "gloo:all_reduce", [[2762]] if (n - BEFORE_LOOP) % PER_STEP == 1 else [[4]]


def catches_sigusr1(pid):
    """Whether process `pid` has a SIGUSR1 handler (SigCgt in /proc/<pid>/status), as dtrain-run checks
    before it asks a worker for its record: dtrain installs it in init_process_group."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool((int(line.split()[1], 16) >> (signal.SIGUSR1 - 1)) & 1)
    except OSError:
        pass
    return False


def read_dumps(folder):
    """{rank: the pickled record} of every dtrain_trace_rank_<rank> in `folder`. A dump is written to a
    temporary name beside it (dtrain_trace_rank_<rank>.tmpXXXXXX) and renamed when complete: a dump
    being written while the test looks is not one yet."""
    dumps = {}
    for path in glob.glob(os.path.join(folder, "dtrain_trace_rank_*")):
        m = re.fullmatch(r"dtrain_trace_rank_(\d+)", os.path.basename(path))
        if not m:
            continue
        with open(path, "rb") as f:
            dumps[int(m.group(1))] = pickle.load(f)
    return dumps


def program():
    path = binary("FLIGHT_PROGRAM", "flight_program")
    if not path:
        raise unittest.SkipTest("flight_program is not built (tests/dist; or set FLIGHT_PROGRAM)")
    return path


class FlightTestCase(DistTestCase):
    def assertCaughtWithin(self, bound_s, folder, ended_ns, what):
        """The job ended within bound_s of its first recorded call: the clock starts when the ranks
        train (wall time in their records), not when the launcher started loading LibTorch."""
        firsts = [min(e["time_created_ns"] for e in d["entries"]) for d in read_dumps(folder).values() if d["entries"]]
        self.assertTrue(firsts, f"no records in {folder}:\n{what}")
        took = (ended_ns - min(firsts)) / 1e9
        self.assertLess(took, bound_s, f"caught {took:.1f} s after the first call, not within {bound_s:.0f} s:\n{what}")


class OneHost(FlightTestCase):
    """Three ranks on this host (shared memory), one dtrain-run."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="dtrain_flight_")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def run_job(self, fault, nproc=3, at_step=AT_STEP, bound=True, **env):
        argv = [launcher(), "--nproc_per_node", nproc, "--log_dir", self.tmp, "--run_id", "job",
                "--master_port", free_port(), program(), "--fault", fault, "--at_step", at_step]
        r = self.run_one(argv, clean_env(DTRAIN_TIMEOUT_S=TIMEOUT_S, **env), timeout=60)
        ended_ns = time.time_ns()
        self.assertNotEqual(r.rc, 0, f"the job should fail:\n{r}")
        if bound:
            self.assertCaughtWithin(BOUND_S, self.flight_dir(), ended_ns, r)
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
        self.assertRegex(self.analysis(r)[0], rf"^rank 1 skipped all_reduce #{loss_call(AT_STEP)} of group 'default' "
                                              r"\(\[4\] Float\)")

    def test_a_rank_stopped_during_training(self):
        r = self.run_job("stop")
        self.assertRegex(self.analysis(r)[0], rf"^hang in group 'default' at all_reduce #{grads_call(AT_STEP)}: ranks 0, 2 "
                                              r"entered it [\d.]+ s ago; rank 1 left no record \(stopped")

    def test_a_rank_computing_outside_dtrain_while_the_others_wait(self):
        # Its record comes from dtrain-run's request (SIGUSR1): it is in no call that could fail.
        lines = self.analysis(self.run_job("compute"))
        self.assertRegex(lines[0], rf"^hang in group 'default' at all_reduce #{grads_call(AT_STEP)}: ranks 0, 2 entered "
                                   rf"it [\d.]+ s ago; rank 1 completed #{loss_call(AT_STEP - 1)} and has not entered "
                                   rf"#{grads_call(AT_STEP)}$")
        self.assertRegex(lines[1], r"^rank 1 has made no call for [\d.]+ s while the others wait: it is computing or "
                                   r"stuck outside dtrain$")

    def test_records_of_a_few_entries_keep_each_ranks_last_calls(self):
        # DTRAIN_FLIGHT_ENTRIES=4: each rank keeps its last 4 calls, so rank 1 (computing after #12)
        # and the others (waiting in #13) keep different windows, and the numbers go on past the ring.
        lines = self.analysis(self.run_job("compute", DTRAIN_FLIGHT_ENTRIES=4))
        at = grads_call(AT_STEP)
        self.assertRegex(lines[0], rf"^hang in group 'default' at all_reduce #{at}: ranks 0, 2 entered it [\d.]+ s "
                                   rf"ago; rank 1 completed #{at - 1} and has not entered #{at}$")
        # A call still waiting when its rank wrote the record is "started", one that timed out (or
        # failed with the group) "failed": which one a rank wrote depends on who was first.
        waiting = {"started": "waiting", "failed": "waiting"}
        windows = {rank: [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"],
                           waiting.get(e["state"], e["state"])) for e in d["entries"]]
                   for rank, d in read_dumps(self.flight_dir()).items()}

        def window(last, state_of_last):
            return [(n, *call_kind(n), "completed") for n in range(last - 3, last)] + \
                [(last, *call_kind(last), state_of_last)]
        self.assertEqual(windows, {0: window(at, "waiting"), 1: window(at - 1, "completed"),
                                   2: window(at, "waiting")})

    def test_no_records_with_flight_entries_0(self):
        # docs/environment.md: DTRAIN_FLIGHT_ENTRIES=0 turns the flight recorder off. So a hang writes
        # nothing where it would write records: not on the timed-out calls of ranks 0 and 2, not at a
        # stall (1 s here), not at dtrain-run's request to rank 1, which computes (and which dtrain-run
        # does not ask: no handler), and dtrain-run has nothing to analyse.
        r = self.run_job("compute", bound=False, DTRAIN_FLIGHT_ENTRIES=0, DTRAIN_FLIGHT_STALL_S=1)
        self.assertLess(r.seconds, 60, str(r))
        self.assertIn("timed out after 5000 ms", r.err, str(r))
        self.assertNotIn("flight record", r.err, str(r))
        self.assertNotIn("dtrain-run: flight records of", r.err, str(r))
        self.assertEqual(os.listdir(self.flight_dir()) if os.path.isdir(self.flight_dir()) else [], [], str(r))

    def test_a_rank_that_calls_another_operation(self):
        r = self.run_job("other_op", at_step=8)  # another step: the numbers follow the steps
        self.assertRegex(self.analysis(r)[0],
                         rf"^ranks disagree at #{loss_call(8)} of group 'default': rank 1 calls broadcast, the others "
                         r"all_reduce$")
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
        self.assertRegex(got.out, rf"hang in group 'default' at all_reduce #{grads_call(AT_STEP)}: ranks 0, 2 entered "
                                  r"it [\d.]+ s ago; rank 1 left no record")

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
        deadline = time.monotonic() + 60
        # SIGUSR1 kills a process that has no handler: send it only once both workers have dtrain's,
        # installed in init_process_group (dtrain-run checks the same before it asks for records).
        while not (len(self.worker_pids(job.pid)) == 2 and all(map(catches_sigusr1, self.worker_pids(job.pid)))):
            if time.monotonic() > deadline or job.ended():
                self.fail(f"the workers did not get to init_process_group:\n{job.finish(0)}")
            time.sleep(0.05)
        path = os.path.join(self.flight_dir(), "dtrain_trace_rank_1")
        # The first dump may come before the loop made many calls: ask again until one shows training.
        # Unanswered for a second, the signal is sent again: ThreadSanitizer holds a signal until the
        # thread that took it calls into the C library, and a rank once answered only rank 0's.
        d, asked = None, 0

        def ask():
            nonlocal asked
            for pid in self.worker_pids(job.pid):
                os.kill(pid, signal.SIGUSR1)
            asked += 1
            return time.monotonic()

        while d is None or len(d["entries"]) <= 10:
            sent = ask()
            since = d["dtrain"]["dump_time_ns"] if d else 0
            while d is None or d["dtrain"]["dump_time_ns"] == since:
                if time.monotonic() > deadline or job.ended():
                    self.fail(f"no dump after {asked} SIGUSR1s:\n{job.finish(0)}")
                if time.monotonic() - sent > 1:
                    sent = ask()
                time.sleep(0.05)
                d = read_dumps(self.flight_dir()).get(1) if os.path.exists(path) else None
        self.assertFalse(job.ended(), "SIGUSR1 ended the job")
        self.assertEqual(d["dtrain"]["reason"], "SIGUSR1")
        # The running loop's last calls, numbered as flight_program makes them, the latest started.
        got = [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"]) for e in d["entries"]]
        first = got[0][0]
        self.assertEqual(got, [(n, *call_kind(n)) for n in range(first, first + len(got))])
        self.assertEqual(d["entries"][-1]["profiling_name"], "gloo:all_reduce")
        bad = self.run_one([launcher(), "--analyze", os.path.join(self.tmp, "nowhere")], clean_env())
        self.assertEqual(bad.rc, 1, str(bad))
        self.assertRegex(bad.err, r"^dtrain-run: cannot read the folder '.*nowhere' of flight records: pass the folder")

    def test_a_fifo_planted_beside_the_record_does_not_block_the_dump(self):
        """The record is written into a new file beside it (O_EXCL), then renamed: a FIFO planted at the
        name the file once had (<record>.tmp<pid>) would have blocked the dump, and a failed rank's
        exit with it."""
        flight = os.path.join(self.tmp, "flight")
        os.mkdir(flight)
        argv = [launcher(), "--nproc_per_node", 1, "--master_port", free_port(), program(), "--fault", "none",
                "--steps", 1000000]
        job = self.spawn(argv, clean_env(DTRAIN_FLIGHT_DIR=flight))
        try:
            deadline = time.monotonic() + 60
            while not (self.worker_pids(job.pid) and catches_sigusr1(self.worker_pids(job.pid)[0])):
                if time.monotonic() > deadline or job.ended():
                    self.fail(f"the worker did not get to init_process_group:\n{job.finish(0)}")
                time.sleep(0.05)
            worker = self.worker_pids(job.pid)[0]
            record = os.path.join(flight, "dtrain_trace_rank_0")
            os.mkfifo(f"{record}.tmp{worker}")
            os.kill(worker, signal.SIGUSR1)
            deadline = time.monotonic() + 20
            while not os.path.exists(record) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertTrue(os.path.exists(record), "the planted FIFO blocked the dump")
            with open(record, "rb") as f:  # not read_dumps: its pattern matches the FIFO, which blocks a reader
                self.assertEqual(pickle.load(f)["dtrain"]["reason"], "SIGUSR1")
        finally:
            os.kill(job.pid, signal.SIGTERM)
            job.finish(30)

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


class TwoHosts(FlightTestCase):
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
        ended_ns = time.time_ns()
        err0 = outs[0][1]
        # Node 0's folder holds node 1's records too (through the store): + 5 s for that.
        runs = glob.glob(os.path.join(tmp, "node0", "job_*"))
        self.assertCaughtWithin(BOUND_S + scaled(5), os.path.join(runs[0] if runs else tmp, "attempt_0", "flight"),
                                ended_ns, err0)
        self.assertRegex(err0, rf"dtrain-run:   sizes differ at #{loss_call(AT_STEP)} of group 'default' \(all_reduce\): "
                               r"rank 1 passes \[5\], rank 0 \[4\]")


if __name__ == "__main__":
    unittest.main()
