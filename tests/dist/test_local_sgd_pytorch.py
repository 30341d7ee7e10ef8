"""dtrain's LocalSGD and DiLoCo against torchft's algorithms written on torch.distributed (.venv's
PyTorch 2.x, CPU, Gloo) on 2 replicas, each on its own data: the same model, data and optimizers
(local_sgd_reference.cpp and local_sgd_reference.py) give every parameter within 1e-10 (float64)
after 200 steps of LocalSGD (sync_every 5), DiLoCo (sync_every 5, inner AdamW or SGD, outer Nesterov
SGD), streaming DiLoCo (2 fragments, sync_every 4) and its overlapped form (torchft's
fragment_sync_delay, with and without fragment_update_alpha) and DiLoCo syncing in bfloat16; after the last sync of LocalSGD and DiLoCo
(step 200) both replicas hold the same parameters.

Env: $LOCAL_SGD_REFERENCE (the C++ program), $VENV_PYTHON (set by tests/dist/CMakeLists.txt).
"""
import unittest

from harness import DistTestCase

WORLD = 2
KINDS = ("localsgd", "diloco", "diloco_sgd", "streaming", "streaming_delay", "diloco_delay_alpha", "diloco_bf16")


def worst_difference(mine, ref):
    worst = 0.0
    for name, r in ref.items():
        scale = max(max(abs(v) for v in r), 1e-6)
        worst = max(worst, max(abs(a - b) for a, b in zip(mine[name], r)) / scale)
    return worst


class LocalSgdAgainstTorchft(DistTestCase):
    def test_parameters_equal_torchfts_algorithms_on_2_replicas(self):
        py, cc = self.run_against_python("LOCAL_SGD_REFERENCE", "local_sgd_reference", "local_sgd_reference.py", WORLD)
        for r in range(WORLD):
            for kind in KINDS:
                p, c = py[r][kind]["params"], cc[r][kind]["params"]
                self.assertEqual(sorted(c), sorted(p), f"rank {r} {kind}")
                for name in p:
                    self.assertEqual(len(c[name]), len(p[name]), f"rank {r} {kind} {name}")
                worst = worst_difference(c, p)
                print(f"rank {r} {kind}: largest relative difference to the reference {worst:.3g}")
                self.assertLess(worst, 1e-10, f"rank {r} {kind}: relative difference {worst:.3g}")
        # The replicas trained apart (their own data) and met at step 200.
        for kind in ("localsgd", "diloco", "diloco_sgd", "diloco_bf16"):
            self.assertLess(worst_difference(cc[1][kind]["params"], cc[0][kind]["params"]), 1e-15, kind)
        self.assertGreater(worst_difference(cc[1]["streaming"]["params"], cc[0]["streaming"]["params"]), 1e-6,
                           "streaming: the fragment not synced at step 200 differs between replicas")


if __name__ == "__main__":
    unittest.main()
