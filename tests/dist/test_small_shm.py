"""A small /dev/shm never crashes a rank. Jobs run in a mount namespace whose /dev/shm is an 8 MiB
tmpfs, smaller than the shared-memory segment of 2 ranks (8 MiB of slots and rings and a few pages):
  * 2 ranks all-reducing 64 MiB: the segment cannot be reserved, so every rank says so in one line
    naming the size needed and the remedy (a Memory emptyDir, Docker's --shm-size), and Gloo gives
    the right sums;
  * the pipeline example (send/recv between its stages) and the main job's model: the same one line
    per rank, and the results of a run with shared memory;
  * a /dev/shm that fills while the job runs: after the default group's segment is made, another
    process takes every free byte. The default group's point-to-point rings, written for the first
    time then, still work (their pages were reserved when the segment was made: without that, SIGBUS),
    and a group made later falls back to Gloo with the one line.
A mount namespace needs root: the file skips without it (tests/skips_allowed.txt)."""
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import harness
from harness import DistTestCase, clean_env, launcher, trainer, wait_until
from test_shm import shm_dist_test
from test_train_fashion_mnist import RESULT_RE

# argv prefix running a command in a mount namespace of its own, /dev/shm an 8 MiB tmpfs there. The
# command keeps the namespace's first process (exec), so nsenter can join it by that pid.
SMALL_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh"]
SHM_LINE_RE = re.compile(
    r"^\[rank (\d+)\] dtrain warning: shared-memory collectives are unavailable \(group rank 0: reserving "
    r"([0-9.]+) MiB \((\d+) bytes\) of /dev/shm for the shared-memory segment \S+ failed: /dev/shm is too "
    r"small \(([0-9.]+) MiB free of 8\.0 MiB\) for the segment of 2 ranks: enlarge it \(Kubernetes: mount a "
    r"Memory emptyDir at /dev/shm; Docker: --shm-size\) or lower DTRAIN_SHM_SLOT_BYTES; set DTRAIN_SHM=0 to "
    r"use Gloo only\); using Gloo over TCP$")
RUN_TIMEOUT_S = 60


