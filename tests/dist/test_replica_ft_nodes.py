"""dtrain-run --ft on two nodes (two launchers on loopback, --nnodes 2 --node_rank 0/1 with one
--rdzv_endpoint), 2 replicas of 1 rank on each (tests/dist/ft_train.cpp, no checkpoint at all):

  * replica 3 (node 1's second worker) SIGKILLed once all four committed one step s: node 0's
    replicas commit step s + 5 within 3 s with the pids they had, node 1's launcher relaunches replica 3 alone (node 0's
    never relaunches anything, node 1's other replica keeps its pid), the relaunched one heals from a
    peer and from its healing step on hashes to the other three at every step, to the bit; before the
    kill every quorum had the 4 replicas of both nodes;
  * node 1's launcher SIGKILLed (its workers die with it): node 0 says in one line that node 1 is
    gone, its replicas train on to the end and it exits 0 without waiting out --rdzv_timeout;
  * node 0's launcher SIGKILLed (the store, hence the quorum, goes with it): node 1 ends with one line
    naming the lost rendezvous, without relaunching its replicas (its workers notice the lost store
    before its launcher's once-a-second look does).
"""
import os
import signal
import time
import unittest
from collections import defaultdict

from harness import DistTestCase, clean_env, free_port, launcher, scaled, wait_until
from test_replica_ft import ft_train, records

SECRET = "two-node-replica-test-secret-" + "x" * 16


