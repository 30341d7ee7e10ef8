"""dtrain-run --nnodes MIN:MAX: elastic membership between "hosts" in network namespaces.

Each test makes its own namespaces on one bridge (the bridge lives in the first namespace, which is
also node 0's host: the rendezvous address exists there only). The worker (elastic_worker.py) logs
what the launcher gave it and steps through a file barrier with its peers, so a dead peer blocks the
survivors as a collective would. The launchers get identical command lines: no --node_rank; the one
that can bind the master address hosts the rendezvous.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest

from launcher_common import (DTRAIN_RUN, PY, MarkedTestCase, clean_env, finish, free_port, pids_with_marker,
                             port_open, run, start, wait_until, with_secret)
from netns_hosts import Hosts, netns_unavailable

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")
START_RE = re.compile(r"^start rank=(\d+) world=(\d+) group=(\d+) groups=(\d+) restart=(\d+) step=(\d+) pid=(\d+) launcher=(\d+)$")


def elastic_args(port, addr, nnodes, last_call=3, max_restarts=3):
    return ["--nnodes", nnodes, "--nproc_per_node", 1, "--master_addr", addr, "--master_port", port,
            "--rdzv_timeout", 20, "--rdzv_last_call", last_call, "--max_restarts", max_restarts,
            "--monitor_interval", "0.1", "--grace_period", 1]



@contextlib.contextmanager
def running_nodes(nodes):
    """The launched node processes, killed and reaped however the block ends."""
    try:
        yield nodes
    finally:
        for p in nodes:
            p.kill()
        finish(*nodes, timeout=10)

class ElasticTest(MarkedTestCase):
    tmp_prefix = "dtrain_elastic_"

    def setUp(self):
        super().setUp()
        why = netns_unavailable()
        if why:
            self.skipTest(why)
        self.hosts = Hosts(3)
        self.addCleanup(self.hosts.close)
        self.port = free_port()

    def worker(self, steps, step_s=0.1):
        return [PY, WORKER, self.tmp, steps, step_s, self.marker]

    def starts(self):
        """The workers' start lines, as dicts, in the order they were written."""
        with open(os.path.join(self.tmp, "log")) as f:
            rows = [START_RE.match(line.strip()) for line in f]
        self.assertTrue(all(rows), "unexpected line in the worker log")
        keys = ("rank", "world", "group", "groups", "restart", "step", "pid", "launcher")
        return [dict(zip(keys, map(int, m.groups()))) for m in rows]

    def restarted(self, restart):
        """How many workers of attempt `restart` have started so far (for polling while the log grows: a
        line being written is not counted)."""
        try:
            with open(os.path.join(self.tmp, "log")) as f:
                return sum(1 for line in f if (m := START_RE.match(line.strip())) and int(m[5]) == restart)
        except OSError:
            return 0

    def kill_node(self, nodes, group):
        """SIGKILL the launcher of node `group` (no goodbye) and its worker; returns the launcher's index."""
        victim = [s for s in self.starts() if s["group"] == group]
        self.assertEqual(len(victim), 1)
        index = [p.pid for p in nodes].index(victim[0]["launcher"])  # `ip netns exec` execs dtrain-run
        nodes[index].kill()
        os.kill(victim[0]["pid"], signal.SIGKILL)
        return index

    def step_reached(self):
        try:
            with open(os.path.join(self.tmp, "ckpt")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    def trained_steps(self):
        with open(os.path.join(self.tmp, "steps")) as f:
            return [tuple(map(int, line.split())) for line in f]

    def end_training(self):
        """Every worker leaves its loop and exits 0 (elastic_worker.py's DIR/finish)."""
        open(os.path.join(self.tmp, "finish"), "w").close()

    def follow_stderr(self, proc):
        """Collects proc's stderr lines as they come, so the test can wait for one; returns the list
        and a function that waits (bounded) for the process and returns (rc, stderr)."""
        lines = []

        def read():
            for line in proc.stderr:
                lines.append(line)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def wait(timeout=30):
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(timeout=5)
            return proc.returncode, "".join(lines)
        return lines, wait

    def test_a_node_that_arrives_with_no_restart_left_joins_without_spending_one(self):
        # torchelastic restarts for waiting nodes without counting a retry: --max_restarts 0 must not
        # end a healthy job that grows. The workers' restart count still moves on (it keys their
        # rendezvous), and the job goes on from its checkpoint.
        args = elastic_args(self.port, self.hosts.addr[0], "1:3", last_call=0.5, max_restarts=0) + self.worker(40, 0.05)
        with running_nodes([self.hosts.launch(0, [DTRAIN_RUN] + args, clean_env())]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 5, 20), "the job did not start training")
            nodes.append(self.hosts.launch(1, [DTRAIN_RUN] + args, clean_env()))
            results = finish(*nodes, timeout=30)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
            self.assertRegex(err, r"dtrain-run: node 1 \(.*\) joined; world size 1 -> 2 \(attempt 1\)\n")
            self.assertNotIn("used up", err)
        self.assertEqual(sorted((s["restart"], s["rank"], s["world"], s["group"], s["groups"]) for s in self.starts()),
                         [(0, 0, 1, 0, 1), (1, 0, 2, 0, 2), (1, 1, 2, 1, 2)])
        self.assertEqual([s for _, _, s in self.trained_steps()], list(range(40)))
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_worker_that_fails_because_a_join_stopped_its_peers_spends_no_restart(self):
        # Real peers do not wait: a collective with a stopped rank fails. Node 1's worker fails as soon
        # as node 0's is stopped for the joining node, before node 1's launcher (checking every 2 s)
        # sees the stop: node 0 took the attempt's failure slot first, so that failure is the join's
        # doing and --max_restarts 0 still lets the job grow.
        d = self.tmp
        script = (f'if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then touch {d}/up$GROUP_RANK; '
                  f'if [ "$GROUP_RANK" = 0 ]; then trap "touch {d}/stopped; exit 143" TERM; '
                  f'while :; do sleep 0.05; done; fi; '
                  f'while [ ! -e {d}/stopped ]; do sleep 0.01; done; exit 1; fi; '
                  f'echo "$RANK $WORLD_SIZE" >> {d}/seen')
        args = elastic_args(self.port, self.hosts.addr[0], "2:3", last_call=0.5, max_restarts=0)
        slow = list(args)
        slow[slow.index("--monitor_interval") + 1] = 2
        worker = ["sh", "-c", script, "sh", self.marker]
        nodes = [self.hosts.launch(0, [DTRAIN_RUN] + args + worker, clean_env()),
                 self.hosts.launch(1, [DTRAIN_RUN] + slow + worker, clean_env())]
        try:
            up = lambda: all(os.path.exists(os.path.join(d, f"up{g}")) for g in (0, 1))
            self.assertTrue(wait_until(up, 20), "the job did not start")
            nodes.append(self.hosts.launch(2, [DTRAIN_RUN] + args + worker, clean_env()))
            results = finish(*nodes, timeout=30)
        finally:
            for p in nodes:
                p.kill()
            finish(*nodes, timeout=10)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
            self.assertRegex(err, r"dtrain-run: node 2 \(.*\) joined; world size 2 -> 3 \(attempt 1\)\n")
            self.assertNotIn("used up", err)
        self.assertRegex(results[1][2], r"dtrain-run: rank 1 \(local rank 0, pid \d+\) failed first: it exited with "
                                        r"code 1")
        with open(os.path.join(d, "seen")) as f:
            self.assertEqual(sorted(f.read().splitlines()), ["0 3", "1 3", "2 3"])
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_the_middle_node_leaves_and_the_last_one_takes_its_group_rank(self):
        args = elastic_args(self.port, self.hosts.addr[0], "2:3", last_call=1, max_restarts=1) + self.worker(1000, 0.05)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(3)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 5, 20), "the job did not start training")
            last = [s["launcher"] for s in self.starts() if s["group"] == 2]
            killed = self.kill_node(nodes, 1)
            self.assertTrue(wait_until(lambda: self.restarted(1) == 2, 20),
                            "the survivors did not restart")
            self.end_training()
            results = finish(*[p for i, p in enumerate(nodes) if i != killed], timeout=20)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
            # A lost node spends a restart, as in torchelastic (the survivors' workers fail there).
            self.assertRegex(err, r"dtrain-run: node 1 \(.*\) left; world size 3 -> 2 \(attempt 1, restart 1 of "
                                  r"--max_restarts 1\)\n")
        again = sorted((s["group"], s["rank"], s["world"], s["groups"], s["launcher"])
                       for s in self.starts() if s["restart"] == 1)
        self.assertEqual(again, [(0, 0, 2, 2, nodes[0].pid), (1, 1, 2, 2, last[0])])
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_torchrun_c10d_form_a_node_killed_and_another_joining(self):
        # torchrun's form, as TorchX and Kubeflow's elastic policy write it: --rdzv_backend c10d with an
        # endpoint and --nnodes 1:3, no --node_rank: the launcher on the endpoint's host hosts, group
        # ranks come from the rendezvous, are stable within a round and are formed anew at each restart.
        args = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{self.hosts.addr[0]}:{self.port}", "--rdzv_id", "el1",
                "--nnodes", "1:3", "--nproc_per_node", 1, "--rdzv_conf", "join_timeout=20,last_call_timeout=1",
                "--max_restarts", 3, "--monitor_interval", "0.1", "--grace_period", 1] + self.worker(1000, 0.05)

        def rounds():
            """The workers' start lines by attempt, read while the log grows (a line being written is left out)."""
            by = {}
            try:
                with open(os.path.join(self.tmp, "log")) as f:
                    found = [m for line in f if (m := START_RE.match(line.strip()))]
            except OSError:
                return by
            keys = ("rank", "world", "group", "groups", "restart", "step", "pid", "launcher")
            for m in found:
                s = dict(zip(keys, map(int, m.groups())))
                by.setdefault(s["restart"], []).append(s)
            return by

        def a_round(n, launcher=None):
            """The newest attempt whose group has n nodes (and `launcher` among them), or None."""
            for restart, group in sorted(rounds().items(), reverse=True):
                if len(group) == n and all(s["groups"] == n for s in group) and \
                        (launcher is None or launcher in [s["launcher"] for s in group]):
                    return restart, sorted((s["group"], s["rank"], s["world"], s["launcher"]) for s in group)
            return None

        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(2)]) as nodes:
            self.assertTrue(wait_until(lambda: a_round(2) is not None, 20), "the two nodes did not form a group")
            first, group = a_round(2)
            self.assertEqual(group, [(0, 0, 2, nodes[0].pid), (1, 1, 2, nodes[1].pid)])
            victim = [s["pid"] for s in rounds()[first] if s["group"] == 1][0]
            nodes[1].kill()
            os.kill(victim, signal.SIGKILL)
            self.assertTrue(wait_until(lambda: (a_round(1) or (-1,))[0] > first, 20), "node 0 did not go on alone")
            nodes.append(self.hosts.launch(2, [DTRAIN_RUN] + args, clean_env()))
            self.assertTrue(wait_until(lambda: a_round(2, nodes[2].pid) is not None, 20), "the new node was not admitted")
            _, group = a_round(2, nodes[2].pid)
            self.assertEqual(group, [(0, 0, 2, nodes[0].pid), (1, 1, 2, nodes[2].pid)])
            self.end_training()
            results = finish(nodes[0], nodes[2], timeout=20)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
        self.assertRegex(results[0][2], r"dtrain-run: node 1 \(.*\) left; world size 2 -> 1")
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_lost_node_ends_the_job_when_no_restart_is_left(self):
        args = elastic_args(self.port, self.hosts.addr[0], "2:3", last_call=1, max_restarts=0) + self.worker(400, 0.05)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(3)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 5, 20), "the job did not start training")
            killed = self.kill_node(nodes, 2)
            results = finish(*[p for i, p in enumerate(nodes) if i != killed], timeout=30)
        for rc, _, err in results:
            self.assertEqual(rc, 1, err)
            self.assertRegex(err.strip().splitlines()[-1],
                             r"^dtrain-run: node 2 \(.*\) left; --max_restarts 0 used up after attempt 0: the job ends$")
        self.assertEqual({s["restart"] for s in self.starts()}, {0})
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_node_beyond_max_waits_for_a_place_and_leaves_when_the_job_ends(self):
        # As torchelastic's redundancy list: a node that finds the job at MAX does not restart it; it
        # waits for a place (a node that leaves frees one) and ends with the job.
        args = elastic_args(self.port, self.hosts.addr[0], "2:3", last_call=1) + self.worker(1000, 0.05)
        # A shared secret: the spare then joins the store only once it proved to be this job's, and
        # says nothing of an unproven host.
        nodes = [self.hosts.launch(i, [DTRAIN_RUN] + args, with_secret()) for i in range(3)]
        spare = None
        try:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 3, 20), "the job did not start training")
            spare = self.hosts.launch(2, [DTRAIN_RUN] + args, with_secret())
            lines, wait_spare = self.follow_stderr(spare)
            told = wait_until(lambda: any("the job is full" in l for l in lines), 10)
            at = self.step_reached()
            self.assertTrue(wait_until(lambda: self.step_reached() >= at + 5, 10), "the job stopped training")
            # The spare reads node 0's word only every 250 ms: stopped through the job's end, as a
            # slow poll on a loaded machine, it must still be told (node 0 waits for it to read).
            os.kill(spare.pid, signal.SIGSTOP)
            self.end_training()
            time.sleep(1)
            os.kill(spare.pid, signal.SIGCONT)
            results = finish(*nodes, timeout=20)
            rc, err = wait_spare(timeout=20)
        finally:
            for p in nodes + [spare]:
                if p:
                    p.kill()
            finish(*nodes, timeout=10)
        self.assertTrue(told, err)
        for r, _, e in results:
            self.assertEqual(r, 0, e)
            self.assertNotIn("attempt 1", e)
        self.assertEqual(len(self.starts()), 3)
        self.assertEqual(rc, 0, err)
        self.assertRegex(err, r"^dtrain-run: the job is full: node 0 runs --nnodes 2:3 with 3 nodes; this node waits "
                              r"for a place \(a node that leaves frees one\) until the job ends\n")
        self.assertEqual(err.strip().splitlines()[-1],
                         "dtrain-run: the elastic job ended before node 0 admitted this node; nothing ran here")

    def test_a_waiting_node_that_dies_is_never_admitted(self):
        args = elastic_args(self.port, self.hosts.addr[0], "1:2", last_call=0.5, max_restarts=1) + self.worker(1000, 0.05)
        nodes = [self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(2)]
        spare = None
        try:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 3, 20), "the job did not start training")
            spare = self.hosts.launch(2, [DTRAIN_RUN] + args, clean_env())
            lines, wait_spare = self.follow_stderr(spare)
            self.assertTrue(wait_until(lambda: any("the job is full" in l for l in lines), 10), "".join(lines))
            spare.kill()
            wait_spare(timeout=5)
            # Its heartbeat stops: node 0 must neither stop the job for it now...
            time.sleep(3.5)
            at = self.step_reached()
            self.assertTrue(wait_until(lambda: self.step_reached() > at, 5), "the job stopped training")
            self.assertEqual({s["restart"] for s in self.starts()}, {0})
            # ...nor admit it when a place frees up later.
            nodes[1].send_signal(signal.SIGTERM)
            self.assertTrue(wait_until(lambda: self.restarted(1) == 1, 20),
                            "the job did not restart without node 1")
            self.end_training()
            (rc0, _, err0), (rc1, _, err1) = finish(*nodes, timeout=20)
        finally:
            for p in nodes + [spare]:
                if p:
                    p.kill()
            finish(*nodes, timeout=10)
        self.assertEqual(rc0, 0, err0)
        self.assertEqual(rc1, 128 + signal.SIGTERM, err1)
        self.assertRegex(err0, r"dtrain-run: node 1 \(.*\) left \(its launcher was stopped by a signal\); world size "
                               r"2 -> 1 \(attempt 1, restart 1 of --max_restarts 1\)\n")
        self.assertNotIn("joined", err0)
        self.assertEqual(sorted((s["restart"], s["world"]) for s in self.starts()), [(0, 2), (0, 2), (1, 1)])
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_killed_node_leaves_and_the_survivors_finish_with_world_size_2(self):
        args = elastic_args(self.port, self.hosts.addr[0], "2:3") + self.worker(60)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(3)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 15, 30), "the job did not start training")
            killed = self.kill_node(nodes, 2)
            killed_at = self.step_reached()
            (rc0, _, err0), (rc1, _, err1) = finish(*[p for i, p in enumerate(nodes) if i != killed], timeout=60)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        for err in (err0, err1):
            self.assertRegex(err, r"dtrain-run: elastic job formed by node 0 \(.*\), node 1 \(.*\), node 2 \(.*\); "
                                  r"world size 3 \(attempt 0\)")
            self.assertRegex(err, r"dtrain-run: node 2 \(.*\) left; world size 3 -> 2 \(attempt 1, restart 1 of "
                                  r"--max_restarts 3\)\n")
        starts = self.starts()
        self.assertEqual(sorted((s["restart"], s["rank"], s["world"], s["group"], s["groups"]) for s in starts),
                         [(0, 0, 3, 0, 3), (0, 1, 3, 1, 3), (0, 2, 3, 2, 3), (1, 0, 2, 0, 2), (1, 1, 2, 1, 2)])
        resumed = {s["step"] for s in starts if s["restart"] == 1}
        self.assertEqual(len(resumed), 1, starts)
        resumed = resumed.pop()
        self.assertGreaterEqual(resumed, killed_at)  # from the last checkpoint, not from the start
        trained = self.trained_steps()
        # Every step once on 3 ranks up to the checkpoint, then the rest on 2 ranks.
        self.assertEqual([s for r, w, s in trained if r == 0], list(range(resumed)))
        self.assertTrue(all(w == 3 for r, w, s in trained if r == 0))
        self.assertEqual([(w, s) for r, w, s in trained if r == 1], [(2, s) for s in range(resumed, 60)])
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_node_that_arrives_during_training_is_admitted_at_a_restart(self):
        args = elastic_args(self.port, self.hosts.addr[0], "2:3", last_call=1) + self.worker(50)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(2)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 10, 30), "the job did not start training")
            nodes.append(self.hosts.launch(2, [DTRAIN_RUN] + args, clean_env()))
            results = finish(*nodes, timeout=60)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
        self.assertRegex(results[0][2], r"world size 2 \(attempt 0\)")
        for _, _, err in results:
            self.assertRegex(err, r"dtrain-run: node 2 \(.*\) joined; world size 2 -> 3 \(attempt 1\)\n")
        last = [s for s in self.starts() if s["restart"] == 1]
        self.assertEqual(sorted((s["rank"], s["world"], s["group"], s["groups"]) for s in last),
                         [(0, 3, 0, 3), (1, 3, 1, 3), (2, 3, 2, 3)])
        self.assertGreaterEqual(last[0]["step"], 10)
        self.assertEqual([s for _, _, s in self.trained_steps()], list(range(50)))
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_below_min_every_survivor_ends_with_a_clear_message(self):
        args = elastic_args(self.port, self.hosts.addr[0], "3:4", last_call=1) + self.worker(400)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(3)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 5, 30), "the job did not start training")
            killed = self.kill_node(nodes, 2)
            t0 = time.monotonic()
            results = finish(*[p for i, p in enumerate(nodes) if i != killed], timeout=40)
            took = time.monotonic() - t0
        for rc, _, err in results:
            self.assertEqual(rc, 1, err)
            last = err.strip().splitlines()[-1]
            self.assertRegex(last, r"^dtrain-run: node 2 \(.*\) left; 2 node\(s\) remain, fewer than the minimum 3 of "
                                   r"--nnodes 3:4: the job ends \(world size 3, attempt 0\)$")
        self.assertLess(took, 20)  # heartbeats (3 s) and the grace period, not a collective timeout
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_the_job_ends_when_node_zero_dies(self):
        # The rendezvous lives on node 0's launcher only: without it the others cannot agree on
        # anything, so they stop their workers and end with a line that says why.
        args = elastic_args(self.port, self.hosts.addr[0], "1:3", last_call=1) + self.worker(400)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(2)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 5, 30), "the job did not start training")
            killed = self.kill_node(nodes, 0)
            ((rc, _, err),) = finish(nodes[1 - killed], timeout=30)
        self.assertEqual(rc, 1, err)
        self.assertRegex(err.strip().splitlines()[-1],
                         r"^dtrain-run: lost the rendezvous at 10\.232\.\d+\.1:\d+: node 0's launcher \(the rendezvous "
                         r"host\) is gone, so the elastic job ends$")
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_a_stopped_node_zero_ends_the_job_in_one_line(self):
        # SIGSTOP: node 0's launcher, and the store in it, stop answering, though the kernel keeps
        # their connections (no FIN, no reset). The others notice within the heartbeat deadline
        # (3 s) and end, instead of waiting for a decision that never comes.
        args = elastic_args(self.port, self.hosts.addr[0], "1:3", last_call=1) + self.worker(400)
        with running_nodes([self.hosts.launch(i, [DTRAIN_RUN] + args, clean_env()) for i in range(2)]) as nodes:
            self.assertTrue(wait_until(lambda: self.step_reached() >= 5, 30), "the job did not start training")
            host = [s for s in self.starts() if s["group"] == 0][0]["launcher"]
            os.kill(host, signal.SIGSTOP)
            t0 = time.monotonic()
            other = [p for p in nodes if p.pid != host][0]
            ((rc, _, err),) = finish(other, timeout=30)
            took = time.monotonic() - t0
        self.assertEqual(rc, 1, err)
        self.assertLess(took, 20, err)
        self.assertRegex(err.strip().splitlines()[-1],
                         r"^dtrain-run: node 0's launcher \(the rendezvous host at 10\.232\.\d+\.1:\d+\) did not "
                         r"answer within 3s: it is stopped or gone, so the elastic job ends$")


