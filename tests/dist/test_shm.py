"""Shared-memory collectives at the process level: a rank killed with SIGKILL in the middle of
all-reduces makes the others fail fast naming it and leaves nothing in /dev/shm; a bad DTRAIN_SHM
value is one clear error line; all_to_all moves each byte once on one host
(Note [Single-copy all_to_all]) and through Gloo with DTRAIN_SHM_SINGLE_COPY=0, the exchange tests passing both ways."""
import os
import signal
import time
import unittest

import harness
from harness import DistTestCase, free_port, rank_env


def shm_dist_test():
    path = harness.binary("SHM_DIST_TEST", "shm_dist_test")
    if not path:
        raise unittest.SkipTest("shm_dist_test is not built")
    return path


def tensor_collectives_test():
    path = harness.binary("TENSOR_COLLECTIVES_TEST", "tensor_collectives_test")
    if not path:
        raise unittest.SkipTest("tensor_collectives_test is not built")
    return path


def dtrain_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("dtrain-")}


class ShmTest(DistTestCase):
    def test_sigkill_of_a_rank_fails_the_others_fast_and_leaves_no_segment(self):
        before = dtrain_names()
        port = free_port()
        procs = [self.spawn([shm_dist_test(), "--loop_allreduce"], rank_env(r, 3, port)) for r in range(3)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all("ready" in p.output() for p in procs):
            time.sleep(0.05)
        self.assertTrue(all("ready" in p.output() for p in procs), "the ranks did not start")
        time.sleep(0.3)  # well inside the all_reduce loop
        os.kill(procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        for r in (0, 2):
            res = procs[r].finish(30)
            self.assertEqual(res.rc, 1, str(res))
            self.assertLess(res.seconds - (start - procs[r].start), 10, str(res))
            lines = [l for l in res.err.splitlines() if l.startswith("shm_dist_test: error:")]
            self.assertEqual(len(lines), 1, str(res))
            self.assertIn(f"rank {r}: all_reduce", lines[0], str(res))
            # Either this rank saw rank 1 vanish, or it saw the rank that did abort the group.
            self.assertRegex(lines[0], r"rank 1 \(pid \d+\) exited|aborted by another rank", str(res))
        procs[1].finish(5)
        self.assertEqual(dtrain_names() - before, set(), "segments left in /dev/shm")

    def test_bad_dtrain_shm_value(self):
        port = free_port()
        res = self.run_ranks([shm_dist_test(), "--loop_allreduce"],
                             [rank_env(r, 2, port, DTRAIN_SHM="yes") for r in range(2)], timeout=60)
        for r in res:
            self.assertNotEqual(r.rc, 0, str(r))
            self.assertNotEqual(r.rc, -9, str(r))
            self.assertIn("DTRAIN_SHM='yes' is invalid: use 0 (Gloo only), 1 (require shared memory)", r.err,
                          str(r))

    def test_all_to_all_writes_into_peers_directly_or_goes_through_gloo(self):
        for single_copy, line in (("1", "each rank writes into its peers' outputs directly (one copy)"),
                                  ("0", "through Gloo (DTRAIN_SHM_SINGLE_COPY=0)")):
            with self.subTest(single_copy=single_copy):
                port = free_port()
                res = self.run_ranks([tensor_collectives_test(), "--gtest_filter=AllToAll.*"],
                                     [rank_env(r, 3, port, DTRAIN_DEBUG="INFO", DTRAIN_SHM_SINGLE_COPY=single_copy)
                                      for r in range(3)], timeout=120)
                for r in res:
                    self.assertEqual(r.rc, 0, str(r))
                self.assertIn(f"[dtrain shm] all_to_all over 3 ranks of group rank 0 = rank 0: {line}", res[0].err,
                              str(res[0]))


if __name__ == "__main__":
    unittest.main()
