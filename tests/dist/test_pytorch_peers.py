"""Python and C++ ranks in one process group (InitOptions().pytorch_peers / DTRAIN_PYTORCH_PEERS=1).

Every layout runs tests/dist/peer_rank.py (PyTorch 2.x from .venv, torch.distributed with gloo) and
the dtrain program peer_rank (built against the same LibTorch) side by side: 2 and 3 ranks, with a
Python rank 0 (Python hosts the store) and with a C++ rank 0 (dtrain hosts PyTorch's TCPStore).
Each rank checks all_reduce, broadcast, all_gather, barrier, send/recv and two subgroups (ranks 0 and 1,
one of each language, while a third rank stays out; then every rank) against the others, and every
rank's DistributedSampler indices must equal Python's DistributedSampler for that rank.
A LibTorch 1.13 tree cannot join PyTorch 2.x ranks; there the mode must refuse with the remedy.

Env: $PEER_RANK (the C++ program), $VENV_PYTHON, $DTRAIN_TORCH_MAJOR (set by tests/dist/CMakeLists.txt).
"""
import os
import subprocess
import unittest

from harness import DistTestCase, binary, free_port, rank_env

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_MAJOR = int(os.environ.get("DTRAIN_TORCH_MAJOR", "0"))
VENV_PYTHON = os.environ.get("VENV_PYTHON", "")


def needs(path, what):
    if not path or not os.access(path, os.X_OK):
        raise unittest.SkipTest(f"{what} is missing ({path!r}): run scripts/setup.sh and build the tree")
    return path


def peer_rank():
    """The C++ side: a missing $PEER_RANK (set by CMake) fails the test, as every built program does."""
    return needs(binary("PEER_RANK", "peer_rank"), "peer_rank")


