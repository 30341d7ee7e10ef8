"""The main job started as TorchX starts it on Kubernetes: dist.ddp's exact torchrun command with
dtrain-run in torchrun's place, in two network namespaces standing in for pods, the rank-0 pod's DNS
name resolvable only two seconds after both started (tests/common/cluster_pods.py). The ranks train a
small subset to rank 0's RESULT line, every rank with rank 0's parameters."""
import os
import subprocess
import tempfile
import time
import unittest

from harness import clean_env, launcher, trainer
from test_train_fashion_mnist import RESULT_RE

from cluster_pods import PodNames, launch_pod, torchx_command
from netns_hosts import Hosts, netns_unavailable
from proc_util import kill_session

ARGS = ("--subset", 384, "--test_subset", 200, "--batch_size", 32, "--seed", 5, "--threads", 1, "--epochs", 1)


class TorchxPods(unittest.TestCase):
    def test_main_job_from_torchx_command_with_a_late_rank0_name(self):
        why = netns_unavailable()
        if why:
            self.skipTest(why)
        hosts = Hosts(2)
        self.addCleanup(hosts.close)
        tmp = self.enterContext(tempfile.TemporaryDirectory(prefix="dtrain_torchx_"))
        name = f"fm{os.getpid()}-trainer-0.fm{os.getpid()}.default.svc.cluster.local"
        names = PodNames(tmp, 2)
        command = torchx_command(launcher(), trainer(), f"fm{os.getpid()}", 2, 1, *ARGS)
        # DTRAIN_SHM=0: the pods' ranks meet over the link, as pods on two machines do.
        env = clean_env(TORCHX_RANK0_HOST=name, TMPDIR=tmp, DTRAIN_SHM=0, DTRAIN_TIMEOUT_S=60)
        pods = [launch_pod(hosts.ns[i], names.argv(i, command), env) for i in range(2)]
        time.sleep(2)
        names.publish(hosts.addr[0], name)
        results = []
        for p in pods:
            try:
                out, err = p.communicate(timeout=150)
            except subprocess.TimeoutExpired:
                kill_session(p)
                out, err = p.communicate()
            results.append((p.returncode, out, err))
        for rc, _, err in results:
            self.assertEqual(rc, 0, err[-3000:])
            self.assertEqual(sum("waiting for the rendezvous host name" in l for l in err.splitlines()), 1, err)
        found = [m for m in (RESULT_RE.match(l.strip()) for l in results[0][1].splitlines()) if m]
        self.assertEqual(len(found), 1, results[0][1][-3000:])
        self.assertEqual(found[0].group(5), "1", "the ranks ended with different parameters")
        self.assertFalse(any(RESULT_RE.match(l.strip()) for l in results[1][1].splitlines()))


if __name__ == "__main__":
    unittest.main()
