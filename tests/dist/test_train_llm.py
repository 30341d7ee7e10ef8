"""examples/llm/train_llm: the LLM recipe on 2 real ranks, with the debug config shrunk by flags.

  * fully_shard (dp_shard 2, 4 windows per rank), tensor parallelism (tp 2, one data-parallel rank
    reading all 8) and pipeline parallelism (pp 2, 1F1B over 2 micro-batches of 4 windows) learn on the
    Shakespeare corpus: the loss falls, metrics.jsonl has every metric with one entry per rank, and all
    take the same steps (the same global batch of windows, the same clipped gradient norm, the
    pipeline's summed over its stages): their losses agree to float rounding;
  * a run stopped at step 4 with a checkpoint and resumed ends bit for bit as a run never stopped
    (the same loss_bits and validation loss): the loader's position is in the checkpoint;
  * degrees whose product is not the world, a pipeline schedule train_llm lacks, and checkpoints under
    pipeline parallelism are refused in one line.

Binaries: $TRAIN_LLM and $DTRAIN_RUN (set by tests/dist/CMakeLists.txt), else build*/bin. The corpus:
$LLM_CORPUS, else data/shakespeare (scripts/setup.sh installs it).
"""
import json
import os
import re
import tempfile
import unittest

from harness import ROOT, DistTestCase, binary, clean_env, launcher

RESULT_RE = re.compile(r"^(?:\[rank 0\] )?RESULT steps=(\d+) final_loss=([0-9.]+) loss_bits=(\S+) "
                       r"val_loss=([0-9.]+) val_ppl=([0-9.]+)$", re.M)
CONFIG = os.path.join(ROOT, "examples", "llm", "configs", "debug.toml")
# The debug model made smaller and shorter: a few seconds on 2 ranks.
SHRUNK = ("--model.dim", 64, "--model.n_layers", 2, "--model.n_heads", 4, "--model.ffn_hidden", 128,
          "--training.seq_len", 64, "--training.steps", 8, "--training.threads", 1, "--lr_scheduler.warmup_steps", 2,
          "--metrics.log_freq", 1, "--validation.max_windows", 16, "--validation.sample_tokens", 16,
          "--optimizer.lr", 0.01)
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_total", "peak_rss_mib"}
RUN_TIMEOUT_S = 120


def train_llm():
    path = binary("TRAIN_LLM", "train_llm")
    if not path:
        raise unittest.SkipTest("train_llm is not built (it needs libtomlplusplus-dev; or set TRAIN_LLM)")
    return path


