"""dtrain's C++ programs under the real torchrun (PyTorch 2.x from .venv, `torchrun --no-python`).

Built against LibTorch 2.x (build-torch2), the trainer runs under torchrun as it does under dtrain-run:
  * --standalone --nproc_per_node 2 to its RESULT line, every rank with rank 0's parameters;
  * two torchrun "nodes" on loopback (--nnodes 2, c10d rendezvous) agree with the one-node run;
  * --max_restarts 1 after a worker is SIGKILLed mid-epoch: torchrun restarts the group, the ranks
    resume from dtrain's checkpoint and end with the uninterrupted run's params_sha256.
Built against LibTorch 1.13 (build/), whose c10d client cannot speak torchrun 2.x's store protocol,
a rank fails at once with one line that says why and what to do, instead of hanging.

Binaries: $TRAIN_FASHION_MNIST, $HELLO; $TORCHRUN (.venv/bin/torchrun); $DTRAIN_TORCH_MAJOR is the
major version of the LibTorch this tree was built against (set by tests/dist/CMakeLists.txt).
"""
import os
import random
import signal
import tempfile
import time
import unittest

from harness import DistTestCase, children, clean_env, free_port, hello, wait_until
from test_fault_tolerance import checkpoints
from test_train_fashion_mnist import RESULT_RE, trainer

TORCH_MAJOR = int(os.environ.get("DTRAIN_TORCH_MAJOR", "0"))
COMMON = ("--subset", 384, "--test_subset", 200, "--batch_size", 32, "--seed", 5, "--threads", 1, "--epochs", 2)
RUN_TIMEOUT_S = 150


def torchrun():
    path = os.environ.get("TORCHRUN", "")
    if not os.access(path, os.X_OK):
        raise unittest.SkipTest(f"no torchrun at TORCHRUN={path!r}: run scripts/setup.sh (PyPI's torch in .venv/)")
    return path


def env():
    # torchrun's own Python must not see a PYTHONPATH meant for Debian's python3-torch.
    return clean_env(DTRAIN_TIMEOUT_S=30, PYTHONPATH=None, TORCHELASTIC_ERROR_FILE=None)


class UnderTorchrun(DistTestCase):
    def result(self, res):
        self.assertEqual(res.rc, 0, str(res))
        found = [RESULT_RE.match(l.strip()) for l in res.out.splitlines()]
        found = [m for m in found if m]
        self.assertEqual(len(found), 1, f"expected one RESULT line (rank 0's):\n{res}")
        self.assertEqual(found[0].group(5), "1", f"the ranks ended with different parameters:\n{res}")
        return found[0]

    def standalone(self, *args, nproc=2, restarts=0):
        return self.spawn([torchrun(), "--no-python", "--standalone", "--nproc_per_node", nproc,
                           "--max_restarts", restarts, "--monitor_interval", 0.1, trainer(), *COMMON, *args], env())

    _reference = None

    def reference_sha(self):
        if UnderTorchrun._reference is None:
            m = self.result(self.standalone().finish(RUN_TIMEOUT_S))
            UnderTorchrun._reference = m.group(4)
        return UnderTorchrun._reference

    @unittest.skipUnless(TORCH_MAJOR >= 2, "LibTorch 1.13 cannot join torchrun 2.x's store (tested below)")
    def test_standalone_two_workers_train_to_the_result_line(self):
        self.reference_sha()

    @unittest.skipUnless(TORCH_MAJOR >= 2, "LibTorch 1.13 cannot join torchrun 2.x's store (tested below)")
    def test_two_nodes_with_c10d_rendezvous_match_one_node(self):
        port = free_port()
        nodes = [self.spawn([torchrun(), "--no-python", "--nnodes", 2, "--nproc_per_node", 1, "--node_rank", n,
                             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "dtrain-test",
                             trainer(), *COMMON], env()) for n in (0, 1)]
        results = [n.finish(RUN_TIMEOUT_S) for n in nodes]
        for r in results:
            self.assertEqual(r.rc, 0, str(r))
        rank0 = [r for r in results if "RESULT " in r.out]
        self.assertEqual(len(rank0), 1, "\n".join(map(str, results)))
        m = self.result(rank0[0])
        if m.group(4):
            # Same sampler shards, same averaged gradients: the two-node job is the one-node job.
            self.assertEqual(m.group(4), self.reference_sha())

    @unittest.skipUnless(TORCH_MAJOR >= 2, "LibTorch 1.13 cannot join torchrun 2.x's store (tested below)")
    def test_max_restarts_after_sigkill_ends_identical(self):
        expected = self.reference_sha()
        rng = random.Random(os.environ.get("DTRAIN_FAULT_SEED"))
        with tempfile.TemporaryDirectory() as ckpt:
            proc = self.standalone("--checkpoint_dir", ckpt, "--checkpoint_every", 2, "--step_sleep_ms", 150,
                                   restarts=1)
            if not (wait_until(lambda: checkpoints(ckpt) or proc.ended(), 90) and checkpoints(ckpt)):
                self.fail(f"no checkpoint appeared:\n{proc.finish(1)}")
            time.sleep(rng.uniform(0.0, 0.4))  # a random step, mid-epoch
            workers = children(proc.pid)
            self.assertEqual(len(workers), 2, f"torchrun's workers: {workers}")
            os.kill(rng.choice(workers), signal.SIGKILL)
            res = proc.finish(RUN_TIMEOUT_S)
        self.assertIn("resumed from ", res.out, str(res))
        self.assertEqual(self.result(res).group(4), expected, "the restarted run ended with other parameters")

    @unittest.skipUnless(0 < TORCH_MAJOR < 2, "only a LibTorch 1.x build meets torchrun 2.x's new store protocol")
    def test_libtorch_1_13_fails_at_once_with_the_remedy(self):
        res = self.spawn([torchrun(), "--no-python", "--standalone", "--nproc_per_node", 1, hello()],
                         env()).finish(60)
        self.assertNotEqual(res.rc, 0, str(res))
        self.assertLess(res.seconds, 40, f"it took too long to fail:\n{res}")
        lines = [l for l in (res.out + res.err).splitlines() if "does not answer LibTorch 1.13's TCPStore" in l]
        self.assertTrue(lines, f"no line saying why:\n{res}")
        self.assertIn("build dtrain against LibTorch 2.x", lines[0])


if __name__ == "__main__":
    unittest.main()
