#!/usr/bin/env python3
"""Golden parameter partitions of PyTorch's ZeroRedundancyOptimizer, for models with uneven sizes.

Run with the PyTorch 2.x of the project's virtual environment:
    .venv/bin/python tests/data/make_zero_partition_golden.py > tests/data/zero_partition_golden.json
The C++ test (tests/dist/zero_partition_test.cpp) builds tensors of the recorded shapes, in the
recorded order, and compares dtrain's owners() and each rank's share with these.

The partition depends on the parameters' sizes and order and the world size only, so one process
computes it for every world size over the "fake" process group (no collectives run): per model and
world size, each parameter's owner (ZeroRedundancyOptimizer._param_to_rank) and each rank's share
in the order its local optimizer holds it (_partition_parameters()).
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZES = [1, 2, 3, 4]


def models():
    torch.manual_seed(0)
    return {
        "mlp": nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU(), nn.Linear(5, 1)),
        # Many equal sizes (the sort must keep their order, the greedy choice take the first least
        # loaded rank).
        "transformer_layer": nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16),
        "convnet": nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1),
                                 nn.Flatten(), nn.Linear(4 * 6 * 6, 10)),
        # One parameter larger than all the others together.
        "embedding_and_head": nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 3), nn.Linear(3, 2)),
        # Fewer parameters than ranks at 3 and 4: some ranks own nothing.
        "two_parameters": nn.Linear(4, 2),
    }


def main():
    out = []
    for name, model in models().items():
        params = list(model.parameters())
        partitions = {}
        for world in WORLD_SIZES:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
            index = {id(p): i for i, p in enumerate(params)}
            owners = [zero._param_to_rank[p] for p in params]
            shares = [[index[id(p)] for group in rank_groups for p in group["params"]]
                      for rank_groups in zero._partition_parameters()]
            partitions[str(world)] = {"owners": owners, "shares": shares}
            dist.destroy_process_group()
        out.append({"name": name, "shapes": [list(p.shape) for p in params], "partitions": partitions})
    json.dump({"torch_version": torch.__version__, "models": out}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
