"""dtrain-run where clusters start it: TorchX's torchrun command, Kubeflow's pod environments, and a
rank-0 host name that resolves only seconds after the pods start.

The "pods" are network namespaces (tests/common/netns_hosts.py), each launched inside a mount
namespace of its own whose /etc/hosts (and resolv.conf, pointing at nothing) the test edits, as the
cluster's DNS learns the rank-0 pod's name late. The same command also runs under the real torchrun
2.x from .venv (TORCHRUN), to show that both take it.
"""
import os
import re
import shlex
import subprocess
import time
import unittest

from launcher_common import (DTRAIN_RUN, PY, MarkedTestCase, clean_env, finish, free_port, start, wait_until,
                             with_secret)
from cluster_pods import PodNames, launch_waiting_pods, torchx_command
from netns_hosts import Hosts, netns_unavailable

# A stand-in trainer: a script, as TorchX's --script is (torchrun runs it with python, dtrain-run as a
# program through its #! line). It reaches the rendezvous address it was given, by name.
WORKER = """#!{python}
import os, socket, sys
socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=10).close()
print("rank=%s group=%s world=%s local=%s role=[%s] master=%s args=%s" % (
    os.environ["RANK"], os.environ["GROUP_RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
    os.environ.get("ROLE_NAME"), os.environ["MASTER_ADDR"], " ".join(sys.argv[1:])), flush=True)
"""
WAITING = "waiting for the rendezvous host name"
OPEN_STORE = "dtrain-run: no job secret was given"  # a launcher's line once it knows who hosts the store


