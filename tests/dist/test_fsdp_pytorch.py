"""dtrain's fully_shard against PyTorch's own (FSDP2, .venv's PyTorch 2.x, CPU, Gloo) on 2 ranks:
the same model, data and optimizers (fsdp_reference.cpp and fsdp_reference.py) give each rank the
local shard shapes FSDP2's to_local() gives, and whole parameters within 1e-10 (float64) after 20
steps of SGD with momentum and of Adam; and on 4 ranks HSDP, both on a 2-D (replicate 2, shard 2)
mesh.

Env: $FSDP_REFERENCE (the C++ program), $VENV_PYTHON (set by tests/dist/CMakeLists.txt).
"""
import os
import tempfile
import unittest

from harness import DistTestCase, binary

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_PYTHON = os.environ.get("VENV_PYTHON", "")
WORLD = 2


class FsdpAgainstPytorch(DistTestCase):
    def run_side(self, argv, folder, tag, world, **env):
        return self.run_ranks_json(argv, world, [os.path.join(folder, f"{tag}{r}.json") for r in range(world)], **env)

    def compare(self, world, **env):
        if not VENV_PYTHON or not os.access(VENV_PYTHON, os.X_OK):
            raise unittest.SkipTest(f".venv's python is missing ({VENV_PYTHON!r}): run scripts/setup.sh")
        cxx = binary("FSDP_REFERENCE", "fsdp_reference")
        with tempfile.TemporaryDirectory() as folder:
            py = self.run_side([VENV_PYTHON, os.path.join(HERE, "fsdp_reference.py")], folder, "py", world, **env)
            cc = self.run_side([cxx], folder, "cxx", world, **env)
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