class TrainLlm(DistTestCase):
    def setUp(self):
        super().setUp()
        self.corpus = os.environ.get("LLM_CORPUS") or os.path.join(ROOT, "data", "shakespeare")
        self.assertTrue(os.path.isdir(self.corpus), f"no corpus at {self.corpus}: run scripts/setup.sh")
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def launch(self, dump, *args, rc=0):
        res = self.run_one([launcher(), "--standalone", "--nproc_per_node", 2, "--grace_period", 2, train_llm(),
                            "--job.config_file", CONFIG, "--data.corpus_dir", self.corpus,
                            "--data.cache_dir", os.path.join(self.tmp, "tokens"),
                            "--job.dump_folder", os.path.join(self.tmp, dump), *SHRUNK, *args],
                           clean_env(DTRAIN_TIMEOUT_S=60), timeout=RUN_TIMEOUT_S)
        self.assertEqual(res.rc, rc, str(res))
        if rc != 0:
            return res, None
        m = RESULT_RE.search(res.out)
        self.assertIsNotNone(m, f"no RESULT line:\n{res}")
        return res, m

    def metrics(self, dump):
        with open(os.path.join(self.tmp, dump, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    def test_fsdp_and_tp_learn_the_same_steps(self):
        runs = {"dp_shard": ("--parallelism.data_parallel_shard_degree", 2, "--training.local_batch_size", 4),
                "tp": ("--parallelism.data_parallel_shard_degree", 1, "--parallelism.tensor_parallel_degree", 2,
                       "--training.local_batch_size", 8),
                "pp": ("--parallelism.data_parallel_shard_degree", 1, "--parallelism.pipeline_parallel_degree", 2,
                       "--training.local_batch_size", 8, "--parallelism.pipeline_parallel_microbatch_size", 4)}
        losses = {}
        for name, args in runs.items():
            with self.subTest(parallelism=name):
                res, m = self.launch(name, *args)
                self.assertIn("validation: loss", res.out)
                self.assertIn("sample (greedy", res.out)
                lines = self.metrics(name)
                self.assertEqual([x["step"] for x in lines], list(range(1, 9)))
                for x in lines:
                    self.assertEqual(set(x), METRIC_KEYS, x)
                    self.assertEqual(len(x["tokens_per_s"]), 2, x)
                    self.assertEqual(len(x["peak_rss_mib"]), 2, x)
                    self.assertTrue(all(v > 0 for v in x["tokens_per_s"] + x["peak_rss_mib"]), x)
                    self.assertGreater(x["tokens_per_s_total"], 0, x)
                self.assertLess(lines[-1]["loss"], lines[0]["loss"] - 0.5, f"the loss did not fall:\n{res}")
                self.assertAlmostEqual(float(m.group(2)), lines[-1]["loss"], places=5)
                losses[name] = [(x["loss"], x["grad_norm"]) for x in lines]
        for other in ("tp", "pp"):
            for (a, ga), (b, gb) in zip(losses["dp_shard"], losses[other]):
                self.assertAlmostEqual(a, b, delta=1e-4 * a, msg=f"fully_shard and {other} steps differ: {losses}")
                self.assertAlmostEqual(ga, gb, delta=1e-3 * ga, msg=f"the global gradient norms differ: {losses}")

    def test_resume_is_bit_exact(self):
        common = ("--parallelism.data_parallel_shard_degree", 2, "--training.local_batch_size", 4,
                  "--activation_checkpoint.mode", "full")
        _, whole = self.launch("whole", *common)
        ckpt = ("--checkpoint.enable", "true", "--checkpoint.interval", 2)
        _, first = self.launch("resumed", *common, *ckpt, "--training.stop_at_step", 4)
        self.assertEqual(first.group(1), "4")
        res, resumed = self.launch("resumed", *common, *ckpt)
        self.assertIn("resumed from", res.out)
        self.assertEqual(resumed.group(1), "8")
        self.assertEqual((resumed.group(3), resumed.group(4)), (whole.group(3), whole.group(4)),
                         f"the resumed run differs from the whole one:\n{res}")

    def test_bad_degrees_are_refused_in_one_line(self):
        cases = {("--parallelism.tensor_parallel_degree", 4, "--parallelism.data_parallel_shard_degree", 1):
                 "data_parallel_replicate_degree 1 x data_parallel_shard_degree 1 x tensor_parallel_degree 4 = 4, "
                 "but the world has 2 rank(s)",
                 ("--parallelism.pipeline_parallel_degree", 2, "--parallelism.pipeline_parallel_schedule",
                  "Interleaved1F1B"): "parallelism.pipeline_parallel_schedule Interleaved1F1B: use GPipe, 1F1B or "
                                      "ZeroBubbleH1",
                 ("--parallelism.pipeline_parallel_degree", 2, "--checkpoint.enable", "true"):
                 "pipeline_parallel_degree 2: checkpoints of pipeline stages are not in train_llm yet"}
        for args, text in cases.items():
            with self.subTest(args=args):
                res, _ = self.launch("bad", *args, rc=1)
                errors = [line for line in res.err.splitlines() if "train_llm: error:" in line]
                self.assertTrue(errors and all(text in line for line in errors), str(res))


if __name__ == "__main__":
    unittest.main()