def mount_namespace_unavailable():
    """Why this machine cannot give a job its own small /dev/shm (a skip reason), or None."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        return "needs root and util-linux's unshare and nsenter for a mount namespace with its own /dev/shm"
    r = subprocess.run(SMALL_SHM + ["true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot mount a tmpfs on /dev/shm in a mount namespace here: {r.stderr.strip()}"
    return None


def pipeline_train():
    path = harness.binary("EXAMPLE_PIPELINE_TRAIN", "pipeline_train")
    if not path:
        raise unittest.SkipTest("pipeline_train is not built")
    return path


def launch(program, *args):
    return [launcher(), "--standalone", "--nproc_per_node", 2, "--grace_period", 2, program, *args]


class SmallShm(DistTestCase):
    def setUp(self):
        why = mount_namespace_unavailable()
        if why:
            self.skipTest(why)

    def run_small(self, argv, **env):
        res = self.run_one(SMALL_SHM + argv, clean_env(DTRAIN_TIMEOUT_S=RUN_TIMEOUT_S, **env), timeout=RUN_TIMEOUT_S)
        self.assertEqual(res.rc, 0, str(res))
        return res

    def assert_one_line_per_rank(self, res, at_most_free_mib=8.0):
        """No rank crashed, and each said once, in the one line, what the segment needs and how to get it."""
        self.assertNotIn("SIGBUS", res.err, str(res))
        lines = [l for l in res.err.splitlines() if "/dev/shm" in l]
        self.assertEqual(len(lines), 2, f"expected one /dev/shm line per rank:\n{res}")
        found = [SHM_LINE_RE.match(l) for l in lines]
        self.assertTrue(all(found), f"a /dev/shm line is not the expected one:\n{res}")
        self.assertEqual(sorted(m.group(1) for m in found), ["0", "1"], str(res))
        for m in found:
            needed_mib, needed, free_mib = float(m.group(2)), int(m.group(3)), float(m.group(4))
            self.assertGreater(needed, free_mib * 2**20, str(res))
            self.assertAlmostEqual(needed_mib, needed / 2**20, delta=0.1, msg=str(res))
            self.assertLessEqual(free_mib, at_most_free_mib, str(res))

    def test_all_reduce_of_64_mib_falls_back_to_gloo_with_one_line_per_rank(self):
        res = self.run_small(launch(shm_dist_test(), "--all_reduce_mib", 64))
        self.assert_one_line_per_rank(res)
        for r in (0, 1):
            self.assertIn(f"[rank {r}] default group: all_reduce of 64 MiB over 2 ranks right, shared memory: no",
                          res.out, str(res))

    def test_pipeline_falls_back_and_trains_as_with_shared_memory(self):
        args = launch(pipeline_train(), "--steps", 10)
        res = self.run_small(args)
        self.assert_one_line_per_rank(res)
        reference = self.run_one(args, clean_env(DTRAIN_TIMEOUT_S=RUN_TIMEOUT_S), timeout=RUN_TIMEOUT_S)
        self.assertEqual(reference.rc, 0, str(reference))
        result = [l for l in res.out.splitlines() if "RESULT " in l]
        self.assertEqual(len(result), 1, str(res))
        self.assertEqual(result, [l for l in reference.out.splitlines() if "RESULT " in l],
                         f"{res}\n--- with the machine's /dev/shm:\n{reference}")

    def test_main_job_falls_back_and_its_ranks_agree(self):
        res = self.run_small(launch(trainer(), "--subset", 512, "--test_subset", 256, "--epochs", 1, "--threads", 1),
                             DTRAIN_DEBUG="INFO")
        self.assert_one_line_per_rank(res)
        self.assertIn("group of 2 ranks (gloo)", res.err, f"DDP did not fall back to Gloo:\n{res}")
        m = RESULT_RE.match(res.out.strip().splitlines()[-1])
        self.assertIsNotNone(m, f"the last line is not the RESULT line:\n{res}")
        self.assertEqual(m.group(5), "1", f"the ranks' final parameters differ:\n{res}")

    def test_a_dev_shm_filled_while_the_job_runs(self):
        tmp = self.enterContext(tempfile.TemporaryDirectory(prefix="dtrain_small_shm_"))
        # 256 KiB slots: the default group's segment (2.1 MiB) fits the 8 MiB, and is made.
        job = self.spawn(SMALL_SHM + launch(shm_dist_test(), "--all_reduce_mib", 8, "--fill_pause", tmp),
                         clean_env(DTRAIN_TIMEOUT_S=RUN_TIMEOUT_S, DTRAIN_SHM_SLOT_BYTES=262144))
        ready = [os.path.join(tmp, f"ready.{r}") for r in (0, 1)]
        wait_until(lambda: all(map(os.path.exists, ready)) or job.ended(), RUN_TIMEOUT_S)
        if not all(map(os.path.exists, ready)):
            self.fail(f"the ranks did not get ready:\n{job.finish(1)}")
        # Another process of the namespace takes all that is left, as another job's files would.
        fill = subprocess.run(["nsenter", "-t", str(job.pid), "-m", "sh", "-c",
                               "cat /dev/zero > /dev/shm/filler 2>/dev/null; stat -f -c '%a %S' /dev/shm"],
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(fill.returncode, 0, f"nsenter failed: {fill}")
        blocks, block_size = map(int, fill.stdout.split())
        self.assertLess(blocks * block_size, 2**20, f"/dev/shm was not filled: {fill}")
        open(os.path.join(tmp, "filled"), "w").close()
        res = job.finish(RUN_TIMEOUT_S)
        self.assertEqual(res.rc, 0, str(res))
        self.assert_one_line_per_rank(res, at_most_free_mib=0.9)
        for r in (0, 1):
            for step, shm in (("default group: all_reduce of 8 MiB", "yes"), ("default group: send/recv of 4 MiB", "yes"),
                              ("later group: all_reduce of 8 MiB", "no"),
                              ("default group again: all_reduce of 8 MiB", "yes")):
                self.assertRegex(res.out, re.escape(f"[rank {r}] {step}") + rf".* right, shared memory: {shm}\n",
                                 str(res))


if __name__ == "__main__":
    unittest.main()
