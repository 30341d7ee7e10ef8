"""hello_distributed under the dtrain-run launcher: one node, two nodes on 127.0.0.1, two nodes in
two network namespaces joined by a veth pair (root only), and --use_local_rank_arg."""
import os
import shutil
import subprocess
import unittest

from harness import DistTestCase, clean_env, free_port, hello, launcher


def passed_lines(out, world):
    return [l for l in out.splitlines() if f"all_reduce check passed: sum of (rank+1) over {world} ranks" in l]


class SingleNode(DistTestCase):
    def test_standalone_two_workers(self):
        res = self.run_one([launcher(), "--standalone", "--nproc_per_node", 2, "--grace_period", 2,
                            hello(), "--timeout_s", 30], clean_env(), timeout=90)
        self.assertEqual(res.rc, 0, str(res))
        lines = passed_lines(res.out, 2)
        self.assertEqual(len(lines), 2, str(res))
        for r in range(2):
            self.assertTrue(any(l.startswith(f"[rank {r}]") for l in lines), str(res))
            self.assertIn(f"[rank {r}] Rank: {r}, World Size: 2, Local Rank: {r}/2", res.out, str(res))

    def test_use_local_rank_arg(self):
        res = self.run_one([launcher(), "--standalone", "--nproc_per_node", 2, "--use_local_rank_arg",
                            "--grace_period", 2, hello(), "--timeout_s", 30], clean_env(), timeout=90)
        self.assertEqual(res.rc, 0, str(res))
        self.assertEqual(len(passed_lines(res.out, 2)), 2, str(res))

    def test_failing_worker_fails_the_launch(self):
        # The error line of a worker reaches the user, and the launcher's exit code is non-zero.
        res = self.run_one([launcher(), "--standalone", "--nproc_per_node", 2, "--grace_period", 2,
                            hello(), "--backend", "mpi2"], clean_env(), timeout=60)
        self.assertNotEqual(res.rc, 0, str(res))
        self.assertIn("hello_distributed: error: unknown backend 'mpi2'", res.out + res.err, str(res))


class TwoNodes(DistTestCase):
    def run_nodes(self, prefixes, master_addr, port):
        procs = []
        for node, prefix in enumerate(prefixes):
            argv = prefix + [launcher(), "--nnodes", 2, "--nproc_per_node", 2, "--node_rank", node,
                             "--master_addr", master_addr, "--master_port", port, "--rdzv_timeout", 60,
                             "--grace_period", 2, hello(), "--timeout_s", 60]
            procs.append(self.spawn(argv, clean_env()))
        results = [p.finish(120) for p in procs]
        for node, res in enumerate(results):
            self.assertEqual(res.rc, 0, f"node {node}:\n{res}")
            lines = passed_lines(res.out, 4)
            self.assertEqual(len(lines), 2, f"node {node}:\n{res}")
            for r in (2 * node, 2 * node + 1):
                self.assertTrue(any(l.startswith(f"[rank {r}]") for l in lines), f"node {node}:\n{res}")
        return results

    def test_two_nodes_on_loopback(self):
        self.run_nodes([[], []], "127.0.0.1", free_port())

    def test_two_nodes_in_network_namespaces(self):
        ip = shutil.which("ip")
        if os.geteuid() != 0 or not ip:
            self.skipTest("needs root and iproute2 (ip netns) for network namespaces")
        tag = f"{os.getpid() % 100000}"
        ns = [f"dtrain-a{tag}", f"dtrain-b{tag}"]
        veth = [f"dtva{tag}", f"dtvb{tag}"]
        net = f"10.231.{os.getpid() % 200}"
        addrs = [f"{net}.1", f"{net}.2"]

        def sh(*argv):
            return subprocess.run([ip, *argv], capture_output=True, text=True, timeout=10)

        made = sh("netns", "add", ns[0])
        if made.returncode != 0:
            self.skipTest(f"'ip netns add' does not work here: {made.stderr.strip()}")
        self.addCleanup(sh, "netns", "del", ns[0])
        self.assertEqual(sh("netns", "add", ns[1]).returncode, 0)
        self.addCleanup(sh, "netns", "del", ns[1])
        setup = [("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])]
        for i in range(2):
            setup += [("link", "set", veth[i], "netns", ns[i]),
                      ("-n", ns[i], "addr", "add", f"{addrs[i]}/24", "dev", veth[i]),
                      ("-n", ns[i], "link", "set", veth[i], "up"),
                      ("-n", ns[i], "link", "set", "lo", "up")]
        for step in setup:
            res = sh(*step)
            if res.returncode != 0:
                self.skipTest(f"'ip {' '.join(step)}' failed: {res.stderr.strip()}")
        # The veth moves into the namespaces, and deleting a namespace deletes its end (and the pair).
        results = self.run_nodes([[ip, "netns", "exec", n] for n in ns], addrs[0], 29500)
        self.assertTrue(results)


if __name__ == "__main__":
    unittest.main()
