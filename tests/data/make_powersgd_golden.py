#!/usr/bin/env python3
"""Golden PowerSGD runs from PyTorch's own DDP communication hooks, on 2 Gloo ranks on the CPU.

Run with the PyTorch 2.x of the project's virtual environment:
    .venv/bin/python tests/data/make_powersgd_golden.py > tests/data/powersgd_golden.json
The C++ test (tests/dist/powersgd_golden_test.cpp) trains the same model on the same data through
dtrain's DDP with dtrain's hooks and compares every step with these.

Each case: a small MLP (initial parameters recorded here), DDP with powerSGD_hook or
batched_powerSGD_hook, 5 SGD steps of which the first 2 are PyTorch's plain all-reduce warm-up
(start_powerSGD_iter=2) and the last 3 compressed. Per step it records the averaged gradients and
P and Q of every bucket (where the state keeps them: with warm start); after the last step also
the parameters and each rank's error memory.

The random initial Qs: PyTorch draws them from torch.manual_seed(state.rng.randint(1_000_000_000))
with state.rng = numpy.random.RandomState(random_seed). dtrain draws the same seeds and the same
torch.randn values, so the golden Qs are the ones dtrain starts from; one case (rank >= min(n, m),
min_compression_rate 0) reconstructs every matrix exactly whatever the draw.

batched_powerSGD_hook as shipped (1.13 to 2.x) raises AssertionError at its first compressed step:
it passes its 2-D P and Q to _orthogonalize, which takes a batch of matrices (3-D) since PyTorch
batched the layer-wise hook. This script gives such a 2-D argument a batch dimension of one (a
view, orthogonalized in place), the only change: the computation the hook spells out.
"""
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

WORLD = 2
STEPS = 5
START_ITER = 2
BATCH_PER_RANK = 16
LR = 0.1
# 524 bytes (PyTorch and dtrain both truncate cap_mb * 2**20): buckets [head, c], [b], [a].
SMALL_BUCKET_MB = 0.0005

CASES = [
    # name, hook, bucket_cap_mb (None: one bucket), PowerSGDState options
    ("layerwise_rank2_one_bucket", "powerSGD", None, dict(matrix_approximation_rank=2)),
    ("layerwise_rank2_three_buckets", "powerSGD", SMALL_BUCKET_MB, dict(matrix_approximation_rank=2)),
    # A fresh random Q every step and bucket, epsilon in Gram-Schmidt.
    ("layerwise_rank1_cold_epsilon", "powerSGD", SMALL_BUCKET_MB,
     dict(matrix_approximation_rank=1, warm_start=False, orthogonalization_epsilon=1e-8)),
    # b and c (12 x 12) multiplied as one batch; their random Qs come from one draw.
    ("layerwise_rank2_same_shape_batched", "powerSGD", None,
     dict(matrix_approximation_rank=2, batch_tensors_with_same_shape=True)),
    # Rank 3: QR instead of Gram-Schmidt.
    ("layerwise_rank3_qr", "powerSGD", None, dict(matrix_approximation_rank=3, min_compression_rate=1)),
    # Every tensor compressed (rate 0, biases too) at rank min(n, m): P spans M's columns, so P Q^T
    # is the exact average whatever the random Q.
    ("layerwise_full_rank", "powerSGD", None, dict(matrix_approximation_rank=16, min_compression_rate=0)),
    ("batched_rank1_three_buckets", "batched", SMALL_BUCKET_MB, dict(matrix_approximation_rank=1)),
    ("batched_rank2_cold", "batched", None, dict(matrix_approximation_rank=2, warm_start=False)),
]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)  # 3 x 12: too small to compress at rank 2

    def forward(self, x):
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


_orthogonalize = psgd._orthogonalize


def _orthogonalize_2d_too(matrices, epsilon=0):
    if matrices.dim() == 2:
        matrices = matrices.unsqueeze(0)
    return _orthogonalize(matrices, epsilon)


def initial_parameters():
    torch.manual_seed(0)
    return [p.detach().clone() for p in Net().parameters()]


def step_data():
    g = torch.Generator().manual_seed(1234)
    return [[(torch.randn(BATCH_PER_RANK, 8, generator=g), torch.randn(BATCH_PER_RANK, 3, generator=g))
             for _ in range(WORLD)] for _ in range(STEPS)]