class ClusterTest(MarkedTestCase):
    tmp_prefix = "dtrain_cluster_"

    def setUp(self):
        super().setUp()
        self.name = f"app{os.getpid()}-node-0-0.app{os.getpid()}.default.svc.cluster.local"
        self.script = os.path.join(self.tmp, "train.py")
        with open(self.script, "w") as f:
            f.write(WORKER.format(python=PY))
        os.chmod(self.script, 0o755)

    def lines(self, out):
        return sorted(line for line in out.splitlines() if line.startswith("[rank"))

    def late_pods(self, commands, envs, source):
        """Runs commands[i] (bash) in pod i with envs[i] while self.name does not resolve, then, once
        every pod has said that it waits for the name, publishes it as pod 0's address. Every pod must
        wait for it in one line naming `source`, and end with 0. Returns the pods' stdouts."""
        why = netns_unavailable()
        if why:
            self.skipTest(why)
        hosts = Hosts(2)
        self.addCleanup(hosts.close)
        names = PodNames(self.tmp, 2)
        pods, said, alive_while_unresolved = launch_waiting_pods(hosts, names, commands, envs, self.tmp, WAITING, 30)
        names.publish(hosts.addr[0], self.name)
        results = finish(*pods, timeout=40)
        errs = [said(i) for i in range(2)]
        self.assertEqual([rc for rc, _, _ in results], [0, 0], "".join(errs))
        self.assertEqual(alive_while_unresolved, [True, True], "".join(errs))
        for err in errs:
            waits = [l for l in err.splitlines() if WAITING in l]
            self.assertEqual(len(waits), 1, err)
            self.assertIn(f"'{self.name}' ({source}) to resolve", waits[0])
        return [out for _, out, _ in results]

    def test_torchx_command_in_two_pods_whose_rank0_name_resolves_late(self):
        # TorchX's dist.ddp -j 2x1 on Kubernetes: the same command in both pods, TORCHX_RANK0_HOST the
        # rank-0 pod's DNS name, which the cluster's DNS knows only some seconds after both started.
        command = torchx_command(DTRAIN_RUN, self.script, f"app{os.getpid()}", 2, 1, "--epochs", "1", self.marker)
        env = clean_env(TORCHX_RANK0_HOST=self.name, TMPDIR=self.tmp)
        out0, out1 = self.late_pods([command] * 2, [env] * 2, "--rdzv_endpoint")
        # The pod whose address the name has hosts the store and is group 0; ranks by the rendezvous.
        self.assertEqual(self.lines(out0), [f"[rank 0] rank=0 group=0 world=2 local=0 role=[] master={self.name} "
                                            f"args=--epochs 1 {self.marker}"])
        self.assertEqual(self.lines(out1), [f"[rank 1] rank=1 group=1 world=2 local=0 role=[] master={self.name} "
                                            f"args=--epochs 1 {self.marker}"])

    def test_trainjob_pods_whose_master_name_resolves_late(self):
        # A TrainJob's pods: PET_ variables only, PET_MASTER_ADDR the rank-0 pod's DNS name
        # (<job>-node-0-0.<job>), the static form: node 0 binds it once it resolves, node 1 reaches it.
        envs = [clean_env(PET_NNODES=2, PET_NPROC_PER_NODE=1, PET_NODE_RANK=i, PET_MASTER_ADDR=self.name,
                          PET_MASTER_PORT=29500) for i in range(2)]
        out0, out1 = self.late_pods([shlex.join([DTRAIN_RUN, self.script, self.marker])] * 2, envs, "--master_addr")
        self.assertEqual(self.lines(out0), [f"[rank 0] rank=0 group=0 world=2 local=0 role=[default] "
                                            f"master={self.name} args={self.marker}"])
        self.assertEqual(self.lines(out1), [f"[rank 1] rank=1 group=1 world=2 local=0 role=[default] "
                                            f"master={self.name} args={self.marker}"])

    def test_torchx_command_on_one_node(self):
        # dist.ddp -j 1x2: the endpoint is localhost:0, a free port.
        r = subprocess.run(["bash", "-c", torchx_command(DTRAIN_RUN, self.script, "app1", 1, 2, self.marker)],
                           env=clean_env(TMPDIR=self.tmp), capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.lines(r.stdout), [f"[rank 0] rank=0 group=0 world=2 local=0 role=[] master=localhost "
                                                f"args={self.marker}",
                                                f"[rank 1] rank=1 group=0 world=2 local=1 role=[] master=localhost "
                                                f"args={self.marker}"])

    def test_a_name_that_never_resolves_fails_naming_it(self):
        if os.geteuid() != 0:
            self.skipTest("a mount namespace needs root")
        names = PodNames(self.tmp, 1)
        t0 = time.monotonic()
        r = subprocess.run(names.argv(0, shlex.join([
            DTRAIN_RUN, "--rdzv_backend", "c10d", "--rdzv_endpoint", "never-there.invalid:29500", "--nnodes", "2",
            "--rdzv_conf", "join_timeout=1.5", "true"])), env=clean_env(), capture_output=True, text=True, timeout=30)
        took = time.monotonic() - t0
        self.assertEqual(r.returncode, 1, r.stderr)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len([l for l in lines if WAITING in l]), 1, r.stderr)
        self.assertRegex(lines[-1], r"^dtrain-run: the rendezvous host name 'never-there.invalid' did not resolve "
                                    r"within 1.5s: .* \(check --rdzv_endpoint, and that the host is up\)$")
        self.assertLess(took, 15)

    def pods_on_loopback(self, envs, args=(), program=("sh", "-c", 'echo "rank=$RANK world=$WORLD_SIZE '
                                                                     'node=$GROUP_RANK local=$LOCAL_RANK"')):
        procs = [start([*args, *program], env=e) for e in envs]
        return finish(*procs, timeout=30)

    def test_kubeflow_trainjob_environment_alone(self):
        # Trainer v2's torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the pod's
        # completion index), PET_MASTER_ADDR and PET_MASTER_PORT; the command has no flags at all.
        port = free_port()
        envs = [with_secret(PET_NNODES=2, PET_NPROC_PER_NODE=2, PET_NODE_RANK=i, PET_MASTER_ADDR="127.0.0.1",
                            PET_MASTER_PORT=port) for i in (1, 0)]
        (rc1, out1, err1), (rc0, out0, err0) = self.pods_on_loopback(envs)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertEqual(self.lines(out0), ["[rank 0] rank=0 world=4 node=0 local=0",
                                            "[rank 1] rank=1 world=4 node=0 local=1"])
        self.assertEqual(self.lines(out1), ["[rank 2] rank=2 world=4 node=1 local=0",
                                            "[rank 3] rank=3 world=4 node=1 local=1"])

    def test_is_host_says_who_hosts_the_c10d_store(self):
        # Both launchers could bind the endpoint (one machine): the one started first would host, but
        # it says is_host=0, and the other is_host=1. The host is node 0. The is_host=1 launcher starts
        # only once the is_host=0 one has decided not to host: without a job secret, a launcher that
        # does not host says, right before it reaches for the store, that the store is open.
        port = free_port()

        def node(host, **kw):
            return start(["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--nnodes", 2,
                          "--rdzv_conf", f"is_host={host},join_timeout=20", "sh", "-c",
                          f'echo "host={host} group=$GROUP_RANK"'], env=clean_env(), **kw)
        err0_path = os.path.join(self.tmp, "is_host_0.stderr")
        with open(err0_path, "w") as err0_file:
            first = node(0, stderr=err0_file)

        def err0():
            with open(err0_path) as f:
                return f.read()
        if not wait_until(lambda: OPEN_STORE in err0() or first.poll() is not None, 20):
            finish(first, timeout=0.1)
        self.assertIn(OPEN_STORE, err0(), "the is_host=0 launcher did not get to reach for the store")
        second = node(1)
        (rc0, out0, _), (rc1, out1, err1) = finish(first, second, timeout=30)
        self.assertEqual((rc0, rc1), (0, 0), err0() + err1)
        self.assertEqual(self.lines(out1), ["[rank 0] host=1 group=0"])
        self.assertEqual(self.lines(out0), ["[rank 1] host=0 group=1"])
        self.assertNotIn("could not host", err0())  # is_host=0 never tried

    def test_a_flag_wins_over_its_pet_variable(self):
        r = subprocess.run([DTRAIN_RUN, "--nproc_per_node", "1", "sh", "-c", 'echo "world=$WORLD_SIZE"'],
                           env=clean_env(PET_NPROC_PER_NODE=3, PET_NNODES=1), capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "[rank 0] world=1\n")

    def test_kubeflow_pytorchjob_environment(self):
        # training-operator v1 gives every pod MASTER_ADDR, MASTER_PORT, WORLD_SIZE (the pods) and RANK
        # (the pod's index). torchrun would run each pod as a job of its own; dtrain-run takes them as
        # the nodes, and node 0 says so in one line.
        port = free_port()
        envs = [with_secret(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2, RANK=i) for i in (1, 0)]
        (rc1, out1, err1), (rc0, out0, err0) = self.pods_on_loopback(envs, ["--nproc_per_node", 2])
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertEqual(self.lines(out0), ["[rank 0] rank=0 world=4 node=0 local=0",
                                            "[rank 1] rank=1 world=4 node=0 local=1"])
        self.assertEqual(self.lines(out1), ["[rank 2] rank=2 world=4 node=1 local=0",
                                            "[rank 3] rank=3 world=4 node=1 local=1"])
        self.assertEqual([l for l in err0.splitlines() if "taking" in l], [
            f"dtrain-run: taking --nnodes 2 --node_rank 0 --master_addr 127.0.0.1 --master_port {port} from "
            "WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT (a Kubeflow PyTorchJob pod's); flags or PET_ variables "
            "override them"])
        self.assertNotIn("taking", err1)

    def test_kubeflow_pytorchjob_with_an_elastic_policy(self):
        # An elasticPolicy adds PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT (the first worker's service)
        # and PET_NNODES, and no node rank: the rendezvous assigns them, the pod's RANK notwithstanding.
        port = free_port()  # port + 1 is this process's too (proc_util.free_port)
        envs = [with_secret(MASTER_ADDR="127.0.0.1", MASTER_PORT=port + 1,
                            WORLD_SIZE=2, RANK=i, PET_RDZV_BACKEND="c10d", PET_RDZV_ENDPOINT=f"127.0.0.1:{port}",
                            PET_NNODES=2, PET_MAX_RESTARTS=1, PET_RDZV_ID="kf1", PET_LOCAL_ADDR=f"127.0.0.{2 + i}")
                for i in (1, 0)]
        results = self.pods_on_loopback(envs, ["--nproc_per_node", 1],
                                        ["sh", "-c", 'echo "rank=$RANK world=$WORLD_SIZE id=$TORCHELASTIC_RUN_ID '
                                                     'master=$MASTER_ADDR"'])
        outs = []
        for rc, out, err in results:
            self.assertEqual(rc, 0, err)
            self.assertNotIn("taking --nnodes", err)
            # --local_addr (PET_LOCAL_ADDR): the address the others know this node by, and node 0's is
            # every worker's MASTER_ADDR (test_rdzv_conf.py).
            formed = re.search(r"elastic job formed by node 0 \((127\.0\.0\.[23])\), node 1 \(127\.0\.0\.[23]\); "
                               r"world size 2", err)
            self.assertTrue(formed, err)
            outs += self.lines(out)
        self.assertEqual(sorted(outs), [f"[rank 0] rank=0 world=2 id=kf1 master={formed[1]}",
                                        f"[rank 1] rank=1 world=2 id=kf1 master={formed[1]}"])


