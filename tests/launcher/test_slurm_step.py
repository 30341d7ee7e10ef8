"""dtrain-run started by srun, with the variables srun gives each task set by hand (the real srun is in
tests/dist/test_slurm.py): in a step of several tasks each task's launcher is one node of one job
(node rank SLURM_PROCID, master from the node list and the job id), flags that contradict the step are
one-line usage errors, and a step of one task changes nothing."""
import time

from launcher_common import (MarkedTestCase, clean_env, finish, free_port, free_slurm_job_id, run, slurm_job_port,
                             start)

PRINT_ENV = ('echo "rank=$RANK/$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE node=$GROUP_RANK/$GROUP_WORLD_SIZE '
             'master=$MASTER_ADDR:$MASTER_PORT omp=$OMP_NUM_THREADS"')


def job_id_with_free_port():
    job = free_slurm_job_id()
    return job, slurm_job_port(job)


def task_env(procid, ntasks, job, per_node=None, nodeid=0, localid=None, **extra):
    """What srun gives task `procid` of a step of `ntasks` tasks on one host (per_node: Slurm's counts)."""
    return clean_env(SLURM_JOB_ID=job, SLURM_STEP_ID=0, SLURM_STEP_NUM_TASKS=ntasks, SLURM_PROCID=procid,
                     SLURM_LOCALID=procid if localid is None else localid, SLURM_NODEID=nodeid,
                     SLURM_STEP_TASKS_PER_NODE=per_node or str(ntasks), SLURM_NTASKS=ntasks,
                     SLURM_STEP_NODELIST="localhost,node[02-04]", OMP_NUM_THREADS=1, **extra)


class SlurmStep(MarkedTestCase):
    tmp_prefix = "dtrain_slurm_step_"

    def launch_step(self, ntasks, args, **extra):
        job, port = job_id_with_free_port()
        procs = [start(args, env=task_env(t, ntasks, job, **extra)) for t in range(ntasks)]
        return port, finish(*procs)

    def test_each_task_is_one_node_of_one_job(self):
        port, results = self.launch_step(2, ["--nproc_per_node", 2, "sh", "-c", PRINT_ENV])
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
        (_, out0, err0), (_, out1, err1) = results
        # Tasks on one host split its local ranks and cores: no two workers share a LOCAL_RANK (GPU).
        self.assertEqual(sorted(out0.splitlines()), [
            f"[rank 0] rank=0/4 local=0/4 node=0/2 master=localhost:{port} omp=1",
            f"[rank 1] rank=1/4 local=1/4 node=0/2 master=localhost:{port} omp=1"])
        self.assertEqual(sorted(out1.splitlines()), [
            f"[rank 2] rank=2/4 local=2/4 node=1/2 master=localhost:{port} omp=1",
            f"[rank 3] rank=3/4 local=3/4 node=1/2 master=localhost:{port} omp=1"])
        # Node 0 says what the step decided, once.
        notes = [l for l in err0.splitlines() if "srun step of 2 tasks" in l]
        self.assertEqual(len(notes), 1, err0)
        self.assertIn("each task's dtrain-run is one node (node rank SLURM_PROCID), world 4; rendezvous at "
                      "MASTER_ADDR=localhost (the first host of SLURM_STEP_NODELIST=localhost,node[02-04]) and "
                      f"MASTER_PORT={port} (15000 + the last 4 digits of SLURM_JOB_ID=", notes[0])
        self.assertNotIn("srun step", err1)

    def test_tasks_on_several_hosts_count_local_ranks_per_host(self):
        # Node 1's only task: local ranks start at 0 there, and its host is its own.
        job, _ = job_id_with_free_port()
        master = free_port()
        envs = [task_env(0, 2, job, per_node="1(x2)", nodeid=0, localid=0, MASTER_PORT=master),
                task_env(1, 2, job, per_node="1(x2)", nodeid=1, localid=0, MASTER_PORT=master)]
        procs = [start(["--nproc_per_node", 1, "sh", "-c", PRINT_ENV], env=e) for e in envs]
        (rc0, out0, err0), (rc1, out1, err1) = finish(*procs)
        self.assertEqual((rc0, rc1), (0, 0), err0 + err1)
        self.assertEqual(out0.strip(), f"[rank 0] rank=0/2 local=0/1 node=0/2 master=localhost:{master} omp=1")
        self.assertEqual(out1.strip(), f"[rank 1] rank=1/2 local=0/1 node=1/2 master=localhost:{master} omp=1")
        # MASTER_PORT was given: only the address came from Slurm.
        self.assertIn("rendezvous at MASTER_ADDR=localhost (the first host of", err0)
        self.assertNotIn("MASTER_PORT=", err0)

    def test_flags_name_the_master(self):
        port = free_port()
        _, results = self.launch_step(2, ["--master_addr", "127.0.0.1", "--master_port", port, "--nproc_per_node",
                                          1, "sh", "-c", PRINT_ENV])
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
        self.assertIn(f"master=127.0.0.1:{port}", results[1][1])
        self.assertIn(f"world 2; rendezvous at 127.0.0.1:{port}", results[0][2])

    def test_contradicting_flags_are_refused(self):
        job, _ = job_id_with_free_port()
        cases = [
            (["--standalone"], "--standalone in an srun step of 2 tasks would start 2 separate one-node jobs: "
                               "drop --standalone (each task's dtrain-run then joins as one node of the job), or "
                               "srun one task"),
            (["--nnodes", 3], "--nnodes 3 disagrees with this srun step's 2 tasks (SLURM_STEP_NUM_TASKS): each "
                              "task's dtrain-run is one node; drop --nnodes, or srun 3 tasks"),
            (["--node_rank", 1], "--node_rank 1 disagrees with this task's SLURM_PROCID=0: in an srun step each "
                                 "task's dtrain-run is node SLURM_PROCID; drop --node_rank"),
        ]
        for flags, message in cases:
            with self.subTest(flags=flags):
                t0 = time.monotonic()
                r = run(flags + ["true"], env=task_env(0, 2, job))
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertEqual(r.stderr.strip().splitlines(), [f"dtrain-run: {message}"])
                self.assertLess(time.monotonic() - t0, 5)
        # Flags that agree with the step are fine (tutorials pass them).
        r = run(["--nnodes", 2, "--node_rank", 0, "--rdzv_timeout", 1, "true"], env=task_env(0, 2, job))
        self.assertNotIn("disagrees", r.stderr)

    def test_broken_slurm_variables_are_one_line(self):
        job, _ = job_id_with_free_port()
        r = run(["true"], env=task_env(0, 2, job, per_node="2(x"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("dtrain-run: SLURM_STEP_TASKS_PER_NODE='2(x' is not Slurm's task counts", r.stderr)

    def test_a_step_of_one_task_runs_as_anywhere(self):
        job, _ = job_id_with_free_port()
        r = run(["--standalone", "--nproc_per_node", 2, "sh", "-c", PRINT_ENV], env=task_env(0, 1, job))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(r.stdout.splitlines()), 2, r.stdout)
        self.assertIn("rank=1/2 local=1/2 node=0/1 master=127.0.0.1:", r.stdout)
        self.assertNotIn("srun step", r.stderr)


if __name__ == "__main__":
    import unittest
    unittest.main()
