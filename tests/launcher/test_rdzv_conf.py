"""dtrain-run: torchrun's --rdzv_conf close_timeout and read_timeout, and --local_addr, with their
torchrun meanings (Note [Store deadlines and closing] in tools/dtrain-run/rendezvous.h, Note
[Workers' store] in tools/dtrain-run/main.cpp).

Every "node" is a launcher on this machine's loopback: the store's host is stopped with SIGSTOP (the
kernel still accepts and holds its connections, so only deadlines can tell), and 127.0.0.2 stands in
for the address of another interface (Linux answers on all of 127/8).
"""
import os
import re
import signal
import time
import unittest

from launcher_common import (MarkedTestCase, PY, finish, free_port, pids_with_marker, port_open, run, start,
                             thread_states, wait_until, with_secret)

# A worker that reaches the store it was given and says where it is.
REACH = """import os, socket
s = socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=10)
print("rank=%s master=%s port=%s peer=%s" % (os.environ["RANK"], os.environ["MASTER_ADDR"],
                                             os.environ["MASTER_PORT"], s.getpeername()[0]), flush=True)
"""


def c10d_args(port, is_host, conf="", extra=()):
    return ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--nnodes", 2, "--nproc_per_node", 1,
            "--rdzv_conf", f"is_host={is_host},join_timeout=30,last_call_timeout=1{conf}", *extra]


class StoreDeadlinesTest(MarkedTestCase):
    tmp_prefix = "dtrain_rdzv_conf_"

    def stopped(self, proc):
        """SIGSTOPs proc and returns once every thread of it is stopped; it is killed (after a SIGCONT)
        when the test ends."""
        os.kill(proc.pid, signal.SIGSTOP)
        self.assertTrue(wait_until(lambda: thread_states(proc.pid) == {"T"}, 10),
                        f"launcher {proc.pid} did not stop: its threads are {thread_states(proc.pid)}")

        def release():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    if proc.returncode is None:  # not waited for: the pid is still proc's
                        os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass
            finish(proc, timeout=10)
        self.addCleanup(release)

    def test_close_timeout_bounds_how_long_node0_keeps_a_failed_job_open(self):
        # Node 0's worker fails; node 1's launcher is stopped and never says it is done. Node 0 closes the
        # rendezvous within close_timeout 2 s, not after --rdzv_timeout 30 s.
        port, go = free_port(), os.path.join(self.tmp, "go")
        args = ["--nnodes", 2, "--nproc_per_node", 1, "--master_addr", "127.0.0.1", "--master_port", port,
                "--rdzv_timeout", 30, "--rdzv_conf", "close_timeout=2", "--grace_period", 1]
        n0 = start(["--node_rank", 0, *args, "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; exit 5"],
                   env=with_secret())
        n1 = start(["--node_rank", 1, *args, PY, "-c", "import time; time.sleep(60)", self.marker], env=with_secret())
        self.assertTrue(wait_until(lambda: pids_with_marker(self.marker), 20), "node 1's worker did not start")
        self.stopped(n1)
        t0 = time.monotonic()
        open(go, "w").close()
        ((rc0, _, err0),) = finish(n0, timeout=40)
        took = time.monotonic() - t0
        self.assertEqual(rc0, 1, err0)
        self.assertRegex(err0.strip().splitlines()[-1], r"^dtrain-run: rank 0 \(local rank 0, pid \d+\) failed first")
        self.assertGreater(took, 1.5, err0)
        self.assertLess(took, 2 + 6, err0)

    def test_read_timeout_ends_a_join_to_a_stopped_host(self):
        # The host's launcher is stopped before the other node joins: its kernel accepts the connection,
        # nothing answers the handshake. The joining node fails after read_timeout 2 s, naming the host and
        # what it was doing, instead of waiting out join_timeout 30 s.
        port = free_port()
        host = start(c10d_args(port, 1) + [PY, "-c", "import time; time.sleep(60)", self.marker], env=with_secret())
        self.assertTrue(wait_until(lambda: port_open(port), 20), "the host's store did not come up")
        self.stopped(host)
        self.ends_after_read_timeout(start(c10d_args(port, 0, ",read_timeout=2") + ["true"], env=with_secret()),
                                     port, "connecting to it", host)

    def test_read_timeout_ends_the_wait_for_node0s_decision(self):
        # Node 1's worker is done and its launcher waits for node 0's decision on the attempt (the next
        # round's rendezvous) when node 0's launcher stops: node 1 ends after read_timeout 2 s.
        port, done = free_port(), os.path.join(self.tmp, "done")
        host = start(c10d_args(port, 1) + [PY, "-c", "import time; time.sleep(60)", self.marker], env=with_secret())
        other = start(c10d_args(port, 0, ",read_timeout=2") + ["sh", "-c", f"touch {done}"], env=with_secret())
        self.assertTrue(wait_until(lambda: os.path.exists(done), 20), "node 1's worker did not run")
        time.sleep(1)  # node 1 reaps it and asks for the decision
        self.stopped(host)
        self.ends_after_read_timeout(other, port, "waiting for node 0's decision after attempt 0", host)

    def ends_after_read_timeout(self, node, port, doing, host):
        """`node` (read_timeout=2) ends within a few seconds with one last line naming the stopped host,
        which stayed stopped all along."""
        t0 = time.monotonic()
        ((rc, _, err),) = finish(node, timeout=40)
        took = time.monotonic() - t0
        # Something outside the test that continued the host would make the node's line name a later
        # step than the one where the host stopped answering.
        self.assertEqual(thread_states(host.pid), {"T"}, f"the stopped host {host.pid} was continued:\n{err}")
        self.assertEqual(rc, 1, err)
        self.assertLess(took, 2 + 8, err)  # and a heartbeat thread's own request (5 s) to end
        self.assertEqual(err.strip().splitlines()[-1],
                         f"dtrain-run: node 0's launcher (the rendezvous host at 127.0.0.1:{port}) did not answer "
                         f"within read_timeout 2s while this node was {doing}: it is stopped or gone "
                         "(--rdzv_conf read_timeout=SECONDS sets how long a store request may take)", err)


