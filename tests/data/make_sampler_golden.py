#!/usr/bin/python3
"""Golden indices for dtrain::DistributedSampler from PyTorch's torch.utils.data.DistributedSampler.

Run with Debian's python3-torch (1.13):
    /usr/bin/python3 tests/data/make_sampler_golden.py > tests/data/sampler_golden.json
The C++ test (tests/unit/sampler_test.cpp) compares every case with dtrain's sampler.
"""
import json
import sys

import torch
from torch.utils.data import DistributedSampler

SIZES = [0, 1, 7, 10, 100, 1001]
REPLICAS = [1, 2, 3, 4]
SEEDS = [0, 42]
EPOCHS = [0, 1, 5]


def main():
    cases = []
    for n in SIZES:
        for replicas in REPLICAS:
            for shuffle in (True, False):
                # Without shuffling, seed and epoch do not matter: one case is enough.
                seeds = SEEDS if shuffle else [0]
                epochs = EPOCHS if shuffle else [0]
                for drop_last in (False, True):
                    for seed in seeds:
                        for epoch in epochs:
                            for rank in range(replicas):
                                s = DistributedSampler(range(n), num_replicas=replicas, rank=rank,
                                                       shuffle=shuffle, seed=seed, drop_last=drop_last)
                                s.set_epoch(epoch)
                                indices = list(iter(s))
                                assert len(indices) == len(s)
                                cases.append({"n": n, "num_replicas": replicas, "rank": rank,
                                              "shuffle": shuffle, "seed": seed, "epoch": epoch,
                                              "drop_last": drop_last, "indices": indices})
    json.dump({"torch_version": torch.__version__, "cases": cases}, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
