"""libdtrain_c (include/dtrain_c.h) driven from Python with ctypes, on PyTorch 2.x tensors: the way a
binding in another language uses it. tests/dist/c_api_rank.py runs on 2 ranks twice: through the C
API (dtrain's DDP over the Python tensors, PyTorch's autograd running backward, no_sync steps among
them) and with PyTorch's own DistributedDataParallel. The parameters must agree within 1e-10 on
every rank, both ranks must hold the same bits, the collectives give what torch.distributed's do,
and a safetensors checkpoint reads back exactly. Also through the C API: send/recv, the sampler's
indices (equal to torch's DistributedSampler's), GradScaler's skip agreed over the ranks, and
fully_shard over the Python tensors (with clip_grad_norm_ over the shards) equal to a one-process run
within 1e-10, its DCP checkpoint read by torch.distributed.checkpoint. tests/dist/c_api_zero_rank.py:
ZeroRedundancyOptimizer (SGD, Adam, AdamW) through the C API equal to PyTorch's within 1e-10, its saved
state resuming bit for bit, and the CheckpointManager of named tensors (rotation, load_latest, an async
save, the newest folder read by torch.distributed.checkpoint).

One process holds one LibTorch: this runs only where libdtrain_c links the LibTorch of .venv's torch
(build-torch2/); a LibTorch 1.13 tree skips it.

Env: $DTRAIN_C_LIB (libdtrain_c), $VENV_PYTHON, $DTRAIN_TORCH_MAJOR (set by tests/dist/CMakeLists.txt).
"""
import os
import tempfile
import unittest

from harness import DistTestCase

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 1e-10
WORLD = 2


