"""Init methods with ranks started directly (no launcher): env:// with rank 0 hosting the store,
tcp://host:port with rank and world size from the environment, and file:// (c10d FileStore)."""
import os
import tempfile
import time
import unittest

from harness import DistTestCase, binary, clean_env, free_port, hello, rank_env


class InitMethods(DistTestCase):
    def test_env_two_ranks(self):
        port = free_port()
        results = self.run_ranks([hello(), "--timeout_s", 30], [rank_env(r, 2, port) for r in range(2)])
        self.assertPassed(results, 2)
        for r, res in enumerate(results):
            self.assertIn(f"Rank: {r}, World Size: 2, Local Rank: {r}/2", res.out, str(res))

    def test_env_three_ranks(self):
        port = free_port()
        results = self.run_ranks([hello(), "--timeout_s", 30], [rank_env(r, 3, port) for r in range(3)])
        self.assertPassed(results, 3)

    def test_env_rank0_started_last(self):
        # Ranks 1..2 start first and must wait (retrying) for rank 0's store to appear.
        port = free_port()
        envs = [rank_env(r, 3, port) for r in (2, 1, 0)]
        results = self.run_ranks([hello(), "--timeout_s", 30], envs, stagger_s=0.5)
        self.assertPassed(results, 3)

    def test_tcp_init_method(self):
        port = free_port()
        argv = [hello(), "--init_method", f"tcp://127.0.0.1:{port}", "--timeout_s", 30]
        # No MASTER_ADDR/PORT at all: the address comes only from the URL.
        results = self.run_ranks(argv, [clean_env(RANK=r, WORLD_SIZE=3) for r in range(3)])
        self.assertPassed(results, 3)

    def test_file_init_method(self):
        with tempfile.TemporaryDirectory(prefix="dtrain-filestore-") as d:
            path = os.path.join(d, "store")
            argv = [hello(), "--init_method", f"file://{path}", "--timeout_s", 30]
            results = self.run_ranks(argv, [clean_env(RANK=r, WORLD_SIZE=2) for r in range(2)])
            self.assertPassed(results, 2)

    def test_file_init_method_three_ranks(self):
        path = os.path.join(tempfile.gettempdir(), f"dtrain-filestore-{os.getpid()}-{free_port()}")
        self.addCleanup(lambda: os.path.exists(path) and os.unlink(path))
        argv = [hello(), "--init_method", f"file://{path}", "--timeout_s", 30]
        results = self.run_ranks(argv, [clean_env(RANK=r, WORLD_SIZE=3) for r in range(3)])
        self.assertPassed(results, 3)

    def test_store_host_waits_at_most_min_of_timeout_and_10_s_at_destroy(self):
        # docs/api.md, destroy_process_group: "The rank hosting the store waits (at most min(timeout,
        # 10 s)) until every rank has checked out". Rank 1 is killed before it checks out; rank 0 (the
        # store's host) then destroys after --hold_s 1 and must wait that long, and no longer.
        for timeout_s, wait_s in ((2, 2), (60, 10)):
            port = free_port()
            procs = [self.spawn([hello(), "--timeout_s", timeout_s, "--hold_s", 1], rank_env(r, 2, port))
                     for r in range(2)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all("check passed" in p.output() for p in procs):
                time.sleep(0.01)
            checked = time.monotonic()
            procs[1].kill()
            res = procs[0].finish(60)
            self.assertEqual(res.rc, 0, str(res))
            waited = procs[0].start + res.seconds - checked - 1  # minus --hold_s
            self.assertGreater(waited, wait_s - 0.5, f"timeout {timeout_s} s: rank 0 left after {waited:.1f} s")
            self.assertLess(waited, wait_s + 5, f"timeout {timeout_s} s: rank 0 left after {waited:.1f} s")

    def test_collectives_test_without_launcher(self):
        # The GoogleTest collectives suite on 3 ranks started by hand (rank 0 hosts the store).
        program = binary("COLLECTIVES_TEST", "collectives_test")
        if not program:
            self.skipTest("collectives_test is not built")
        port = free_port()
        envs = [rank_env(r, 3, port, DTRAIN_TIMEOUT_S=60) for r in range(3)]
        results = self.run_ranks([program], envs, timeout=150)
        for res in results:
            self.assertEqual(res.rc, 0, str(res))
            self.assertIn("[  PASSED  ]", res.out, str(res))
            self.assertNotIn("[  FAILED  ]", res.out, str(res))


if __name__ == "__main__":
    unittest.main()