class LocalAddrTest(MarkedTestCase):
    tmp_prefix = "dtrain_local_addr_"

    def test_node0s_local_addr_is_every_workers_master_addr(self):
        # torchrun's RendezvousStoreInfo: the rank-0 node publishes --local_addr, and a store there, as
        # every worker's MASTER_ADDR and MASTER_PORT. The endpoint is 127.0.0.1; node 0 says 127.0.0.2.
        port = free_port()
        host = start(c10d_args(port, 1, extra=["--local_addr", "127.0.0.2"]) + [PY, "-c", REACH], env=with_secret())
        other = start(c10d_args(port, 0, extra=["--local_addr", "127.0.0.3"]) + [PY, "-c", REACH], env=with_secret())
        lines = []
        for rc, out, err in finish(host, other):
            self.assertEqual(rc, 0, err)
            self.assertIn("elastic job formed by node 0 (127.0.0.2), node 1 (127.0.0.3); world size 2", err)
            lines += [l for l in out.splitlines() if l.startswith("[rank")]
        found = sorted(re.sub(r" port=(\d+)", lambda m: " port=" + ("endpoint" if m[1] == str(port) else "P"), l)
                       for l in lines)
        self.assertEqual(found, ["[rank 0] rank=0 master=127.0.0.2 port=P peer=127.0.0.2",
                                 "[rank 1] rank=1 master=127.0.0.2 port=P peer=127.0.0.2"])

    def test_local_addr_on_one_node_of_the_c10d_form(self):
        # TorchX's dist.ddp -j 1x2 with --local_addr: torchrun's workers get it as MASTER_ADDR there too.
        r = run(["--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", "--nnodes", 1, "--nproc_per_node", 2,
                 "--local_addr", "127.0.0.2", PY, "-c", REACH], env=with_secret())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(re.sub(r" port=\d+", "", l) for l in r.stdout.splitlines()),
                         ["[rank 0] rank=0 master=127.0.0.2 peer=127.0.0.2",
                          "[rank 1] rank=1 master=127.0.0.2 peer=127.0.0.2"])

    def test_a_local_addr_node0_cannot_serve_is_one_line(self):
        port = free_port()
        ((rc, _, err),) = finish(start(c10d_args(port, 1, extra=["--local_addr", "192.0.2.1"]) + ["true"],
                                       env=with_secret()), timeout=30)
        self.assertEqual(rc, 1, err)
        lines = err.strip().splitlines()
        self.assertEqual(len(lines), 1, err)
        self.assertRegex(lines[0], r"^dtrain-run: --local_addr 192\.0\.2\.1: node 0 serves the workers' store at its "
                                   r"--local_addr, and cannot: .* \(give an address of this machine, or leave "
                                   r"--local_addr out\)$")


if __name__ == "__main__":
    unittest.main()
