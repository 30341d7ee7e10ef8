"""examples/llm/train_llm against its PyTorch twin (llama_twin.py, .venv's PyTorch 2.x, CPU, Gloo), in
float64 on a shrunk debug model: the twin starts from the weights train_llm exports before its first
step (--checkpoint.export_initial) and reads the same windows of the same token file in the same
order (torch.utils.data.DistributedSampler, the sampler dtrain's replicates).

  * 1 process: every step's loss, learning rate and clipped gradient norm equal the twin's within 1e-10;
  * 2 ranks: dtrain's fully_shard equals PyTorch's own fully_shard (FSDP2) on 2 Gloo ranks, step by step;
  * fully_shard 2 x tp 2 on 4 ranks writes a DCP checkpoint that torch.distributed.checkpoint's
    dcp.load reads into the twin's state dict, equal within 1e-10 to the twin's parameters after the
    same steps on one process with the whole global batch (and the losses agree on the way); the
    whole final model it exports (--checkpoint.export_final, gathered by rank 0) read by safetensors'
    load_file equals them too.

Env: $TRAIN_LLM, $DTRAIN_RUN, $VENV_PYTHON, $LLM_CORPUS (set by tests/dist/CMakeLists.txt).
"""
import glob
import json
import os
import tempfile
import unittest

from harness import ROOT, DistTestCase, clean_env, launcher
from test_train_llm import CONFIG, RUN_TIMEOUT_S, train_llm

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-10
STEPS = 8
# Flags both programs read alike: a model small enough for a few seconds, warmup then cosine decay
# within the run, and clipping that bites (max_norm below the first steps' norms).
MODEL = ("--job.config_file", CONFIG, "--model.dim", 32, "--model.n_layers", 2, "--model.n_heads", 4,
         "--model.ffn_hidden", 64, "--training.seq_len", 32, "--training.steps", STEPS,
         "--training.dtype", "float64", "--training.max_norm", 0.5, "--lr_scheduler.warmup_steps", 2,
         "--optimizer.lr", 0.01)
# train_llm alone: what the twin has no use for, kept short.
DTRAIN_ONLY = ("--training.threads", 1, "--metrics.log_freq", 1, "--validation.max_windows", 4,
               "--validation.sample_tokens", 1)


class LlamaTwin(DistTestCase):
    def setUp(self):
        super().setUp()
        self.python = os.environ.get("VENV_PYTHON", "")
        if not self.python or not os.access(self.python, os.X_OK):
            raise unittest.SkipTest(f".venv's python is missing ({self.python!r}): run scripts/setup.sh")
        self.corpus = os.environ.get("LLM_CORPUS") or os.path.join(ROOT, "data", "shakespeare")
        self.assertTrue(os.path.isdir(self.corpus), f"no corpus at {self.corpus}: run scripts/setup.sh")
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name
        self.data = ("--data.corpus_dir", self.corpus, "--data.cache_dir", os.path.join(self.tmp, "tokens"))

    def dtrain(self, nproc, *args):
        """train_llm on nproc ranks; its metrics.jsonl lines and the initial weights' file."""
        dump, initial = os.path.join(self.tmp, "dtrain"), os.path.join(self.tmp, "initial.safetensors")
        res = self.run_one([launcher(), "--standalone", "--nproc_per_node", nproc, "--grace_period", 2, train_llm(),
                            *MODEL, *self.data, *DTRAIN_ONLY, "--job.dump_folder", dump,
                            "--checkpoint.export_initial", initial, *args],
                           clean_env(DTRAIN_TIMEOUT_S=60), timeout=RUN_TIMEOUT_S)
        self.assertEqual(res.rc, 0, str(res))
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], initial

    def twin(self, world, initial, *args):
        out = os.path.join(self.tmp, "twin.json")
        return self.run_ranks_json([self.python, os.path.join(HERE, "llama_twin.py"), "--twin.initial", initial,
                                    *MODEL, *self.data, *args], world, out, timeout=RUN_TIMEOUT_S)

    def assert_same_steps(self, mine, twin):
        self.assertEqual([m["step"] for m in mine], list(range(1, STEPS + 1)))
        for key in ("loss", "lr", "grad_norm"):
            ours = [m[key] for m in mine]
            worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours, twin[key]))
            self.assertLess(worst, TOL, f"{key}: dtrain {ours}\ntwin   {twin[key]}\nrelative difference {worst:.3g}")
        # The checks bite: the run learns and the clipping acts.
        self.assertLess(twin["loss"][-1], twin["loss"][0] - 0.5, twin["loss"])
        self.assertGreater(max(twin["grad_norm"]), 0.5, twin["grad_norm"])

    def test_one_process_steps_equal_the_twins(self):
        mine, initial = self.dtrain(1, "--training.local_batch_size", 8)
        self.assert_same_steps(mine, self.twin(1, initial, "--training.local_batch_size", 8))

    def test_fully_shard_on_2_ranks_equals_pytorchs_fully_shard(self):
        mine, initial = self.dtrain(2, "--training.local_batch_size", 4)
        self.assert_same_steps(mine, self.twin(2, initial, "--training.local_batch_size", 4))

    def test_dcp_of_fully_shard_x_tp_loads_into_the_twin(self):
        # 2 data-parallel ranks of 4 windows read the first 8 of the shuffle as one rank of 8 does.
        final = os.path.join(self.tmp, "final.safetensors")
        mine, initial = self.dtrain(4, "--parallelism.data_parallel_shard_degree", 2,
                                    "--parallelism.tensor_parallel_degree", 2, "--training.local_batch_size", 4,
                                    "--checkpoint.enable", "true", "--checkpoint.async_mode", "disabled",
                                    "--checkpoint.interval", STEPS, "--checkpoint.export_final", final)
        folders = [os.path.dirname(p) for p in glob.glob(os.path.join(self.tmp, "dtrain", "checkpoint", "**",
                                                                      ".metadata"), recursive=True)]
        self.assertEqual(len(folders), 1, f"one DCP folder expected: {folders}")
        twin = self.twin(1, initial, "--training.local_batch_size", 8, "--twin.dcp", folders[0], "--twin.final", final)
        self.assert_same_steps(mine, twin)
        # The DCP folder, and the whole model rank 0 gathered into one safetensors file at the end.
        for key, what in (("dcp", "dcp.load of dtrain's 2-D checkpoint"),
                          ("final", "safetensors' load_file of --checkpoint.export_final")):
            got = twin[key]
            self.assertEqual(got["missing"], [], f"{what}: names differ from the twin's state dict")
            self.assertEqual(len(got["shapes"]), 1 + 2 * 9 + 2)
            for name, (mine_shape, loaded_shape) in got["shapes"].items():
                self.assertEqual(mine_shape, loaded_shape, f"{name}: {what}")
            self.assertEqual(set(got["max_abs_diff"]), set(got["shapes"]))
            for name, diff in got["max_abs_diff"].items():
                self.assertLess(diff / got["max_abs"][name], TOL, f"{name}: {what}")


if __name__ == "__main__":
    unittest.main()