class ReplicaFaultToleranceTwoNodes(DistTestCase):
    def nodes(self, steps, step_ms, monitor_interval=0.05):
        port = free_port()
        procs = []
        for node in (0, 1):
            argv = [launcher(), "--nnodes", 2, "--node_rank", node, "--rdzv_endpoint", f"127.0.0.1:{port}", "--ft",
                    "--nproc_per_node", 2, "--ft_replica_ranks", 1, "--max_restarts", 1, "--monitor_interval", monitor_interval,
                    "--rdzv_timeout", 60, "--grace_period", 2, ft_train(), "--steps", steps, "--step_ms",
                    round(scaled(step_ms)), "--min_replicas", 2, "--replica_ranks", 1]
            procs.append(self.spawn(argv, clean_env(DTRAIN_JOB_SECRET=SECRET)))
        return procs

    @staticmethod
    def commits(procs):
        """{replica: {step: fields}} of the committed steps so far, both nodes' output."""
        out = defaultdict(dict)
        for p in procs:
            for rep, kind, step, f in records(p.output()):
                if kind == "commit":
                    out[rep][step] = f
        return out

    def together(self, procs):
        """The last step every replica committed in a quorum of all four, or None: the two launchers
        start their workers at their own pace (on a busy machine node 1's replicas join steps late, and
        heal into a later step than any fixed one), so a kill waits for one."""
        c = self.commits(procs)
        full = {s for p in procs for rep, kind, s, f in records(p.output())
                if rep == 0 and kind == "begin" and f["participants"] == "4"}
        steps = full.intersection(*(set(c[w]) for w in range(4)))
        return max(steps) if steps else None

    def wait_together(self, procs):
        """together(), once there is such a step."""
        self.assertTrue(wait_until(lambda: self.together(procs) is not None, timeout=scaled(60)),
                        procs[0].output() + procs[1].output())
        return self.together(procs)

    def test_replica_on_node_1_relaunched_by_node_1_alone_heals(self):
        procs = self.nodes(steps=60, step_ms=40)
        everyone = range(4)
        at = self.wait_together(procs)
        old = {w: self.commits(procs)[w][at]["pid"] for w in everyone}
        os.kill(int(old[3]), signal.SIGKILL)
        killed = time.monotonic()
        self.assertTrue(wait_until(lambda: all(at + 5 in self.commits(procs)[w] for w in (0, 1, 2)),
                                   timeout=scaled(10)), procs[0].output() + procs[1].output())
        took = time.monotonic() - killed
        self.assertLess(took, scaled(3.0), f"the survivors took {took:.1f} s to pass step {at + 5}")
        res = [p.finish(scaled(60)) for p in procs]
        for node in (0, 1):
            self.assertEqual(res[node].rc, 0, f"node {node}:\n{res[node]}")
        self.assertIn("relaunching its replica 3 alone", res[1].err)
        self.assertNotIn("relaunching", res[0].err)
        recs = records(res[0].out) + records(res[1].out)
        self.assertEqual({rep for rep, *_ in records(res[0].out)}, {0, 1})
        self.assertEqual({rep for rep, *_ in records(res[1].out)}, {2, 3})
        # Both nodes' replicas met in one quorum: each of them had 4 participants in a step before the kill
        # (the two launchers start their workers at their own pace, so the first steps may have fewer).
        for w in range(4):
            parts = {f["participants"] for rep, kind, s, f in recs if rep == w and kind == "begin" and s <= at}
            self.assertIn("4", parts, f"replica {w} never saw the 4 replicas of both nodes: {parts}")
        commits = self.commits(procs)
        for w in (0, 1, 2):  # nobody else restarted
            self.assertEqual({f["pid"] for f in commits[w].values()}, {old[w]}, f"replica {w} restarted")
        healed = [s for rep, kind, s, f in recs if rep == 3 and kind == "begin" and f["healed"] == "1" and s > 0]
        self.assertTrue(healed, f"replica 3 never healed after its relaunch:\n{res[1].out}")
        relaunched = {s: f for s, f in commits[3].items() if f["pid"] != old[3]}
        self.assertTrue(relaunched and min(relaunched) == healed[-1], (healed, sorted(relaunched)))
        for s, f in relaunched.items():
            for k in (0, 1, 2):
                self.assertEqual(f["hash"], commits[k][s]["hash"], f"step {s}: replica 3 differs from {k}")
        done = {rep: f["hash"] for rep, kind, _, f in recs if kind == "done"}
        self.assertEqual(sorted(done), [0, 1, 2, 3])
        self.assertEqual(len(set(done.values())), 1, done)
        print(f"\n[replica ft, 2 nodes] killed at step {at}, survivors past step {at + 5} {took:.2f} s after the kill; replica 3 healed at "
              f"step {healed[-1]}", flush=True)

    def test_node_1_lost_node_0_trains_on(self):
        procs = self.nodes(steps=200, step_ms=40)
        at = self.wait_together(procs)
        # The last 10 steps must run in a quorum of node 0's replicas alone: 34 steps after the kill.
        self.assertLessEqual(at, 156, f"node 1's replicas joined node 0's quorum only at step {at} of 200")
        procs[1].kill()
        start = time.monotonic()
        res = procs[0].finish(scaled(60))
        took = time.monotonic() - start
        self.assertEqual(res.rc, 0, str(res))
        self.assertIn("node 1's launcher is gone", res.err)
        recs = records(res.out)
        done = {rep: f["hash"] for rep, kind, _, f in recs if kind == "done"}
        self.assertEqual(sorted(done), [0, 1])
        self.assertEqual(len(set(done.values())), 1, done)
        before = {f["participants"] for rep, kind, s, f in recs if kind == "begin" and s <= at}
        last = {f["participants"] for rep, kind, s, f in recs if kind == "begin" and s >= 190}
        self.assertIn("4", before, f"node 1's replicas were never in node 0's quorum: {before}")
        self.assertEqual(last, {"2"}, last)
        self.assertLess(took, scaled(20), f"node 0 took {took:.1f} s after node 1 was lost")

    def test_node_0_lost_ends_the_job_on_node_1(self):
        # Node 1's launcher looks at the store once a second only: its workers find the store gone first,
        # and it must not relaunch them.
        procs = self.nodes(steps=400, step_ms=40, monitor_interval=1.0)
        self.wait_together(procs)
        procs[0].kill()
        res = procs[1].finish(scaled(30))
        self.assertEqual(res.rc, 1, str(res))
        self.assertNotIn("relaunching", res.err)
        last = res.err.strip().splitlines()[-1]
        self.assertRegex(last, r"^dtrain-run: stopping this node's workers: lost the rendezvous at 127\.0\.0\.1:\d+ "
                               r"\(did node 0's launcher die\?\)", res.err)


if __name__ == "__main__":
    unittest.main()
