"""Checkpoints that reshard (Note [Resharded epoch]): train_fashion_mnist on N ranks, SIGKILLed
mid-epoch after a checkpoint, resumes on M ranks (3 -> 2 and 2 -> 3). With --sample_log every rank
logs each dataset index it trains; over the interrupted epoch, the samples of the steps up to the
last checkpoint on N ranks plus those of the resumed run on M ranks hold every index of the subset
exactly once, except the M-rank padding of the rest; the steps after that checkpoint (replayed) are
left out. The next epoch is a normal M-rank epoch. (N = M stays bit-identical: test_fault_tolerance.py.)
"""
import collections
import glob
import os
import random
import signal
import tempfile
import time

from harness import DistTestCase, children, clean_env, wait_until
from test_train_fashion_mnist import RESULT_RE, launcher, trainer

SUBSET, BATCH = 1000, 16  # 1000 % 3 != 0: the 3-rank epoch is padded
COMMON = ("--subset", SUBSET, "--test_subset", 200, "--batch_size", BATCH, "--seed", 5, "--threads", 1,
          "--epochs", 2, "--checkpoint_every", 4)
RUN_TIMEOUT_S = 120
SEED = int(os.environ.get("DTRAIN_FAULT_SEED", random.randrange(1 << 30)))


def checkpoint_steps(folder):
    return sorted(int(f[len("checkpoint_"):-3]) for f in os.listdir(folder)
                  if f.startswith("checkpoint_") and f.endswith(".pt"))


def read_log(folder):
    """[(rank, epoch, step, index)] of every samples.rank<R>.attempt0.txt in `folder`."""
    rows = []
    for path in glob.glob(os.path.join(folder, "samples.rank*.attempt0.txt")):
        rank = int(os.path.basename(path).split(".")[1][len("rank"):])
        with open(path) as f:
            rows += [(rank, *map(int, line.split())) for line in f]
    return rows


class Reshard(DistTestCase):
    def setUp(self):
        self.rng = random.Random(SEED)
        print(f"\n[reshard tests] random seed {SEED} (set DTRAIN_FAULT_SEED to repeat)", flush=True)

    def run_job(self, nproc, ckpt, log, *extra):
        argv = [launcher(), "--standalone", "--nproc_per_node", nproc, "--grace_period", 2, "--monitor_interval",
                0.05, trainer(), *COMMON, "--checkpoint_dir", ckpt, "--sample_log", log, *extra]
        return self.spawn(argv, clean_env(DTRAIN_TIMEOUT_S=30))

    def kill_and_resume(self, n, m):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt, log_a, log_b = (os.path.join(tmp, d) for d in ("ckpt", "a", "b"))
            # N ranks until a random step after the first checkpoint, then a worker is SIGKILLed.
            proc = self.run_job(n, ckpt, log_a, "--step_sleep_ms", 100)
            ok = wait_until(lambda: (os.path.isdir(ckpt) and checkpoint_steps(ckpt)) or proc.ended(), 60)
            if not (ok and checkpoint_steps(ckpt)):
                self.fail(f"no checkpoint appeared:\n{proc.finish(1)}")
            time.sleep(self.rng.uniform(0.0, 0.5))
            workers = children(proc.pid)
            self.assertEqual(len(workers), n, f"expected {n} workers, found {workers}")
            os.kill(self.rng.choice(workers), signal.SIGKILL)
            first = proc.finish(RUN_TIMEOUT_S)
            self.assertNotEqual(first.rc, 0, f"the {n}-rank run was not interrupted:\n{first}")
            last = checkpoint_steps(ckpt)[-1]
            # M ranks resume from the newest checkpoint and finish.
            res = self.run_job(m, ckpt, log_b).finish(RUN_TIMEOUT_S)
            self.assertEqual(res.rc, 0, str(res))
            self.assertIn(f"checkpoint_{last:010d}.pt", res.out, str(res))
            self.assertIn(f"saved by {n} rank(s): the rest of the epoch is resharded over {m}", res.out, str(res))
            m_result = RESULT_RE.match(res.out.strip().splitlines()[-1])
            self.assertIsNotNone(m_result, str(res))
            self.assertIn("ranks_agree=1", res.out)
            rows_a, rows_b = read_log(log_a), read_log(log_b)

        per_rank_n = -(-SUBSET // n)  # the N-rank epoch, padded
        steps_n = -(-per_rank_n // BATCH)
        self.assertLess(last, steps_n, f"the kill landed after epoch 1 (checkpoint step {last}): raise --subset")
        kept = [r for r in rows_a if r[1] == 1 and r[2] <= last]  # trained before the checkpoint
        self.assertEqual(len(kept), last * BATCH * n, "the log lacks samples of steps the checkpoint holds")
        self.assertEqual({r[0] for r in rows_b}, set(range(m)), "not every resumed rank logged")
        self.assertTrue(all(r[2] > last for r in rows_b), "the resumed run reused step numbers")

        # Epoch 1: N ranks consumed last * BATCH each (no padding reached), M ranks the rest, padded.
        counts = collections.Counter(r[3] for r in kept + [r for r in rows_b if r[1] == 1])
        rest = SUBSET - last * BATCH * n
        pad = -rest % m
        self.assertEqual(set(counts), set(range(SUBSET)), "samples skipped in the interrupted epoch")
        twice = sorted(i for i, c in counts.items() if c > 1)
        self.assertEqual(len(twice), pad, f"samples trained twice beyond the {pad} padded: {twice[:10]}")
        self.assertTrue(all(counts[i] == 2 for i in twice))
        # Epoch 2: a normal M-rank epoch, each index once plus M's padding.
        counts2 = collections.Counter(r[3] for r in rows_b if r[1] == 2)
        self.assertEqual(set(counts2), set(range(SUBSET)))
        self.assertEqual(sum(counts2.values()), SUBSET + (-SUBSET % m))
        print(f"[reshard tests] {n} -> {m} ranks: checkpoint at step {last}, {len(rows_a) - len(kept)} replayed "
              f"sample(s) left out, {rest} left for {m} ranks (+{pad} padded)", flush=True)

    def test_three_ranks_resume_on_two(self):
        self.kill_and_resume(3, 2)

    def test_two_ranks_resume_on_three(self):
        self.kill_and_resume(2, 3)
