"""Per-step replica fault tolerance (dtrain::ft::Manager) under dtrain-run --ft, 3 replicas of 1 rank,
tests/dist/ft_train.cpp (a float64 MLP, no checkpoint at all):

  * SIGKILL of replica 2 once it committed step 20: replicas 0 and 1 commit step 25 within 3 s with
    the pids they had; the launcher relaunches replica 2 alone, which heals from a peer (it has no
    checkpoint to read: ft_train has no checkpoint code and no folder is given), and from its healing
    step on its parameters hash to its peers' at every step, to the bit; across every replica's
    committed steps no sample of an epoch is trained twice;
  * 2 replicas of 2 ranks (each a dtrain world of its own, the ranks' gradients averaged inside it
    first): the second rank of replica 1 SIGKILLed at step 20; the launcher relaunches both ranks of
    replica 1, which heal rank for rank from replica 0, with the same checks;
  * a replica that was never there joins a running job: dtrain-run --ft starts replicas 0 and 1, and
    once they committed step 10 a third ft_train process is started by hand (DTRAIN_FT_REPLICA_ID=2,
    the launcher's store and job secret); the next quorum takes it in, it heals from a peer, and from
    then on every committed step leaves the three replicas' parameters equal, to the bit, the quorum
    of 3 splitting the samples three ways with none trained twice;
  * replica 2 SIGKILLs itself between its all-reduce of step 12 and its vote: nobody applies step 12
    (the survivors' parameters when they try step 12 again hash as on the first try) and the run
    finishes with the three replicas equal;
  * DiLoCo composed with the Manager (ft_train --diloco 3: a step is a sync of 3 inner steps):
    replica 2 SIGKILLs itself between its all-reduce of sync 4 and its vote: the survivors' sync
    fails, which puts their parameters back to sync 3's (the inner steps since discarded), the
    relaunched replica (awaited: min_replicas 3) heals the last sync's parameters and outer
    momentum from a peer, and every committed sync leaves every replica that made it with the same
    parameters, to the bit.
"""
import os
import re
import signal
import tempfile
import time
import unittest
from collections import defaultdict

from harness import DistTestCase, binary, clean_env, free_port, launcher, scaled, wait_until

LINE = re.compile(r"^\[rank (\d+)\] (begin|commit|abort|done) (\S+)(.*)$")


def ft_train():
    path = binary("FT_TRAIN", "ft_train")
    if not path:
        raise unittest.SkipTest("ft_train is not built (set FT_TRAIN)")
    return path


def records(out):
    """[(replica, kind, step, {field: value})] in output order."""
    recs = []
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        words = m.group(4).split()
        fields = dict(zip(words[0::2], words[1::2]))
        recs.append((int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3).isdigit() else m.group(3), fields))
    return recs


