"""The trainer and dtrain-run under a real Slurm: a one-machine cluster of the test's own (munged,
slurmctld, slurmd; slurm_cluster.py) for the whole file, then

  * `srun -n 2` and `srun -n 3` train to the RESULT line with ranks_agree=1, with MASTER_ADDR and
    MASTER_PORT exported and without them (then rank 0 says once where the job met: the first host of
    the step's node list, 15000 + the last four digits of the job id);
  * the tutorial's batch script (examples/slurm/train_fashion_mnist.sbatch), submitted with
    `sbatch --wait` as written;
  * `scancel` of a running step leaves no process of the job behind;
  * `srun -n 2 dtrain-run ...`: each task's launcher is one node of one job, and --standalone there is
    a one-line refusal;
  * a program started directly in a batch script (the job's variables, but no step) refuses at once
    instead of waiting for ranks that nobody starts.

Skipped where Slurm is not installed (scripts/setup.sh installs it) or the test is not root (slurmd).
Binaries: $TRAIN_FASHION_MNIST, $DTRAIN_RUN and $HELLO (tests/dist/CMakeLists.txt), else build*/bin.
"""
import os
import re
import subprocess
import tempfile
import time
import unittest

from harness import ROOT, DistTestCase, free_port, hello, slurm_job_port, wait_until
from slurm_cluster import SlurmCluster
from test_train_fashion_mnist import RESULT_RE, launcher, trainer

# A short run: 2 or 3 ranks, one epoch of 600 samples, 200 test samples (a few seconds here).
TRAIN_ARGS = ["--subset", 600, "--test_subset", 200, "--epochs", 1]
RUN_TIMEOUT_S = 120
# The tutorial's batch script (docs/tutorial/03-distributeddataparallel.md shows this file; scripts/doc_check.py
# keeps them equal).
BATCH_SCRIPT = os.path.join(ROOT, "examples", "slurm", "train_fashion_mnist.sbatch")
NOTE_RE = re.compile(r"^dtrain: rendezvous at MASTER_ADDR=(\S+) \(the first host of SLURM_STEP_NODELIST=\S+\) and "
                     r"MASTER_PORT=(\d+) \(15000 \+ the last 4 digits of SLURM_JOB_ID=(\d+), as Lightning\) from "
                     r"Slurm's job; export MASTER_ADDR and MASTER_PORT to choose others$", re.M)


