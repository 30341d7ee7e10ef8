"""dtrain's tensor parallelism against PyTorch's own (parallelize_module with ColwiseParallel and
RowwiseParallel, loss_parallel; .venv's PyTorch 2.x, CPU, Gloo) on 2 ranks: the same weights and
data (tp_reference.cpp and tp_reference.py) give each rank PyTorch's local shard shapes, and its
local outputs, gradients and parameters after 5 Adam steps within 1e-10 (float64), for an MLP
block (Colwise -> Rowwise), a vocab-parallel embedding with a column-parallel head, and a
sequence-parallel block (SequenceParallel LayerNorm and RMSNorm around Colwise -> Rowwise on each
rank's positions; and whole around it through PrepareModuleInput and PrepareModuleOutput), whose
input gradients are compared too.

Env: $TP_REFERENCE (the C++ program), $VENV_PYTHON (set by tests/dist/CMakeLists.txt).
"""
import unittest

from harness import DistTestCase

WORLD = 2


def part_of(whole, whole_shape, shape, rank):
    """This rank's part (torch.chunk's cut along the one dimension where the shapes differ) of a
    flat row-major tensor of whole_shape."""
    dim = next(d for d in range(len(shape)) if shape[d] != whole_shape[d])
    chunk = -(-whole_shape[dim] // WORLD)
    start = rank * chunk
    inner = 1
    for s in whole_shape[dim + 1:]:
        inner *= s
    outer = 1
    for s in whole_shape[:dim]:
        outer *= s
    out = []
    for o in range(outer):
        base = o * whole_shape[dim] * inner
        out.extend(whole[base + start * inner: base + (start + shape[dim]) * inner])
    return out


def worst_relative(mine, ref):
    scale = max(max(abs(v) for v in ref), 1e-6)
    return max(abs(a - b) for a, b in zip(mine, ref)) / scale


class TensorParallelAgainstPytorch(DistTestCase):
    def test_shards_outputs_and_gradients_equal_pytorchs_parallelize_module(self):
        py, cc = self.run_against_python("TP_REFERENCE", "tp_reference", "tp_reference.py", WORLD)
        for r in range(WORLD):
            for model in ("mlp", "lm", "sp", "spio"):
                p, c = py[r][model], cc[r][model]
                where = f"rank {r} {model}"
                self.assertEqual(c["shapes"], p["shapes"], f"{where}: local shard shapes")
                self.assertEqual(len(c["output"]), len(p["output"]), f"{where}: local output size")
                self.assertLess(worst_relative(c["output"], p["output"]), 1e-10, f"{where}: output")
                if "input_grad" in p:
                    self.assertEqual(len(c["input_grad"]), len(p["input_grad"]), f"{where}: input grad size")
                    worst = worst_relative(c["input_grad"], p["input_grad"])
                    self.assertLess(worst, 1e-10, f"{where}: input grad: relative difference {worst:.3g}")
                for kind in ("grads", "params"):
                    self.assertEqual(sorted(c[kind]), sorted(p[kind]), f"{where}: {kind}")
                    for name, ref in p[kind].items():
                        # PyTorch 2.15 gives the vocab-parallel embedding's weight a Replicate
                        # gradient (the whole of it on every rank) where dtrain keeps this rank's
                        # rows: compare those rows.
                        if kind == "grads" and p["grad_shapes"][name] != p["shapes"][name]:
                            ref = part_of(ref, p["grad_shapes"][name], c["shapes"][name], r)
                        self.assertEqual(len(c[kind][name]), len(ref), f"{where} {kind} {name}")
                        worst = worst_relative(c[kind][name], ref)
                        self.assertLess(worst, 1e-10, f"{where} {kind} {name}: relative difference {worst:.3g}")


if __name__ == "__main__":
    unittest.main()
