"""Rank and world size from other launchers' environments, ranks started directly:
OpenMPI (real mpirun), MPICH (real mpiexec.mpich, the trainer), Slurm-style and MPICH-style variables
set by hand, and torchrun's agent store (a c10d TCPStore hosted by a Python process, as torchrun's
agent does). The real Slurm is in test_slurm.py."""
import os
import shutil
import time
import unittest

from harness import DistTestCase, clean_env, free_port, hello
from test_train_fashion_mnist import trainer

# A torchrun agent's store: python3-torch's TCPStore server; prints "ready", then lives until stdin
# closes (or the test kills it).
AGENT_STORE = r"""
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True,
                      timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
print("ready", flush=True)
sys.stdin.read()
"""


class OpenMPI(DistTestCase):
    def mpirun(self):
        path = shutil.which("mpirun")
        if not path:
            self.skipTest("mpirun is not installed (Debian: apt-get install openmpi-bin)")
        return path

    def test_mpirun_two_ranks(self):
        port = free_port()
        # Root in a container: OpenMPI refuses to run as root without both flags below. --oversubscribe:
        # more ranks than cores is fine for a test. The OMPI_ALLOW_* variables cover older releases.
        env = clean_env(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
                        OMPI_MCA_plm_rsh_agent="false")
        argv = [self.mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", 2,
                "--mca", "btl", "self,tcp", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}",
                "-x", "OMP_NUM_THREADS=1", hello(), "--timeout_s", 30]
        res = self.run_one(argv, env, timeout=90)
        self.assertEqual(res.rc, 0, str(res))
        self.assertEqual(res.out.count("all_reduce check passed: sum of (rank+1) over 2 ranks"), 2, str(res))
        # Local ranks come from OMPI_COMM_WORLD_LOCAL_RANK/SIZE.
        for r in range(2):
            self.assertIn(f"Rank: {r}, World Size: 2, Local Rank: {r}/2", res.out, str(res))


class Mpich(DistTestCase):
    """Debian's MPICH (Hydra's mpiexec, PMI_RANK / PMI_SIZE) starting the trainer. Called by its own name:
    /usr/bin/mpiexec stays OpenMPI's (the alternative OpenMPI's test above uses)."""

    def test_mpiexec_mpich_trains_two_ranks(self):
        path = shutil.which("mpiexec.mpich")
        if not path:
            self.skipTest("MPICH is not installed (Debian: apt-get install mpich, or scripts/setup.sh)")
        port = free_port()
        # -launcher fork: every rank on this host, whatever scheduler the environment names.
        argv = [path, "-launcher", "fork", "-n", 2, "-genv", "MASTER_ADDR", "127.0.0.1", "-genv", "MASTER_PORT",
                port, trainer(), "--subset", 600, "--test_subset", 200, "--epochs", 1]
        res = self.run_one(argv, clean_env(DTRAIN_TIMEOUT_S=60), timeout=120)
        self.assertEqual(res.rc, 0, str(res))
        self.assertIn("train_fashion_mnist: 2 rank(s) x", res.out, str(res))
        results = [l for l in res.out.splitlines() if l.startswith("RESULT ")]
        self.assertEqual(len(results), 1, str(res))
        self.assertTrue(results[0].endswith(" ranks_agree=1"), str(res))


class SchedulerEnv(DistTestCase):
    def run_with(self, make_env, world=2):
        port = free_port()
        envs = [make_env(r, world) for r in range(world)]
        for env in envs:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            self.assertNotIn("RANK", env)
        results = self.run_ranks([hello(), "--timeout_s", 30], envs)
        self.assertPassed(results, world)
        return results

    def test_slurm(self):
        results = self.run_with(lambda r, n: clean_env(SLURM_PROCID=r, SLURM_NTASKS=n, SLURM_LOCALID=r,
                                                       SLURM_STEP_ID=0))
        for r, res in enumerate(results):
            self.assertIn(f"Rank: {r}, World Size: 2, Local Rank: {r}/2", res.out, str(res))

    def test_slurm_three_ranks_local_ids(self):
        # Two "nodes": SLURM_LOCALID restarts at 0 on the second; SLURM_NTASKS_PER_NODE is not an int.
        local = [0, 1, 0]
        results = self.run_with(lambda r, n: clean_env(SLURM_PROCID=r, SLURM_NTASKS=n,
                                                       SLURM_LOCALID=local[r],
                                                       SLURM_NTASKS_PER_NODE="2(x1),1", SLURM_STEP_ID=0),
                                world=3)
        for r, res in enumerate(results):
            self.assertIn(f"Rank: {r}, World Size: 3, Local Rank: {local[r]}/", res.out, str(res))

    def test_mpich(self):
        results = self.run_with(lambda r, n: clean_env(PMI_RANK=r, PMI_SIZE=n))
        for r, res in enumerate(results):
            self.assertIn(f"Rank: {r}, World Size: 2", res.out, str(res))

    def test_mpich_local_ranks(self):
        # Hydra's MPI_LOCALRANKID / MPI_LOCALNRANKS win over the local ranks derived from host names:
        # here they say "one rank per node", which the one host of this test would never derive (0/2, 1/2).
        results = self.run_with(lambda r, n: clean_env(PMI_RANK=r, PMI_SIZE=n, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=1))
        for r, res in enumerate(results):
            self.assertIn(f"Rank: {r}, World Size: 2, Local Rank: 0/1", res.out, str(res))


class TorchrunAgentStore(DistTestCase):
    def test_ranks_join_a_python_tcpstore(self):
        port = free_port()
        store = self.spawn_python_store(AGENT_STORE, port)
        envs = [clean_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                          TORCHELASTIC_USE_AGENT_STORE="True") for r in range(2)]
        results = self.run_ranks([hello(), "--timeout_s", 30], envs)
        self.assertPassed(results, 2)
        self.assertFalse(store.ended(), "the agent store exited while the ranks used it")
        store.p.stdin.close()
        self.assertEqual(store.finish(10).rc, 0)


if __name__ == "__main__":
    unittest.main()