def job_processes(job_id):
    """Live processes of a job: its tasks (SLURM_JOB_ID=job_id in their environment) and its slurmstepd."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (f"SLURM_JOB_ID={job_id}".encode() in env or cmd.startswith(f"slurmstepd: [{job_id}.")):
            found.append(f"{pid}: {cmd}")
    return found


class Slurm(DistTestCase):
    cluster = None

    @classmethod
    def setUpClass(cls):
        cluster = SlurmCluster()
        cluster.start()  # skips the class where it cannot run
        cls.addClassCleanup(cls.stop_cluster, cluster)
        cls.cluster = cluster

    @staticmethod
    def stop_cluster(cluster):
        left = cluster.stop()
        if left:
            raise AssertionError("processes of the test's Slurm cluster outlived it (killed now):\n" + "\n".join(left))

    def env(self, **extra):
        return self.cluster.env(DTRAIN_TIMEOUT_S=60, **extra)

    def srun(self, argv, env, timeout=RUN_TIMEOUT_S):
        return self.run_one(["srun", "--kill-on-bad-exit=1", *argv], env, timeout=timeout)

    def assert_trained(self, res, world):
        self.assertEqual(res.rc, 0, str(res))
        self.assertIn(f"train_fashion_mnist: {world} rank(s) x", res.out, str(res))
        lines = [l for l in res.out.splitlines() if "RESULT " in l]
        self.assertEqual(len(lines), 1, f"exactly one RESULT line (rank 0):\n{res}")
        m = RESULT_RE.match(lines[0])
        self.assertIsNotNone(m, str(res))
        self.assertEqual(m.group(5), "1", f"the ranks' final parameters differ:\n{res}")

    # --- srun starts the ranks -----------------------------------------------------------------------
    def check_srun(self, world, master):
        env = self.env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()) if master else self.env()
        res = self.srun(["-n", world, trainer(), *TRAIN_ARGS], env)
        self.assert_trained(res, world)
        notes = NOTE_RE.findall(res.err)
        if master:
            self.assertEqual(notes, [], f"MASTER_ADDR and MASTER_PORT were set, nothing to derive:\n{res}")
            return
        self.assertEqual(len(notes), 1, f"rank 0 says once where the job met:\n{res}")
        host, port, job = notes[0]
        self.assertEqual(host, self.cluster.node)
        self.assertEqual(int(port), slurm_job_port(int(job)))

    def test_srun_2_ranks_with_master_addr(self):
        self.check_srun(2, master=True)

    def test_srun_3_ranks_with_master_addr(self):
        self.check_srun(3, master=True)

    def test_srun_2_ranks_without_master_addr(self):
        self.check_srun(2, master=False)

    def test_srun_3_ranks_without_master_addr(self):
        self.check_srun(3, master=False)

    # --- sbatch, as users submit ---------------------------------------------------------------------
    def test_sbatch_wait_runs_the_tutorial_batch_script(self):
        with tempfile.TemporaryDirectory() as tmp:
            # Submitted from a folder whose ./build/bin is this tree's, the script runs as written, and
            # its output and checkpoints land in that folder.
            os.mkdir(os.path.join(tmp, "build"))
            os.symlink(os.path.dirname(trainer()), os.path.join(tmp, "build", "bin"))
            res = self.run_one(["sbatch", "--wait", BATCH_SCRIPT], self.env(), timeout=RUN_TIMEOUT_S, cwd=tmp)
            m = re.search(r"Submitted batch job (\d+)", res.out)
            self.assertIsNotNone(m, str(res))
            job = m.group(1)
            with open(os.path.join(tmp, f"fashion-mnist-{job}.out")) as f:
                job_out = f.read()
            self.assertEqual(res.rc, 0, f"{res}\n--- job output\n{job_out}")
            res.out = job_out  # the job's output, for the checks
            self.assert_trained(res, 2)
            self.assertEqual(len(NOTE_RE.findall(job_out)), 1, job_out)
            self.assertTrue(os.listdir(os.path.join(tmp, f"checkpoints-{job}")), job_out)

    # --- scancel -------------------------------------------------------------------------------------
    def test_scancel_of_a_running_step_leaves_no_process(self):
        name = f"dtrain-scancel-{os.getpid()}"
        # Long enough never to end by itself: 2 ranks, 100 ms per step.
        step = self.spawn(["srun", "-n", 2, f"--job-name={name}", trainer(), "--epochs", 50, "--step_sleep_ms", 100],
                          self.env())
        # Rank 0's first line comes once every rank has joined the process group.
        started = wait_until(lambda: "train_fashion_mnist:" in step.output() or step.ended(),
                             timeout=60)
        self.assertTrue(started and not step.ended(), f"the step did not start training:\n{step.finish(1)}")
        jobs = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], env=self.env(), capture_output=True,
                              text=True, timeout=30).stdout.split()
        self.assertEqual(len(jobs), 1, f"squeue -n {name}: {jobs}")
        job = jobs[0]
        self.assertEqual(len([p for p in job_processes(job) if "train_fashion_mnist" in p]), 2, job_processes(job))
        t0 = time.monotonic()
        subprocess.run(["scancel", job], env=self.env(), check=True, timeout=30)
        res = step.finish(30)
        self.assertNotEqual(res.rc, 0, f"srun of a cancelled job succeeded:\n{res}")
        gone = wait_until(lambda: not job_processes(job), timeout=20)
        self.assertTrue(gone, f"processes of job {job} left {time.monotonic() - t0:.1f} s after scancel:\n"
                              + "\n".join(job_processes(job)))

    # --- dtrain-run inside a step --------------------------------------------------------------------
    def test_srun_dtrain_run_makes_each_task_one_node(self):
        res = self.srun(["-n", 2, launcher(), "--nproc_per_node", 2, hello(), "--timeout_s", 30], self.env())
        self.assertEqual(res.rc, 0, str(res))
        # One job of 4 ranks, not two jobs of 2: every rank sees the world of 4, and the tasks that share
        # this host split its local ranks.
        self.assertEqual(res.out.count("all_reduce check passed: sum of (rank+1) over 4 ranks"), 4, str(res))
        for r in range(4):
            self.assertIn(f"Rank: {r}, World Size: 4, Local Rank: {r}/4", res.out, str(res))
        self.assertEqual(res.err.count("dtrain-run: srun step of 2 tasks: each task's dtrain-run is one node"), 1,
                         str(res))

    def test_srun_dtrain_run_trains(self):
        res = self.srun(["-n", 2, launcher(), "--nproc_per_node", 1, trainer(), *TRAIN_ARGS], self.env())
        self.assert_trained(res, 2)

    def test_srun_dtrain_run_standalone_is_refused(self):
        t0 = time.monotonic()
        res = self.srun(["-n", 2, launcher(), "--standalone", "--nproc_per_node", 1, hello()], self.env())
        self.assertNotEqual(res.rc, 0, str(res))
        lines = [l for l in res.err.splitlines() if l.startswith("dtrain-run:")]
        self.assertEqual(lines, ["dtrain-run: --standalone in an srun step of 2 tasks would start 2 separate "
                                 "one-node jobs: drop --standalone (each task's dtrain-run then joins as one node "
                                 "of the job), or srun one task"] * 2, str(res))
        self.assertNotIn("Rank:", res.out)
        self.assertLess(time.monotonic() - t0, 30)

    # --- the job's variables without a step ----------------------------------------------------------
    def test_a_rank_started_in_a_batch_script_refuses_at_once(self):
        # The batch script has the job's SLURM_PROCID=0 and SLURM_NTASKS=2, but without srun no second
        # rank ever starts: the program must say so rather than wait out its timeout.
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "direct.sbatch")
            with open(script, "w") as f:
                f.write(f"#!/bin/sh\n#SBATCH --ntasks=2\nexec {hello()} --timeout_s 30\n")
            out = os.path.join(tmp, "job.out")
            res = self.run_one(["sbatch", "--wait", f"--output={out}", script], self.env(), timeout=RUN_TIMEOUT_S,
                               cwd=tmp)
            self.assertNotEqual(res.rc, 0, str(res))
            with open(out) as f:
                res.err = f.read()
        self.assertOneLineError(res, "SLURM_NTASKS=2 but SLURM_STEP_ID is not set: this is a batch script, not an "
                                     "srun step", "start the program with srun")
        self.assertLess(res.seconds, 25, str(res))

if __name__ == "__main__":
    unittest.main()
