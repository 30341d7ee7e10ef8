#!/usr/bin/python3
"""Reference for bench_ddp: PyTorch's own DistributedDataParallel on the tutorial's models.

One rank of a Gloo job, started with env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as
torchrun would set them (torchrun itself fails on Python 3.11 here). The loop is the tutorial's:
zero_grad, forward, CrossEntropyLoss, backward, Adam step, on pre-made batches cycled through.
Rank 0 times the timed steps after a barrier and prints `steps_per_s=<x>`.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 OMP_NUM_THREADS=1 \
        /usr/bin/python3 bench/python/ddp_reference.py --model mlp --warmup 20 --steps 300
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

BATCHES = 4  # distinct pre-made batches, cycled (the same count as bench_ddp.cpp)


class SimpleModel(nn.Module):  # tutorial section 2: MLP 128-256-256-10
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


class TrainModel(nn.Module):  # tutorial section 3: CNN on 3x32x32
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["mlp", "cnn"], required=True)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=32)
    a = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = DDP(SimpleModel() if a.model == "mlp" else TrainModel())  # defaults, as the tutorial
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    shape = (a.batch_size, 128) if a.model == "mlp" else (a.batch_size, 3, 32, 32)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(shape, generator=g), torch.randint(0, 10, (a.batch_size,), generator=g))
               for _ in range(BATCHES)]

    def step(i):
        x, y = batches[i % BATCHES]
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.steps):
        step(i)
    secs = time.perf_counter() - t0
    if rank == 0:
        print(f"steps_per_s={a.steps / secs:.3f}", flush=True)
    # Every rank out of its last all-reduce before any tears the group down: PyTorch 2.x's Gloo
    # aborted rank 0 ("terminate called without an active exception") when it destroyed the group
    # while rank 1 was still finishing the last step.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
