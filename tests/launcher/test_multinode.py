"""dtrain-run: several launchers (nodes) on one machine, and across two network namespaces."""
import os
import shutil
import signal
import subprocess
import time
import unittest

from launcher_common import (MarkedTestCase, DTRAIN_RUN, PY, clean_env, finish, free_port, pids_with_marker,
                             require_launcher, start, wait_until, with_secret)

PRINT_ENV = 'echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE node=$NODE_RANK group=$GROUP_RANK"'


def node_args(port, node_rank, nproc=2, nnodes=2, addr="127.0.0.1", extra=()):
    return ["--nnodes", nnodes, "--node_rank", node_rank, "--nproc_per_node", nproc,
            "--master_addr", addr, "--master_port", port, "--rdzv_timeout", "20", "--monitor_interval", "0.1",
            *extra]


class MultiNodeTest(MarkedTestCase):
    tmp_prefix = "dtrain_mn_"

    def test_two_nodes(self):
        port = free_port()
        n1 = start(node_args(port, 1) + ["sh", "-c", PRINT_ENV])  # node 1 first: it waits for node 0
        time.sleep(0.3)
        n0 = start(node_args(port, 0) + ["sh", "-c", PRINT_ENV])
        (rc0, out0, err0), (rc1, out1, err1) = finish(n0, n1)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertEqual(sorted(out0.splitlines()), [
            "[rank 0] rank=0 local=0 world=4 node=0 group=0",
            "[rank 1] rank=1 local=1 world=4 node=0 group=0"])
        self.assertEqual(sorted(out1.splitlines()), [
            "[rank 2] rank=2 local=0 world=4 node=1 group=1",
            "[rank 3] rank=3 local=1 world=4 node=1 group=1"])

    def test_nodes_disagree_on_nproc(self):
        port = free_port()
        n0 = start(node_args(port, 0, nproc=2) + ["true"])
        n1 = start(node_args(port, 1, nproc=3) + ["true"])
        (rc0, _, err0), (rc1, _, err1) = finish(n0, n1)
        self.assertNotEqual(rc0, 0)
        self.assertNotEqual(rc1, 0)
        for err in (err0, err1):
            line = err.strip().splitlines()[-1]
            self.assertIn("nodes disagree on the world size", line)
            self.assertIn("node 0 has --nnodes 2 --nproc_per_node 2 (world 4)", line)
            self.assertIn("--nnodes 2 --nproc_per_node 3 (world 6)", line)

    def test_duplicate_node_rank(self):
        port = free_port()
        n0 = start(node_args(port, 0, nnodes=3) + ["true"])
        n1 = start(node_args(port, 1, nnodes=3) + ["true"])
        n1b = start(node_args(port, 1, nnodes=3) + ["true"])
        results = finish(n0, n1, n1b)
        for rc, _, err in results:
            self.assertNotEqual(rc, 0)
            self.assertIn("two nodes have --node_rank 1", err)

    def test_no_node_zero(self):
        port = free_port()
        t0 = time.monotonic()
        p = start(["--nnodes", 2, "--node_rank", 1, "--nproc_per_node", 1, "--master_port", port,
                   "--rdzv_timeout", 2, "true"], env=with_secret())
        ((rc, out, err),) = finish(p, timeout=20)
        took = time.monotonic() - t0
        self.assertEqual(rc, 1)
        self.assertGreaterEqual(took, 1.9)
        self.assertLess(took, 10)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn(f"127.0.0.1:{port}", err)
        self.assertIn("within 2s", err)

    def test_node_zero_times_out_waiting(self):
        port = free_port()
        p = start(["--nnodes", 2, "--node_rank", 0, "--nproc_per_node", 1, "--master_port", port,
                   "--rdzv_timeout", 1, "true"])
        ((rc, _, err),) = finish(p, timeout=20)
        self.assertEqual(rc, 1)
        self.assertIn("only 1 of 2 nodes joined", err)
        self.assertIn("missing node_rank 1", err)

    def test_node_zero_says_what_it_waits_for(self):
        # Node 1 never comes: node 0 says at once what it waits for, then names the missing node rank
        # every report period (30 s; DTRAIN_RUN_RDZV_REPORT_S shortens it for this test) instead of
        # staying silent for the whole --rdzv_timeout.
        port = free_port()
        t0 = time.monotonic()
        p = start(["--nnodes", 2, "--node_rank", 0, "--nproc_per_node", 1, "--master_port", port,
                   "--rdzv_timeout", 30, "true"], env=with_secret(DTRAIN_RUN_RDZV_REPORT_S=0.5))
        try:
            first = p.stderr.readline().rstrip("\n")
            second = p.stderr.readline().rstrip("\n")
            took = time.monotonic() - t0
        finally:
            p.kill()
            p.communicate()
        self.assertEqual(first, f"dtrain-run: node 0 waiting for 1 more node(s) of --nnodes 2 at 127.0.0.1:{port} "
                                "(--rdzv_timeout 30s)")
        self.assertRegex(second, r"^dtrain-run: node 0 still waiting for node_rank 1 of --nnodes 2 after [0-9.]+s "
                                 r"\(--rdzv_timeout 30s\): is dtrain-run running there with --master_addr 127\.0\.0\.1 "
                                 f"--master_port {port}\\?$")
        self.assertLess(took, 10, "the lines came only at the end of the wait")

    def test_a_timeout_too_long_to_count_means_forever(self):
        # 1e300 s and inf wait forever (capped at 10^9 s): converted to milliseconds as they are, they
        # overflowed, and node 0 gave up at once.
        for timeout in ("1e300", "inf"):
            port = free_port()
            p = start(["--nnodes", 2, "--node_rank", 0, "--nproc_per_node", 1, "--master_port", port,
                       "--rdzv_timeout", timeout, "--grace_period", "inf", "true"],
                      env=with_secret(DTRAIN_RUN_RDZV_REPORT_S=0.3))
            try:
                first = p.stderr.readline().rstrip("\n")
                second = p.stderr.readline().rstrip("\n")
                still_running = p.poll() is None
            finally:
                p.kill()
                p.communicate()
            self.assertEqual(first, f"dtrain-run: node 0 waiting for 1 more node(s) of --nnodes 2 at 127.0.0.1:{port} "
                                    "(--rdzv_timeout inf (forever))", timeout)
            self.assertIn("still waiting for node_rank 1", second, timeout)
            self.assertTrue(still_running, f"--rdzv_timeout {timeout}: node 0 stopped waiting")

    def test_failure_on_node1_stops_node0(self):
        port = free_port()
        sleeper = [PY, "-c", "import time; time.sleep(60)", self.marker]
        failer = ["sh", "-c", 'if [ "$RANK" = 3 ]; then sleep 0.5; exit 3; fi; sleep 60']
        t0 = time.monotonic()
        n0 = start(node_args(port, 0, extra=["--grace_period", "1"]) + sleeper)
        n1 = start(node_args(port, 1, extra=["--grace_period", "1"]) + failer)
        (rc0, _, err0), (rc1, _, err1) = finish(n0, n1)
        self.assertLess(time.monotonic() - t0, 20)
        self.assertEqual(rc1, 1, err1)
        self.assertIn("rank 3 (local rank 1", err1.strip().splitlines()[-1])
        self.assertEqual(rc0, 1, err0)
        last0 = err0.strip().splitlines()[-1]
        self.assertIn("node 1", last0)
        self.assertIn("rank 3", last0)
        self.assertIn("exited with code 3", last0)
        self.assertEqual(pids_with_marker(self.marker), [])

    def two_nodes_with_restarts(self, max_restarts, script):
        """Two launchers, one worker each, running `sh -c script`; returns [(rc, out, err)] per node."""
        extra = ["--max_restarts", str(max_restarts), "--grace_period", "1"]
        port = free_port()
        return finish(*[start(node_args(port, n, nproc=1, extra=extra) + ["sh", "-c", script]) for n in (0, 1)])

    def test_restart_on_two_nodes(self):
        # Attempt 0: rank 1 (node 1) fails while rank 0 (node 0) runs; node 0 stops, both nodes agree
        # and restart together; attempt 1 succeeds everywhere. Rank 1 fails only once rank 0 has written
        # its line (a fixed sleep raced under load: node 0 could be stopped before its shell wrote).
        seen = os.path.join(self.tmp, "seen")
        script = (f'echo "$RANK $DTRAIN_RESTART_COUNT" >> {seen}; '
                  f'if [ "$DTRAIN_RESTART_COUNT" = 0 ]; then '
                  f'if [ "$RANK" = 1 ]; then while ! grep -q "^0 0$" {seen}; do sleep 0.01; done; exit 5; fi; '
                  f'exec {PY} -c "import time; time.sleep(60)" {self.marker}; fi')
        (rc0, _, err0), (rc1, _, err1) = self.two_nodes_with_restarts(2, script)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        for err in (err0, err1):
            self.assertEqual(err.count("restarting all workers (restart 1 of 2)"), 1, err)
        self.assertIn("node 1", err0)
        with open(seen) as f:
            self.assertEqual(sorted(f.read().splitlines()), ["0 0", "0 1", "1 0", "1 1"])
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_two_nodes_give_up_after_max_restarts(self):
        script = 'if [ "$RANK" = 1 ]; then exit $((20 + DTRAIN_RESTART_COUNT)); fi; sleep 60'
        (rc0, _, err0), (rc1, _, err1) = self.two_nodes_with_restarts(1, script)
        self.assertEqual((rc0, rc1), (1, 1), err0 + err1)
        for err in (err0, err1):
            self.assertEqual(err.count("restarting all workers"), 1, err)
            last = err.strip().splitlines()[-1]
            self.assertIn("exited with code 21", last)
            self.assertIn("(the last failure, after 1 restart(s) of --max_restarts 1)", last)

    def test_a_node_that_never_reports_ends_the_job_after_rdzv_timeout(self):
        # docs/fault_tolerance.md: "a launcher that never reports ends the job after --rdzv_timeout". Node 1's launcher
        # is stopped (SIGSTOP) once its worker runs; then node 0's worker fails, and node 0 waits for
        # node 1's outcome of the attempt: it must give up after --rdzv_timeout 3, without a restart.
        port = free_port()
        go = os.path.join(self.tmp, "go")
        extra = ["--max_restarts", "1", "--grace_period", "1"]

        def args(n):
            return ["--nnodes", 2, "--node_rank", n, "--nproc_per_node", 1, "--master_addr", "127.0.0.1",
                    "--master_port", port, "--rdzv_timeout", 3, "--monitor_interval", "0.1", *extra]

        n0 = start(args(0) + ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; exit 5"])
        n1 = start(args(1) + [PY, "-c", "import time; time.sleep(60)", self.marker])
        try:
            self.assertTrue(wait_until(lambda: pids_with_marker(self.marker), 20), "node 1's worker did not start")
            os.kill(n1.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            open(go, "w").close()
            (rc0, _, err0), = finish(n0, timeout=30)
            took = time.monotonic() - t0
        finally:
            os.kill(n1.pid, signal.SIGKILL)
            finish(n1)
        self.assertEqual(rc0, 1, err0)
        self.assertNotIn("restarting all workers", err0)
        self.assertIn("node_rank 1 did not report the end of attempt 0 within --rdzv_timeout 3s", err0)
        # 3 s for the outcome, then up to 3 s more keeping the store up for node 1 (it never comes).
        self.assertGreater(took, 3, err0)
        self.assertLess(took, 3 + 3 + 5, err0)

    def test_a_stopped_node_zero_ends_a_fixed_node_job_in_one_line(self):
        # SIGSTOP: node 0's launcher, and the store in it, stop answering, though the kernel keeps the
        # connection (no FIN, no reset). Node 1 polls the store with a deadline of 3 s while its
        # workers run and ends them, instead of waiting --rdzv_timeout (20 s here).
        port = free_port()
        extra = ["--grace_period", "1"]

        def args(n):
            return node_args(port, n, nproc=1, extra=extra)

        n0 = start(args(0) + [PY, "-c", "import time; time.sleep(60)", self.marker + "-n0"])
        n1 = start(args(1) + [PY, "-c", "import time; time.sleep(60)", self.marker])
        try:
            self.assertTrue(wait_until(lambda: pids_with_marker(self.marker), 20), "node 1's worker did not start")
            time.sleep(0.3)  # node 1 polls the store at least once
            os.kill(n0.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            (rc1, _, err1), = finish(n1, timeout=30)
            took = time.monotonic() - t0
        finally:
            os.kill(n0.pid, signal.SIGKILL)
            finish(n0)
        self.assertEqual(rc1, 1, err1)
        self.assertLess(took, 3 + 1 + 4, err1)
        self.assertRegex(err1.strip().splitlines()[-1],
                         r"^dtrain-run: stopping this node's workers: node 0's launcher \(the rendezvous host at "
                         r"127\.0\.0\.1:\d+\) did not answer within 3s: it is stopped or gone, so the job ends$")
        self.assertEqual(pids_with_marker(self.marker), [])

    def test_nodes_disagree_on_max_restarts(self):
        port = free_port()
        n0 = start(node_args(port, 0, nproc=1, extra=["--max_restarts", "1"]) + ["true"])
        n1 = start(node_args(port, 1, nproc=1, extra=["--max_restarts", "2"]) + ["true"])
        for rc, _, err in finish(n0, n1):
            self.assertEqual(rc, 1, err)
            self.assertIn("nodes disagree on --max_restarts: node 0 has 1, node 1 (", err)
            self.assertIn("give every node the same --max_restarts", err)

    def test_nodes_disagree_on_ft(self):
        port = free_port()
        n0 = start(node_args(port, 0, nproc=2, extra=["--ft", "--ft_replica_ranks", "2"]) + ["true"])
        n1 = start(node_args(port, 1, nproc=2, extra=["--ft"]) + ["true"])
        for rc, _, err in finish(n0, n1):
            self.assertEqual(rc, 1, err)
            self.assertIn("nodes disagree on --ft: node 0 has --ft --ft_replica_ranks 2, node 1 (", err)
            self.assertIn(") has --ft --ft_replica_ranks 1; give every node the same --ft and --ft_replica_ranks", err)

    def test_store_listens_on_master_addr_only(self):
        from launcher_common import listeners
        port = free_port()
        n0 = start(node_args(port, 0) + ["sleep", "1"])
        try:
            self.assertTrue(wait_until(lambda: listeners(port) != [], 5))
            self.assertEqual(listeners(port), ["0100007F"])
        finally:
            n1 = start(node_args(port, 1) + ["true"])
            finish(n0, n1)


class NetnsTest(unittest.TestCase):
    """Node 0 and node 1 in two network namespaces joined by a veth pair: the master address
    exists only inside namespace A, so this is a real two-host rendezvous over a link."""

    def ip(self, *args, check=True):
        return subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=10, check=check)

    def setUp(self):
        require_launcher(self)
        if os.geteuid() != 0 or not shutil.which("ip"):
            self.skipTest("needs root and iproute2 to create network namespaces")
        pid = os.getpid()
        self.ns = [f"dtrA{pid}", f"dtrB{pid}"]
        self.veth = [f"dtva{pid}"[:15], f"dtvb{pid}"[:15]]
        sub = pid % 250 + 1
        self.addr = [f"10.231.{sub}.1", f"10.231.{sub}.2"]
        self.created = []
        try:
            for ns in self.ns:
                self.ip("netns", "add", ns)
                self.created.append(ns)
            self.ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for i in (0, 1):
                self.ip("link", "set", self.veth[i], "netns", self.ns[i])
                self.ip("-n", self.ns[i], "addr", "add", self.addr[i] + "/24", "dev", self.veth[i])
                self.ip("-n", self.ns[i], "link", "set", self.veth[i], "up")
                self.ip("-n", self.ns[i], "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            self.cleanup()
            err = getattr(e, "stderr", "") or str(e)
            self.skipTest(f"cannot create network namespaces here: {err.strip()}")

    def tearDown(self):
        self.cleanup()

    def cleanup(self):
        for ns in getattr(self, "created", []):
            self.ip("netns", "del", ns, check=False)  # deletes the veth pair with it
        self.created = []

    def test_two_namespaces(self):
        port = 29611
        def launch(i):
            return subprocess.Popen(
                ["ip", "netns", "exec", self.ns[i], DTRAIN_RUN] +
                [str(a) for a in node_args(port, i, addr=self.addr[0])] + ["sh", "-c", PRINT_ENV + '; echo "addr=$MASTER_ADDR"'],
                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        n0 = launch(0)
        n1 = launch(1)
        (rc0, out0, err0), (rc1, out1, err1) = finish(n0, n1)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertIn("[rank 1] rank=1 local=1 world=4 node=0 group=0", out0)
        self.assertIn("[rank 3] rank=3 local=1 world=4 node=1 group=1", out1)
        self.assertIn(f"addr={self.addr[0]}", out1)

    def test_node_zero_vanishing_without_a_fin_ends_node_one(self):
        # Node 0's link goes down while the workers run: no FIN and no reset reach node 1, whose
        # requests to the store then meet their 3 s deadline (TCP would retransmit for minutes).
        port = 29612
        extra = ["--grace_period", "1"]
        def launch(i):
            return subprocess.Popen(
                ["ip", "netns", "exec", self.ns[i], DTRAIN_RUN] +
                [str(a) for a in node_args(port, i, nproc=1, addr=self.addr[0], extra=extra)] +
                ["sh", "-c", "echo started; exec sleep 60"],
                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        n0, n1 = launch(0), launch(1)
        try:
            self.assertEqual(n1.stdout.readline().strip(), "[rank 1] started")
            time.sleep(0.3)
            self.ip("-n", self.ns[0], "link", "set", self.veth[0], "down")
            t0 = time.monotonic()
            (rc1, _, err1), = finish(n1, timeout=30)
            took = time.monotonic() - t0
        finally:
            n0.kill()
            finish(n0)
        self.assertEqual(rc1, 1, err1)
        self.assertLess(took, 3 + 1 + 4, err1)
        self.assertRegex(err1.strip().splitlines()[-1],
                         r"^dtrain-run: stopping this node's workers: node 0's launcher \(the rendezvous host at "
                         r"10\.231\.\d+\.1:29612\) did not answer within 3s: it is stopped or gone, so the job ends$")


if __name__ == "__main__":
    unittest.main()