class ElasticLoopbackTest(MarkedTestCase):
    """What needs no namespaces: the command line and nodes that disagree."""

    def test_bad_nnodes_range(self):
        for value in ("3:2", "0:2", "2:", "a:b"):
            r = run(["--nnodes", value, "true"])
            self.assertEqual(r.returncode, 2, value)
            self.assertEqual(r.stderr, f"dtrain-run: --nnodes MIN:MAX needs 1 <= MIN <= MAX (e.g. --nnodes 2:4), "
                                       f"got '{value}'\n")
        r = run(["--nnodes", "1:2", "--rdzv_last_call", "-1", "true"])
        self.assertEqual((r.returncode, r.stderr),
                         (2, "dtrain-run: --rdzv_last_call must be a number of seconds >= 0 (inf: forever), got '-1'\n"))
        r = run(["--nnodes", "1:2", "--standalone", "true"])
        self.assertEqual((r.returncode, r.stderr),
                         (2, "dtrain-run: --standalone runs one node, but --nnodes is 1:2 (drop one of them)\n"))

    def test_nodes_that_disagree_are_refused(self):
        port = free_port()
        base = ["--nnodes", "2:3", "--master_port", port, "--rdzv_timeout", 3, "--rdzv_last_call", 0.5]
        n0 = start(base + ["--node_rank", 0, "--nproc_per_node", 1, "true"])
        time.sleep(0.3)
        n1 = start(base + ["--nproc_per_node", 2, "true"])
        (rc0, _, err0), (rc1, _, err1) = finish(n0, n1)
        self.assertEqual(rc1, 1, err1)
        self.assertIn("nodes disagree: node 0 has --nnodes 2:3 --nproc_per_node 1 --max_restarts 0, ", err1)
        self.assertIn(" has --nnodes 2:3 --nproc_per_node 2 --max_restarts 0; give every node the same flags", err1)
        self.assertEqual(rc0, 1, err0)
        self.assertIn("only 1 of at least 2 nodes joined the rendezvous", err0)

    def test_one_node_of_one_to_two_runs_alone_after_the_last_call(self):
        r = run(["--nnodes", "1:2", "--master_port", free_port(), "--rdzv_last_call", 0.5, "sh", "-c",
                 'echo "world=$WORLD_SIZE group=$GROUP_RANK groups=$GROUP_WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT"'])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "[rank 0] world=1 group=0 groups=1 restart=0\n")
        self.assertRegex(r.stderr, r"dtrain-run: elastic job formed by node 0 \(.*\); world size 1 \(attempt 0\)\n")

    def test_stray_writes_to_an_open_store_neither_stall_nor_queue_a_node(self):
        # Anyone who reaches an open store can write its keys. A stray ADD of the old waiting counter
        # stalled the start for 10 s, then failed it; a malformed queue line is now ignored, named.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
        from store_wire import OpenStore
        port = free_port()
        p = start(["--nnodes", "1:2", "--master_port", port, "--rdzv_last_call", 2, "--monitor_interval", 0.1,
                   "sh", "-c", "echo ran"])
        try:
            self.assertTrue(wait_until(lambda: port_open(port), 10), "the store never came up")
            stray = OpenStore(port)
            stray.add("dtrain-run/e/waiting", 1)
            stray.set("dtrain-run/e/queue", "not a node\n")
            stray.close()
            ((rc, out, err),) = finish(p, timeout=30)
        finally:
            p.kill()
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), "[rank 0] ran")
        self.assertIn("dtrain-run: node 0 ignores 'not a node' in the rendezvous store's key 'dtrain-run/e/queue': "
                      "not a waiting node", err)

    def test_failures_use_up_max_restarts(self):
        seen = os.path.join(self.tmp, "seen")
        r = run(["--nnodes", "1:2", "--master_port", free_port(), "--rdzv_last_call", 0, "--max_restarts", 1,
                 "--monitor_interval", 0.1, "sh", "-c", f'echo "$TORCHELASTIC_RESTART_COUNT" >> {seen}; exit 3'])
        self.assertEqual(r.returncode, 1, r.stderr)
        with open(seen) as f:
            self.assertEqual(f.read(), "0\n1\n")  # exactly two attempts
        self.assertRegex(r.stderr, r"dtrain-run: restart after node 0 \(.*\) failed: rank 0 .*; world size 1 -> 1 "
                                   r"\(attempt 1, restart 1 of --max_restarts 1\)\n")
        used_up = [l for l in r.stderr.splitlines() if "used up" in l]
        self.assertEqual(len(used_up), 1, r.stderr)
        self.assertRegex(used_up[0], r"^dtrain-run: node 0 \(.*\) failed: rank 0 \(local rank 0, pid \d+\) failed "
                                     r"first: it exited with code 3.*; --max_restarts 1 used up after attempt 1: the "
                                     r"job ends$")
        self.assertEqual(r.stderr.strip().splitlines()[-1], used_up[0])


if __name__ == "__main__":
    unittest.main()
