"""The main job in two network namespaces standing in for pods, the rank-0 pod's DNS name resolvable
only once both pods wait for it (tests/common/cluster_pods.py):
  * as TorchX starts it on Kubernetes: dist.ddp's exact torchrun command with dtrain-run in torchrun's
    place (the launchers wait for the name);
  * as a Kubeflow PyTorchJob whose command is the trainer itself: one rank per pod from MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE and RANK (rank 0 waits to bind the name, rank 1 to reach it).
The ranks train a small subset to rank 0's RESULT line, every rank with rank 0's parameters."""
import os
import subprocess
import tempfile
import unittest

from harness import clean_env, launcher, trainer
from test_train_fashion_mnist import RESULT_RE

from cluster_pods import PodNames, launch_waiting_pods, torchx_command
from netns_hosts import Hosts, netns_unavailable
from proc_util import kill_session

WAITING = "waiting for the rendezvous host name"

ARGS = ("--subset", 384, "--test_subset", 200, "--batch_size", 32, "--seed", 5, "--threads", 1, "--epochs", 1)


class Pods(unittest.TestCase):
    def run_pods(self, commands, envs):
        """Runs commands[i] (bash) in pod i with envs[i] while the rank-0 pod's name does not resolve,
        then, once every pod has said that it waits for it, publishes it (a fixed delay instead raced a
        loaded machine: a pod that took longer to start found the name already there). Returns
        [(rc, out, err)] per pod, each of which was alive while the name was unknown and waited for it in
        one line."""
        why = netns_unavailable()
        if why:
            self.skipTest(why)
        hosts = Hosts(2)
        self.addCleanup(hosts.close)
        names = PodNames(self.tmp, 2)
        pods, said, alive_while_unresolved = launch_waiting_pods(hosts, names, commands, envs, self.tmp, WAITING)
        names.publish(hosts.addr[0], self.name)
        results = []
        for i, p in enumerate(pods):
            try:
                out, _ = p.communicate(timeout=150)
            except subprocess.TimeoutExpired:
                kill_session(p)
                out, _ = p.communicate()
            results.append((p.returncode, out, said(i)))
        errs = "".join(err[-3000:] for _, _, err in results)
        self.assertEqual([rc for rc, _, _ in results], [0, 0], errs)
        self.assertEqual(alive_while_unresolved, [True, True], errs)
        for _, _, err in results:
            self.assertEqual(sum(WAITING in l for l in err.splitlines()), 1, err)
        return results

    def setUp(self):
        self.tmp = self.enterContext(tempfile.TemporaryDirectory(prefix="dtrain_pods_"))
        self.name = f"fm{os.getpid()}-trainer-0.fm{os.getpid()}.default.svc.cluster.local"

    def assert_result(self, out):
        found = [m for m in (RESULT_RE.match(l.strip()) for l in out.splitlines()) if m]
        self.assertEqual(len(found), 1, out[-3000:])
        self.assertEqual(found[0].group(5), "1", "the ranks ended with different parameters")

    def test_main_job_from_torchx_command_with_a_late_rank0_name(self):
        command = torchx_command(launcher(), trainer(), f"fm{os.getpid()}", 2, 1, *ARGS)
        # DTRAIN_SHM=0: the pods' ranks meet over the link, as pods on two machines do.
        env = clean_env(TORCHX_RANK0_HOST=self.name, TMPDIR=self.tmp, DTRAIN_SHM=0, DTRAIN_TIMEOUT_S=60)
        results = self.run_pods([command] * 2, [env] * 2)
        self.assert_result(results[0][1])
        self.assertFalse(any(RESULT_RE.match(l.strip()) for l in results[1][1].splitlines()))

    def test_pytorchjob_pods_without_a_launcher(self):
        # A PyTorchJob whose command is the trainer itself: one rank per pod, from the operator's
        # MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK. Rank 0 binds its own late name, rank 1 connects
        # to it: both wait for it.
        command = " ".join([trainer(), *map(str, ARGS)])
        envs = [clean_env(MASTER_ADDR=self.name, MASTER_PORT=29500, WORLD_SIZE=2, RANK=i, DTRAIN_SHM=0,
                          DTRAIN_TIMEOUT_S=60) for i in range(2)]
        results = self.run_pods([command] * 2, envs)
        self.assert_result(results[0][1])


if __name__ == "__main__":
    unittest.main()
