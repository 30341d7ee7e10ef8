"""Bad input fails fast with ONE line `hello_distributed: error: <message>` naming the value and the
remedy, and never hangs: environment mistakes, backends, init methods, an unreachable master, a busy
port, ranks that disagree on the world size, and two processes claiming the same rank."""
import os
import socket
import time
import unittest

from harness import DistTestCase, binary, clean_env, free_port, hello, rank_env

FAST_S = 10  # "within a few seconds": generous for a loaded 2-core machine, far below any default


def clients_of(port):
    """Established TCP connections from a client to `port` on this host (/proc/net/tcp's 01 state)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


class SingleProcess(DistTestCase):
    def fails(self, env, *needles, args=()):
        res = self.run_one([hello(), "--timeout_s", 5, *args], env, timeout=30)
        line = self.assertOneLineError(res, *needles)
        self.assertLess(res.seconds, FAST_S, str(res))
        return line

    def env(self, **kw):
        base = dict(RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
        base.update(kw)
        return clean_env(**base)

    def test_rank_missing(self):
        self.fails(self.env(RANK=None, WORLD_SIZE=2), "RANK is not set", "WORLD_SIZE=2", "dtrain-run")

    def test_rank_not_a_number(self):
        self.fails(self.env(RANK="abc", WORLD_SIZE=2), "RANK='abc'", "not a non-negative integer",
                   "set RANK and WORLD_SIZE")

    def test_world_size_negative(self):
        self.fails(self.env(WORLD_SIZE="-1"), "WORLD_SIZE='-1'", "not a non-negative integer",
                   "set RANK and WORLD_SIZE")

    def test_master_addr_missing(self):
        self.fails(self.env(MASTER_ADDR=None), "MASTER_ADDR is not set", "127.0.0.1")

    def test_master_addr_wildcard(self):
        # The store would listen on every network the machine is on: refused, naming the value.
        for addr in ("0.0.0.0", "::"):
            self.fails(self.env(MASTER_ADDR=addr), f"MASTER_ADDR {addr} is the wildcard address", "127.0.0.1")

    def test_master_port_out_of_range(self):
        self.fails(self.env(MASTER_PORT="99999"), "MASTER_PORT='99999'", "1 to 65535")

    def test_master_port_not_a_number(self):
        self.fails(self.env(MASTER_PORT="abc"), "MASTER_PORT='abc'", "1 to 65535")

    def test_rank_out_of_range(self):
        self.fails(self.env(RANK=2, WORLD_SIZE=2), "RANK=2", "WORLD_SIZE=2", "from 0 to 1")

    def test_unknown_backend(self):
        self.fails(self.env(), "'mpi2'", "gloo", args=("--backend", "mpi2"))

    def test_nccl_without_cuda(self):
        # A CPU-only LibTorch has no NCCL; a CUDA one on this GPU-less machine has no device for it.
        if os.environ.get("DTRAIN_WITH_CUDA") == "ON":
            self.fails(self.env(), "'nccl'", "CUDA device", "gloo", args=("--backend", "nccl"))
        else:
            self.fails(self.env(), "'nccl'", "CPU-only", "gloo", args=("--backend", "nccl"))

    def test_unknown_init_method(self):
        self.fails(self.env(), "'udp://x'", "env://", "tcp://", "file://", args=("--init_method", "udp://x"))

    def test_tcp_init_method_without_port(self):
        self.fails(self.env(), "tcp://127.0.0.1", "no port", args=("--init_method", "tcp://127.0.0.1"))

    def test_unreachable_master(self):
        port = free_port()  # nothing listens there
        res = self.run_one([hello(), "--timeout_s", 2], self.env(RANK=1, WORLD_SIZE=2, MASTER_PORT=port),
                           timeout=30)
        self.assertOneLineError(res, f"127.0.0.1:{port}", "2")
        self.assertRegex(res.err, r"within 2(\.0)? ?s", str(res))
        self.assertLess(res.seconds, FAST_S, str(res))

    def test_master_port_in_use(self):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            line = self.fails(self.env(RANK=0, WORLD_SIZE=2, MASTER_PORT=port), str(port), "in use")
        self.assertIn("127.0.0.1", line)


class ManyProcesses(DistTestCase):
    def test_ranks_disagree_on_world_size(self):
        port = free_port()
        envs = [rank_env(0, 2, port), rank_env(1, 3, port)]
        results = self.run_ranks([hello(), "--timeout_s", 20], envs, timeout=30)
        for res in results:
            self.assertOneLineError(res, "disagree on the world size", "WORLD_SIZE=2", "WORLD_SIZE=3",
                                    "same WORLD_SIZE")
            # Fast: detected at the rendezvous, long before the 20 s timeout.
            self.assertLess(res.seconds, FAST_S, str(res))

    def test_two_processes_claim_the_same_rank(self):
        port = free_port()
        envs = [rank_env(0, 3, port), rank_env(1, 3, port), rank_env(1, 3, port)]
        results = self.run_ranks([hello(), "--timeout_s", 3], envs, timeout=40, stagger_s=0.3)
        lines = [self.assertOneLineError(res) for res in results]
        for res in results:
            self.assertLess(res.seconds, 3 + 5 + FAST_S, str(res))
        dup = [l for l in lines if "another process already joined as rank 1" in l]
        self.assertEqual(len(dup), 1, "\n".join(map(str, results)))
        self.assertIn("distinct RANK", dup[0])
        # Rank 0 and the first rank 1 time out, naming rank 2 as the one that never joined.
        for line in lines:
            if line not in dup:
                self.assertIn("rank(s) 2 did not join within 3 s", line, "\n".join(map(str, results)))



    def test_store_host_exits_before_the_verdict(self):
        # Rank 0 hosts the store and waits for rank 2, which never comes; rank 0 is killed while rank 1
        # waits for the verdict. Rank 1 must say at once that the store's host exited, not claim a
        # timeout of its 20 s.
        port = free_port()
        rank0 = self.spawn([hello(), "--timeout_s", 20], rank_env(0, 3, port))
        rank1 = self.spawn([hello(), "--timeout_s", 20], rank_env(1, 3, port))
        # Rank 1 has joined once two clients (rank 0's own and rank 1's) hold connections to the port.
        deadline = time.monotonic() + 20
        while clients_of(port) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertGreaterEqual(clients_of(port), 2, "rank 1 never connected to rank 0's store")
        time.sleep(0.5)  # from its connection to its wait for the verdict: a few store calls
        rank0.kill()
        res = rank1.finish(30)
        line = self.assertOneLineError(res, "rank 1:", "rendezvous store failed", "has exited")
        self.assertNotIn("within", line, str(res))
        self.assertLess(res.seconds, FAST_S, str(res))



class ExampleFlags(DistTestCase):
    # Each small example's positive flag, given 0: one readable error before any process group starts
    # (CLI11's own check printed DBL_MAX in full, 310 digits).
    FLAGS = [("ddp_train", "--batch_size"), ("ddp_amp_train", "--accumulate"), ("data_parallel", "--steps"),
             ("model_parallel", "--steps"), ("pipeline_train", "--steps")]

    def test_zero_for_a_positive_flag_is_one_readable_error(self):
        for name, flag in self.FLAGS:
            with self.subTest(example=name):
                path = binary(f"EXAMPLE_{name.upper()}", name)
                self.assertIsNotNone(path, f"{name} was not built")
                res = self.run_one([path, flag, "0"], clean_env(), timeout=30)
                self.assertNotEqual(res.rc, 0, str(res))
                self.assertIn(f"{flag}: must be a positive number, got '0'", res.err, str(res))
                self.assertNotRegex(res.out + res.err, r"\d{20}", f"a bound printed in full:\n{res}")

if __name__ == "__main__":
    unittest.main()