def run_case(rank, case, init, data):
    name, hook_name, cap_mb, options = case
    net = Net()
    with torch.no_grad():
        for p, v in zip(net.parameters(), init):
            p.copy_(v)
    kwargs = {} if cap_mb is None else dict(bucket_cap_mb=cap_mb)
    ddp = nn.parallel.DistributedDataParallel(net, **kwargs)
    state = psgd.PowerSGDState(None, start_powerSGD_iter=START_ITER, random_seed=0, **options)
    hook = psgd.powerSGD_hook if hook_name == "powerSGD" else psgd.batched_powerSGD_hook
    params = list(net.parameters())
    seen_buckets = {}

    def recording_hook(st, bucket):
        # Which parameters each bucket holds (after DDP's rebuild at iteration 1), by index.
        seen_buckets[bucket.index()] = [next(i for i, p in enumerate(params) if p is q) for q in bucket.parameters()]
        # PyTorch issues a bucket's second and third all-reduce in continuations, which run on Gloo's
        # threads as the previous collective completes: with several buckets the two ranks can then
        # issue them in different orders (Gloo fails: "Received data size doesn't match expected
        # size"). Waiting for each bucket's result here keeps one order on both ranks; the values
        # are the same.
        fut = hook(st, bucket)
        fut.wait()
        return fut

    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    steps = []
    for s in range(STEPS):
        x, y = data[s][rank]
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        grads = [p.grad.detach().clone() for p in params]
        opt.step()
        rec = {"grads": grads, "params": [p.detach().clone() for p in params],
               "p": {k: v.clone() for k, v in state.p_memory_dict.items()},
               "q": {k: v.clone() for k, v in state.q_memory_dict.items()},
               "error": {k: v.clone() for k, v in state.error_dict.items()}, "buckets": dict(seen_buckets)}
        steps.append(rec)
    return steps


def worker(rank, store_dir, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=WORLD)
    psgd._orthogonalize = _orthogonalize_2d_too
    init, data = initial_parameters(), step_data()
    results = {case[0]: run_case(rank, case, init, data) for case in CASES}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def floats(t):
    """float32 values as the shortest decimals that read back (strtod, then to float) as themselves."""
    v = t.detach().to(torch.float32).reshape(-1).numpy()
    out = []
    for x in v:
        s = str(x)  # numpy's shortest round-trip form of a float32
        assert np.float32(float(s)) == x, (s, x)
        out.append(float(s))
    return out


def main():
    with tempfile.TemporaryDirectory() as store_dir, tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(store_dir, out_dir), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]
    init, data = initial_parameters(), step_data()
    cases = []
    for name, hook_name, cap_mb, options in CASES:
        per_rank = [r[name] for r in ranks]
        steps = []
        for s in range(STEPS):
            recs = [pr[s] for pr in per_rank]
            # Every rank ends a step with the same gradients and parameters (PowerSGD's result is
            # one on every rank): the golden keeps one copy.
            for r in recs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(r["grads"], recs[0]["grads"])), (name, s)
                assert all(torch.equal(a, b) for a, b in zip(r["params"], recs[0]["params"])), (name, s)
            buckets = sorted(recs[0]["buckets"])
            step = {
                "grads": [floats(g) for g in recs[0]["grads"]],
                "p": {str(b): floats(recs[0]["p"][b]) for b in buckets if b in recs[0]["p"]},
                "q": {str(b): floats(recs[0]["q"][b]) for b in buckets if b in recs[0]["q"]},
            }
            # The parameters follow from the gradients (one SGD step each) and each error memory
            # shows in the next step's gradients: the last step's are enough, and keep the file small.
            if s == STEPS - 1:
                step["params"] = [floats(p) for p in recs[0]["params"]]
                step["error"] = [{str(b): floats(r["error"][b]) for b in buckets if b in r["error"]} for r in recs]
            steps.append(step)
        last = per_rank[0][-1]["buckets"]
        cases.append({"name": name, "hook": hook_name, "bucket_cap_mb": cap_mb,
                      "options": dict(start_powerSGD_iter=START_ITER, **options),
                      "buckets": [last[b] for b in sorted(last)], "steps": steps})
    golden = {
        "torch_version": torch.__version__, "world_size": WORLD, "lr": LR,
        "shapes": [list(p.shape) for p in init], "init": [floats(p) for p in init],
        "data": [[{"x": floats(x), "y": floats(y)} for x, y in step] for step in data],
        "cases": cases,
    }
    json.dump(golden, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