class TorchrunTakesTheSameCommand(MarkedTestCase):
    """The TorchX command with the real torchrun 2.x from .venv in dtrain-run's place: two "pods" on
    loopback. What dtrain-run is given is what torchrun takes."""
    tmp_prefix = "dtrain_torchrun_cmd_"

    def test_torchx_command_under_torchrun(self):
        torchrun = os.environ.get("TORCHRUN", "")
        if not os.access(torchrun, os.X_OK):
            self.skipTest(f"no torchrun at TORCHRUN={torchrun!r}: run scripts/setup.sh (PyPI's torch in .venv/)")
        script = os.path.join(self.tmp, "train.py")
        with open(script, "w") as f:
            f.write(WORKER.format(python=PY))
        port = free_port()
        command = torchx_command(torchrun, script, "app1", 2, 1, "--epochs", "1", rdzv_port=port)
        env = clean_env(TORCHX_RANK0_HOST="127.0.0.1", TMPDIR=self.tmp, PYTHONPATH=None, LOGLEVEL="WARNING")
        pods = [subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True) for _ in range(2)]
        results = finish(*pods, timeout=90)
        ranks = []
        for rc, out, err in results:
            self.assertEqual(rc, 0, err[-3000:])
            # torchrun's workers reach its store by the name of the node that hosts it (here localhost).
            ranks += [re.sub(r" master=\S+", "", l.split("]:", 1)[1]) for l in out.splitlines() if "]:rank=" in l]
        self.assertEqual(sorted(ranks), ["rank=0 group=0 world=2 local=0 role=[] args=--epochs 1",
                                         "rank=1 group=1 world=2 local=0 role=[] args=--epochs 1"])


if __name__ == "__main__":
    unittest.main()
