"""bench/bench_llm.py's parts that a short run can check: the allocator count it preloads into
train_llm's ranks (build/lib/libllm_tensor_bytes.so) sees the training's tensors on both ranks and
full activation checkpointing lowers their peak, on a tiny model; and the rates leave the warm-up
steps out. The speed rounds (the twin under FSDP2) are the benchmark's own run: PyTorch's import
alone takes longer than this test may. The numbers' goals are docs/benchmarks.md's business.

Env: $BENCH_LLM_BUILD (the build tree, set by tests/dist/CMakeLists.txt), $LLM_CORPUS.
"""
import os
import sys
import tempfile
import unittest

from harness import ROOT, DistTestCase

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_llm  # noqa: E402

TINY = ["--dim", "32", "--n_layers", "2", "--n_heads", "4", "--ffn_hidden", "64", "--mem_batch", "8", "--mem_seq",
        "128", "--mem_steps", "1", "--timeout", "60"]


class BenchLlm(DistTestCase):
    def test_tensor_bytes_count_sees_the_activations(self):
        build = os.environ.get("BENCH_LLM_BUILD", "")
        if not build:
            raise unittest.SkipTest("run by ctest: $BENCH_LLM_BUILD names the build tree")
        corpus = os.environ.get("LLM_CORPUS") or os.path.join(ROOT, "data", "shakespeare")
        a = bench_llm.parse_args(["--build", build, "--python", sys.executable, "--corpus", corpus, *TINY])
        with tempfile.TemporaryDirectory() as tmp:
            b = bench_llm.Bench(a, tmp)
            none, _ = b.memory("none")
            full, _ = b.memory("full")
        # Above train_llm's 3 MB matmul probe: the count saw the training's activations.
        self.assertGreater(none, 8 << 20, (none, full))
        self.assertLess(full, 0.8 * none, (none, full))

    def test_warmup_steps_are_left_out(self):
        lines = ['{"step": 1, "tokens_per_s_total": 10.0, "mfu": 0.01}\n',
                 '{"step": 2, "tokens_per_s_total": 100.0, "mfu": 0.1}\n',
                 '{"step": 3, "tokens_per_s_total": 300.0, "mfu": 0.3}\n']
        tps, mfu = bench_llm.dtrain_rates(lines, warmup=1)
        self.assertAlmostEqual(tps, 150.0)  # two steps of equal tokens: 2 / (1/100 + 1/300)
        self.assertAlmostEqual(mfu, 0.15)
        self.assertAlmostEqual(bench_llm.twin_rate({"step_s": [9.0, 1.0, 3.0]}, 1, 100), 50.0)
        with self.assertRaisesRegex(ValueError, "none after the 3 warm-up steps"):
            bench_llm.dtrain_rates(lines, warmup=3)


if __name__ == "__main__":
    unittest.main()