class ReplicaFaultTolerance(DistTestCase):
    def launch(self, *args, nproc=3, replica_ranks=1):
        argv = [launcher(), "--standalone", "--ft", "--nproc_per_node", nproc, "--ft_replica_ranks", replica_ranks,
                "--max_restarts", 1, "--monitor_interval", 0.05, ft_train(), "--min_replicas", 2,
                "--replica_ranks", replica_ranks, *args]
        return self.spawn(argv, clean_env())

    def commits(self, proc):
        """{worker: {step: fields}} of the committed steps so far."""
        out = defaultdict(dict)
        for rep, kind, step, f in records(proc.output()):
            if kind == "commit":
                out[rep][step] = f
        return out

    def assert_no_sample_twice(self, recs):
        seen = defaultdict(list)
        for rep, kind, step, f in recs:
            if kind == "commit" and f["samples"] != "-":
                seen[f["epoch"]] += [int(i) for i in f["samples"].split(",")]
        self.assertTrue(seen)
        for epoch, samples in seen.items():
            dups = sorted({i for i in samples if samples.count(i) > 1})
            self.assertEqual(dups, [], f"epoch {epoch}: samples trained twice")
        return seen

    def kill_and_heal(self, nproc, replica_ranks, victim):
        """SIGKILL worker `victim` once it committed step 20; its replica is relaunched and heals."""
        replica = victim // replica_ranks
        lost = [w for w in range(nproc) if w // replica_ranks == replica]
        kept = [w for w in range(nproc) if w not in lost]
        # The pace slows with a sanitizer's: the relaunched replica must arrive before the survivors finish.
        p = self.launch("--steps", 40, "--step_ms", round(scaled(40)), nproc=nproc, replica_ranks=replica_ranks)
        self.assertTrue(wait_until(lambda: all(20 in self.commits(p)[w] for w in range(nproc)), timeout=scaled(40)),
                        p.output())
        old = {w: self.commits(p)[w][20]["pid"] for w in range(nproc)}
        os.kill(int(old[victim]), signal.SIGKILL)
        killed = time.monotonic()
        self.assertTrue(wait_until(lambda: all(25 in self.commits(p)[w] for w in kept), timeout=scaled(10)), p.output())
        took = time.monotonic() - killed
        self.assertLess(took, scaled(3.0), f"the survivors took {took:.1f} s to pass step 25:\n{p.output()}")
        res = p.finish(scaled(60))
        self.assertEqual(res.rc, 0, str(res))
        self.assertIn(f"relaunching its replica {replica} alone", res.err)
        recs = records(res.out)
        commits = self.commits(p)
        for w in kept:  # the survivors never restarted
            self.assertEqual({f["pid"] for f in commits[w].values()}, {old[w]})
        # The lost replica's new processes: they healed, then matched the survivors bit for bit at every step.
        for w in lost:
            healed = [s for rep, kind, s, f in recs if rep == w and kind == "begin" and f["healed"] == "1" and s > 0]
            self.assertTrue(healed, f"worker {w} never healed after its relaunch:\n{res.out}")
            relaunched = {s: f for s, f in commits[w].items() if f["pid"] != old[w]}
            self.assertTrue(relaunched and min(relaunched) == healed[-1], (healed, sorted(relaunched)))
            for s, f in relaunched.items():
                for k in kept:
                    self.assertEqual(f["hash"], commits[k][s]["hash"], f"step {s}: worker {w} differs from {k}")
        done = {rep: f["hash"] for rep, kind, _, f in recs if kind == "done"}
        self.assertEqual(sorted(done), list(range(nproc)))
        self.assertEqual(len(set(done.values())), 1, done)
        seen = self.assert_no_sample_twice(recs)
        print(f"\n[replica ft] {nproc // replica_ranks} replicas x {replica_ranks}: survivors past step 25 "
              f"{took:.2f} s after the kill; replica {replica} healed at step {healed[-1]}; epoch 0 covered "
              f"{len(set(seen['0']))} of 240 samples", flush=True)

    def test_killed_replica_relaunched_heals_from_peer(self):
        self.kill_and_heal(nproc=3, replica_ranks=1, victim=2)

    def test_replica_of_two_ranks_loses_its_second_rank(self):
        self.kill_and_heal(nproc=4, replica_ranks=2, victim=3)

    def test_a_replica_that_was_never_there_joins_a_running_job(self):
        port, secret = free_port(), "late-joiner-test-secret-" + "x" * 16
        common = ("--steps", 40, "--step_ms", round(scaled(40)), "--min_replicas", 2, "--replica_ranks", 1)
        p = self.spawn([launcher(), "--nnodes", 1, "--node_rank", 0, "--master_addr", "127.0.0.1", "--master_port",
                        port, "--ft", "--nproc_per_node", 2, "--ft_replica_ranks", 1, "--monitor_interval", 0.05,
                        ft_train(), *common], clean_env(DTRAIN_JOB_SECRET=secret))
        # The joiner starts now but joins only once the file exists: its start-up (LibTorch's) is not
        # a race against the others' last steps.
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        go = os.path.join(tmp.name, "join")
        joiner = self.spawn([ft_train(), *common, "--join_when", go],
                            clean_env(DTRAIN_FT_REPLICA_ID=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                      DTRAIN_JOB_SECRET=secret))
        self.assertTrue(wait_until(lambda: all(10 in self.commits(p)[w] for w in (0, 1)), timeout=scaled(40)),
                        p.output())
        open(go, "w").close()
        late = joiner.finish(scaled(60))
        res = p.finish(scaled(60))
        self.assertEqual(res.rc, 0, str(res))
        self.assertEqual(late.rc, 0, str(late))
        # The joiner's lines as the launcher would have prefixed them.
        recs = records(res.out) + records("".join(f"[rank 2] {line}\n" for line in late.out.splitlines()))
        begins = [(s, f) for rep, kind, s, f in recs if rep == 2 and kind == "begin"]
        self.assertTrue(begins, late.out)
        first, f = begins[0]
        self.assertGreater(first, 10, f"the joiner began at step {first}, before the others committed step 10")
        self.assertEqual((f["healing"], f["members"]), ("1", "3"), f"the joiner's first step: {f}")
        mine = {s: f for rep, kind, s, f in recs if rep == 2 and kind == "commit"}
        peers = {r: {s: f for rep, kind, s, f in recs if rep == r and kind == "commit"} for r in (0, 1)}
        self.assertTrue(mine and min(mine) == first, (first, sorted(mine)))
        for s, f in mine.items():
            for r in (0, 1):
                self.assertEqual(f["hash"], peers[r][s]["hash"], f"step {s}: the joiner differs from replica {r}")
        # Before it joined the quorum had 2 participants (step 0 one: the other member heals from it), after 3.
        before = {f["participants"] for rep, kind, s, f in recs if rep == 0 and kind == "begin" and 0 < s < first}
        after = {f["participants"] for rep, kind, s, f in recs if rep == 0 and kind == "begin" and s > first}
        self.assertEqual((before, after), ({"2"}, {"3"}), (before, after))
        done = {rep: f["hash"] for rep, kind, _, f in recs if kind == "done"}
        self.assertEqual(sorted(done), [0, 1, 2])
        self.assertEqual(len(set(done.values())), 1, done)
        self.assert_no_sample_twice(recs)
        print(f"\n[replica ft] a new replica joined at step {first} (the others had committed step 10)", flush=True)

    def test_failure_between_allreduce_and_vote_is_applied_by_nobody(self):
        p = self.launch("--steps", 18, "--step_ms", 10, "--die_after_allreduce", 12)
        res = p.finish(scaled(60))
        self.assertEqual(res.rc, 0, str(res))
        recs = records(res.out)
        for r in (0, 1):
            tries = [f["hash"] for rep, kind, s, f in recs if rep == r and kind == "begin" and s == 12]
            self.assertGreaterEqual(len(tries), 2, f"replica {r} did not try step 12 again:\n{res.out}")
            self.assertEqual(len(set(tries)), 1, f"replica {r} applied the failed step 12: {tries}")
            self.assertTrue(any(rep == r and kind == "abort" and s == 12 for rep, kind, s, _ in recs))
        done = {rep: f["hash"] for rep, kind, _, f in recs if kind == "done"}
        self.assertEqual(sorted(done), [0, 1, 2])
        self.assertEqual(len(set(done.values())), 1, done)
        self.assert_no_sample_twice(recs)

    def test_diloco_sync_that_fails_restores_the_last_syncs_parameters(self):
        # min_replicas 3: the survivors wait for the relaunched replica, which then must heal.
        p = self.launch("--steps", 7, "--step_ms", 5, "--diloco", 3, "--die_after_allreduce", 4, "--min_replicas", 3)
        res = p.finish(scaled(60))
        self.assertEqual(res.rc, 0, str(res))
        recs = records(res.out)
        for r in (0, 1):
            last = next(f["hash"] for rep, kind, s, f in recs if rep == r and kind == "commit" and s == 3)
            aborts = [f["hash"] for rep, kind, s, f in recs if rep == r and kind == "abort" and s == 4]
            self.assertTrue(aborts, f"replica {r}'s sync 4 did not fail:\n{res.out}")
            self.assertEqual(set(aborts), {last}, f"replica {r}: not back to sync 3's parameters:\n{res.out}")
            # ... which its inner steps had left: the restore undid something.
            tries = [f["hash"] for rep, kind, s, f in recs if rep == r and kind == "begin" and s == 4]
            self.assertNotIn(last, tries)
        by_step = defaultdict(set)
        for rep, kind, s, f in recs:
            if kind == "commit":
                by_step[s].add(f["hash"])
        self.assertEqual(sorted(by_step), list(range(7)))
        for s, hashes in by_step.items():
            self.assertEqual(len(hashes), 1, f"sync {s}: the replicas differ: {hashes}")
        self.assertIn("relaunching its replica 2 alone", res.err)
        healed = [s for rep, kind, s, f in recs if rep == 2 and kind == "begin" and f["healed"] == "1" and s > 0]
        self.assertTrue(healed, f"replica 2 never healed after its relaunch:\n{res.out}")
        done = {rep: f["hash"] for rep, kind, _, f in recs if kind == "done"}
        self.assertEqual(sorted(done), [0, 1, 2])
        self.assertEqual(len(set(done.values())), 1, done)


if __name__ == "__main__":
    unittest.main()
