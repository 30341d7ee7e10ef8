"""dtrain's fully_shard against PyTorch's own (FSDP2, .venv's PyTorch 2.x, CPU, Gloo) on 2 ranks:
the same model, data and optimizers (fsdp_reference.cpp and fsdp_reference.py) give each rank the
local shard shapes FSDP2's to_local() gives, and whole parameters within 1e-10 (float64) after 20
steps of SGD with momentum and of Adam; and on 4 ranks HSDP, both on a 2-D (replicate 2, shard 2)
mesh.

Env: $FSDP_REFERENCE (the C++ program), $VENV_PYTHON (set by tests/dist/CMakeLists.txt).
"""
import unittest

from harness import DistTestCase

WORLD = 2


class FsdpAgainstPytorch(DistTestCase):
    def compare(self, world, **env):
        py, cc = self.run_against_python("FSDP_REFERENCE", "fsdp_reference", "fsdp_reference.py", world, **env)
        for r in range(world):
            for kind in ("sgd", "adam"):
                p, c = py[r][kind], cc[r][kind]
                self.assertEqual(c["shapes"], p["shapes"], f"rank {r} {kind}: local shard shapes")
                self.assertEqual(sorted(c["params"]), sorted(p["params"]))
                for name, ref in p["params"].items():
                    mine = c["params"][name]
                    self.assertEqual(len(mine), len(ref), name)
                    scale = max(max(abs(v) for v in ref), 1e-6)
                    worst = max(abs(a - b) for a, b in zip(mine, ref)) / scale
                    self.assertLess(worst, 1e-10, f"rank {r} {kind} {name}: relative difference {worst:.3g}")

    def test_shards_and_parameters_equal_pytorchs_fully_shard(self):
        self.compare(WORLD)

    def test_hsdp_on_a_2x2_mesh_equals_pytorchs(self):
        self.compare(4, FSDP_REFERENCE_HSDP="1")


if __name__ == "__main__":
    unittest.main()