def python_indices(rank, world):
    """Python's DistributedSampler for one rank, without a process group."""
    code = ("import sys\nfrom torch.utils.data.distributed import DistributedSampler as D\n"
            "s = D(range(101), num_replicas=int(sys.argv[1]), rank=int(sys.argv[2]), seed=7)\n"
            "s.set_epoch(3)\nprint(' '.join(map(str, s)))")
    out = subprocess.run([VENV_PYTHON, "-c", code, str(world), str(rank)], capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.split()


class PytorchPeers(DistTestCase):
    def run_layout(self, kinds, **env):
        cxx = peer_rank()
        py = [needs(VENV_PYTHON, ".venv/bin/python"), os.path.join(HERE, "peer_rank.py")]
        results, port = self.run_world([py if k == "py" else [cxx] for k in kinds], 120, **env)
        world = len(kinds)
        if kinds[0] == "cxx":  # Note [Open stores]: the dtrain rank 0 that hosts PyTorch's TCPStore says so
            secret = "and DTRAIN_JOB_SECRET, which is set, does not apply to it" if "DTRAIN_JOB_SECRET" in env else \
                "which DTRAIN_JOB_SECRET cannot change"
            self.assertEqual([l for l in results[0].err.splitlines() if "TCPStore" in l],
                             ["dtrain: rank 0 hosts this job's store as Python ranks need it, PyTorch's TCPStore: it "
                              f"listens on every interface (0.0.0.0 and ::, port {port}) with no authentication, "
                              f"{secret}: anyone who reaches the port can read and change the job's keys; run the "
                              "job where only its machines reach each other"], str(results[0]))
        for r, (kind, res) in enumerate(zip(kinds, results)):
            self.assertEqual(res.rc, 0, f"rank {r} ({kind}) of {kinds}:\n{res}")
            self.assertIn("peer_rank: ALL OK", res.out, f"rank {r} ({kind}):\n{res}")
            language = {"py": "Python", "cxx": "C++"}[kind]
            self.assertEqual([l for l in res.out.splitlines() if l.startswith("peer_rank: language ")],
                             [f"peer_rank: language {language}"], f"rank {r} is not the {kind} side:\n{res}")
            self.assertEqual(res.out.count("\nok ") + res.out.startswith("ok "), 8, str(res))
            line = [l for l in res.out.splitlines() if l.startswith("sampler indices ")]
            self.assertEqual(line[0].split()[2:], python_indices(r, world),
                             f"rank {r} ({kind}): sampler indices differ from Python's DistributedSampler")

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_python_rank_0_and_a_cxx_rank(self):
        self.run_layout(["py", "cxx"])

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_cxx_rank_0_hosts_the_store_for_a_python_rank(self):
        self.run_layout(["cxx", "py"])

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_a_job_secret_is_said_not_to_apply_to_pytorchs_store(self):
        self.run_layout(["cxx", "py"], DTRAIN_JOB_SECRET="a-job-secret-of-more-than-32-bytes-0123456789")

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_three_ranks_python_first(self):
        self.run_layout(["py", "cxx", "py"])

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_three_ranks_cxx_first(self):
        self.run_layout(["cxx", "py", "cxx"])

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_python_debug_detail_checks_every_collective_on_every_rank(self):
        # Python wraps each group in c10d's ProcessGroupWrapper: a monitored barrier and a fingerprint
        # comparison through a helper group before every collective; the dtrain rank must take part.
        self.run_layout(["py", "cxx", "py"], TORCH_DISTRIBUTED_DEBUG="DETAIL")

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def refused(self, kind, line, built=True):
        """peer_rank --ddp KIND on rank 1 beside Python's DDP on rank 0: the dtrain rank exits 1 with
        one line containing `line`; the Python rank fails within seconds instead of waiting."""
        cxx = peer_rank()
        py = [needs(VENV_PYTHON, ".venv/bin/python"), os.path.join(HERE, "peer_rank.py"), "--ddp", kind]
        (python, dtrain), _ = self.run_world([py, [cxx, "--ddp", kind]], 60)
        self.assertEqual(dtrain.rc, 1, str(dtrain))
        self.assertIn(line, dtrain.err)
        self.assertEqual(len(dtrain.err.strip().splitlines()), 1, str(dtrain))
        self.assertEqual(python.rc, 3, str(python))
        if built:
            self.assertIn("peer_rank: DDP was built", python.out, str(python))
        self.assertIn("peer_rank: DDP failed", python.out, str(python))
        self.assertLess(python.seconds, 30, f"the Python rank waited instead of failing:\n{python}")
        return python

    def test_a_comm_hook_is_refused_on_the_dtrain_rank_and_python_gets_an_error(self):
        self.refused("hook", "rank 1: DistributedDataParallel::register_comm_hook is not available in a job with "
                             "Python ranks")

    def test_a_model_with_another_layer_count_is_refused_on_both_sides(self):
        python = self.refused("deeper", "rank 1: DistributedDataParallel: this rank has 4 parameters that require "
                                        "grad, rank 0 has 2", built=False)
        self.assertIn("RuntimeError", python.out, str(python))  # Python's own model check

    def test_a_model_with_another_shape_is_refused_on_the_dtrain_rank(self):
        self.refused("wider", "rank 1: DistributedDataParallel: parameter #0 'weight' has sizes [3, 4]", built=False)

    def test_parameters_of_two_dtypes_are_refused_at_the_bucket_rebuild(self):
        self.refused("dtypes", "the parameters have 2 (dtype, device) kinds")

    def test_a_zero_optimizer_in_a_join_is_refused(self):
        self.refused("zero_join", "dtrain::Join: joinable #1 starts rounds of its own")

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_a_hostile_rank_0s_bucket_rebuild_is_refused(self):
        """peer_rank.py --hostile_rebuild KIND as rank 0 sends DDP's calls with a bucket rebuild that is
        no partition of the parameters; the dtrain rank checks every index and size before using one."""
        cxx = peer_rank()
        for kind, line in [("index", "parameter index 5 at position 0"),
                           ("count", "a bucket count of 1073741824"),
                           ("sizes", "bucket 0 of 1073741824 parameters after 0")]:
            with self.subTest(kind=kind):
                py = [needs(VENV_PYTHON, ".venv/bin/python"), os.path.join(HERE, "peer_rank.py"), "--hostile_rebuild",
                      kind]
                (python, dtrain), _ = self.run_world([py, [cxx, "--ddp", "trained"]], 60)
                self.assertEqual(dtrain.rc, 1, str(dtrain))
                self.assertIn("rank 1: DistributedDataParallel with Python ranks: group rank 0 (rank 0) sent a "
                              f"bucket rebuild with {line}, not a partition of the 2 parameters", dtrain.err)
                self.assertEqual(len(dtrain.err.strip().splitlines()), 1, str(dtrain))
                self.assertLess(python.seconds, 30, str(python))

    @unittest.skipUnless(TORCH_MAJOR >= 2, "needs a LibTorch 2.x build (the Python ranks' PyTorch)")
    def test_a_hostile_rank_0s_common_rank_under_join_is_refused(self):
        """peer_rank.py --hostile_join as rank 0 offers group rank 2^20 as the source of the final
        model at the Join's end; the dtrain rank refuses it in one line before broadcasting."""
        py = [needs(VENV_PYTHON, ".venv/bin/python"), os.path.join(HERE, "peer_rank.py"), "--hostile_join"]
        (python, dtrain), _ = self.run_world([py, [peer_rank(), "--ddp", "join"]], 60)
        self.assertEqual(dtrain.rc, 1, str(dtrain))
        self.assertIn("rank 1: DistributedDataParallel under Join: the ranks agreed on group rank 1048576 (the "
                      "largest offer) as the one to take the model from, but the group has 2 ranks (0 to 1)",
                      dtrain.err)
        self.assertEqual(len(dtrain.err.strip().splitlines()), 1, str(dtrain))
        self.assertLess(python.seconds, 30, str(python))

    @unittest.skipUnless(0 < TORCH_MAJOR < 2, "a LibTorch 2.x build joins Python ranks (tested above)")
    def test_libtorch_1_refuses_with_the_remedy(self):
        cxx = peer_rank()
        res = self.run_one([cxx], rank_env(0, 1, free_port()), timeout=60)
        self.assertNotEqual(res.rc, 0, str(res))
        self.assertIn("DTRAIN_PYTORCH_PEERS needs dtrain built against LibTorch 2.x", res.err, str(res))


if __name__ == "__main__":
    unittest.main()