class CApi(DistTestCase):
    def setUp(self):
        if int(os.environ.get("DTRAIN_TORCH_MAJOR", "0")) < 2:
            self.skipTest("libdtrain_c links LibTorch 1.13 here; .venv's torch is 2.x, and one process holds one "
                          "LibTorch (build-torch2/ runs this)")
        self.python = os.environ.get("VENV_PYTHON", "")
        if not self.python or not os.access(self.python, os.X_OK):
            self.fail(f".venv's python is missing ({self.python!r}): run scripts/setup.sh")
        self.lib = os.environ.get("DTRAIN_C_LIB", "")
        self.assertTrue(os.path.isfile(self.lib), f"libdtrain_c is not built ({self.lib!r})")

    def run_mode(self, mode, script="c_api_rank.py"):
        with tempfile.TemporaryDirectory() as folder:
            outs = [os.path.join(folder, f"{mode}{r}.json") for r in range(WORLD)]
            return self.run_ranks_json([self.python, os.path.join(HERE, script), mode], WORLD, outs,
                                       timeout=120, DTRAIN_C_LIB=self.lib, DTRAIN_TIMEOUT_S="60")

    def test_ddp_through_the_c_api_equals_pytorch_ddp(self):
        capi = self.run_mode("capi")
        torch_ddp = self.run_mode("torch")
        self.assertEqual(capi[0]["params"], capi[1]["params"], "the ranks' parameters differ: no average?")
        for r in range(WORLD):
            a, b = capi[r]["params"], torch_ddp[r]["params"]
            self.assertEqual(len(a), len(b))
            worst = max(abs(x - y) for x, y in zip(a, b))
            self.assertLessEqual(worst, TOLERANCE, f"rank {r}: C API vs PyTorch DDP differ by {worst}")
            print(f"rank {r}: C API vs PyTorch DDP: largest parameter difference {worst:.3g}")
            # Under no_sync the gradients stay each rank's own, as PyTorch's (an average would also end
            # in the same parameters, so the parameters alone cannot tell).
            self.assertEqual(len(capi[r]["no_sync_grads"]), len(torch_ddp[r]["no_sync_grads"]))
            for x, y in zip(capi[r]["no_sync_grads"], torch_ddp[r]["no_sync_grads"]):
                self.assertLessEqual(abs(x - y), TOLERANCE, f"rank {r}: a no_sync step's gradients differ")
        for x, y in zip(capi[0]["no_sync_grads"], capi[1]["no_sync_grads"]):
            self.assertNotEqual(x, y, "no_sync averaged the gradients over the ranks")
            # Training moved them: a DDP that averaged nothing would still agree with itself.
            self.assertTrue(capi[r]["safetensors_roundtrip"], f"rank {r}: the checkpoint read back differs")

    def test_collectives_give_torch_distributed_results(self):
        capi = self.run_mode("capi")
        for r, res in enumerate(capi):
            c = res["collectives"]
            self.assertEqual(res["abi"], 1)
            self.assertEqual((res["rank"], res["world"]), (r, WORLD))
            self.assertEqual(c["all_reduce_sum"], [3.0] * 4)
            self.assertEqual(c["all_reduce_avg"], [1.5] * 4)
            self.assertEqual(c["all_reduce_avg_async_done"], 1)
            self.assertEqual(c["broadcast"], [10.0] * 3)
            self.assertEqual(c["all_gather_into_tensor"], [0.0, 1.0, 2.0, 3.0])
            # rank k's input is arange(4) * (k + 1): the sum is arange(4) * 3, rank r gets part r.
            self.assertEqual(c["reduce_scatter_tensor"], [3.0 * (2 * r), 3.0 * (2 * r + 1)])
            self.assertEqual(c["group_size"], WORLD)
            # send/recv: rank 0 to rank 1 (from any sender), rank 1 back with 100 added (a tagged isend/irecv).
            self.assertEqual(res["p2p"]["tensor"], [100.0, 101.0, 102.0])
            if r == 1:
                self.assertEqual(res["p2p"]["sender"], 0)
            for ours, torchs in res["sampler"]:
                self.assertEqual(ours, torchs, f"rank {r}: the sampler's indices differ from DistributedSampler's")
            # An inf on rank 1 only: both ranks skip the second step and back off together.
            self.assertEqual(res["scaler"]["decisions"], [1, 0], f"rank {r}: GradScaler's step decisions")
            self.assertEqual(res["scaler"]["scales"], [65536.0, 32768.0])

    def test_fully_shard_through_the_c_api_equals_one_process(self):
        runs = self.run_mode("fsdp")
        for r, res in enumerate(runs):
            # The caller's tensors hold this rank's rows: 15 rows are 8 + 7, 4 are 2 + 2.
            self.assertEqual(res["shard_rows"], [[8, 7][r], [8, 7][r], 2, 2])
            worst = max(abs(x - y) for x, y in zip(res["params"], res["reference"]))
            self.assertLessEqual(worst, TOLERANCE, f"rank {r}: C API fully_shard vs one process differ by {worst}")
            print(f"rank {r}: C API fully_shard vs one process: largest parameter difference {worst:.3g}")
            for name, params in res["variants"].items():
                worst = max(abs(x - y) for x, y in zip(params, res["reference"]))
                self.assertLessEqual(worst, TOLERANCE, f"rank {r}: fully_shard {name} vs one process differ by {worst}")
            for ours, torchs in zip(res["norms"], res["reference_norms"]):
                self.assertLessEqual(abs(ours - torchs), TOLERANCE, f"rank {r}: clip_grad_norm_'s total norm differs")
            self.assertGreater(min(res["reference_norms"]), 0.05, "the norms never exceed max_norm: nothing clipped")
            self.assertTrue(res["dcp_c_roundtrip"], f"rank {r}: dtrain_c_dcp_load did not restore the shards")
            self.assertEqual(res["dcp_torch"], res["params"],
                             f"rank {r}: torch.distributed.checkpoint read other values than were saved")
        self.assertEqual(runs[0]["params"], runs[1]["params"])

    def assert_one_error_line(self, got, status, text):
        self.assertEqual(got[0], status, f"status of {got[1]!r}")
        self.assertIn(text, got[1])
        self.assertNotIn("\n", got[1], "an error is one line")

    def test_zero_through_the_c_api_equals_pytorch_zero(self):
        capi = self.run_mode("zero_capi", "c_api_zero_rank.py")
        torch_zero = self.run_mode("zero_torch", "c_api_zero_rank.py")
        for r in range(WORLD):
            for name in ("sgd", "adam", "adamw"):
                a, b = capi[r][name]["params"], torch_zero[r][name]["params"]
                self.assertEqual(len(a), len(b))
                worst = max(abs(x - y) for x, y in zip(a, b))
                self.assertLessEqual(worst, TOLERANCE, f"rank {r}: C API ZeRO {name} vs PyTorch's differ by {worst}")
                print(f"rank {r}: C API ZeRO {name} vs PyTorch ZeroRedundancyOptimizer: largest parameter "
                      f"difference {worst:.3g}")
                self.assertTrue(capi[r][name]["resumed_equal"],
                                f"rank {r}: {name}: a ZeRO loaded from the saved state stepped otherwise")
                self.assertEqual(capi[r][name]["loaded_lr"], dict(sgd=0.025, adam=0.005, adamw=0.005)[name])
            bad = capi[r]["bad_input"]
            self.assert_one_error_line(bad["null_step"], 2, "dtrain_c_zero_step on rank")
            self.assert_one_error_line(bad["null_step"], 2, "zero is NULL")
            self.assert_one_error_line(bad["unknown_optimizer"], 1, "optimizer is 'lamb'")
            self.assert_one_error_line(bad["other_dtype"], 1, "params[2] is Float but params[0] is Double")
            self.assert_one_error_line(bad["bad_default"], 1, "optimizer is 'rmsprop'")
        for name in ("sgd", "adam", "adamw"):
            self.assertEqual(capi[0][name]["params"], capi[1][name]["params"], f"{name}: the ranks' parameters differ")

    def test_checkpoint_manager_of_named_tensors(self):
        runs = self.run_mode("ckpt", "c_api_zero_rank.py")
        for r, res in enumerate(runs):
            self.assertEqual(res["empty_load"], [0, -1], f"rank {r}: an empty folder loaded something")
            self.assertEqual(res["saved"], [0, 1, 0, 1, 0, 1, 0], f"rank {r}: interval 2 saved other steps")
            self.assertEqual(res["files_after_saves"], ["checkpoint_0000000004.dcp", "checkpoint_0000000004.pt",
                                                        "checkpoint_0000000006.dcp", "checkpoint_0000000006.pt"])
            self.assertEqual(res["load"], [1, 6])
            self.assertTrue(res["load_equal"], f"rank {r}: load_latest did not restore step 6's bits")
            self.assertEqual(res["async_load"], [1, 8])
            self.assertTrue(res["async_equal"], f"rank {r}: the async save did not hold the tensors at its call")
            self.assertEqual(res["files_after_async"], ["checkpoint_0000000006.dcp", "checkpoint_0000000006.pt",
                                                        "checkpoint_0000000008.dcp", "checkpoint_0000000008.pt"])
            self.assertTrue(res["dcp_torch_equal"], f"rank {r}: torch.distributed.checkpoint read other values")
            bad = res["bad_input"]
            self.assert_one_error_line(bad["null_save"], 2, "checkpoint is NULL")
            self.assert_one_error_line(bad["empty_part"], 1, "name 'fc1..weight' has an empty part")
            self.assert_one_error_line(bad["wrong_shape"], 5, "fc1.weight")
            self.assertTrue(bad["wrong_shape_untouched"], f"rank {r}: a refused load changed the tensors")


if __name__ == "__main__":
    unittest.main()
