"""The Python side of test_tp_pytorch.py: PyTorch's own parallelize_module (ColwiseParallel,
RowwiseParallel, loss_parallel) on the models and data of tp_reference.cpp, writing the same JSON:
each rank's local shard shapes, its local outputs and gradients at the first step, and its local
parameters after 5 Adam steps.
  python tp_reference.py OUT.json   (every rank; env:// as torchrun sets it)
"""
import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

STEPS = 5


def wave(n, scale, freq, phase):
    return torch.arange(n, dtype=torch.float64).mul(freq).add(phase).sin().mul(scale)


def fill(model):
    with torch.no_grad():
        for k, (_, p) in enumerate(model.named_parameters()):
            p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k).view(p.shape))
    return model


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 6), nn.Linear(6, 12)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)))


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def flat(t):
    return local(t).detach().reshape(-1).tolist()


def record(model, run):
    out = {"shapes": {n: list(local(p).shape) for n, p in model.named_parameters()}}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        y, loss = run(step)
        loss.backward()
        if step == 0:
            out["output"] = flat(y)
            out["grads"] = {n: flat(p.grad) for n, p in model.named_parameters()}
            out["grad_shapes"] = {n: list(local(p.grad).shape) for n, p in model.named_parameters()}
        opt.step()
    out["params"] = {n: flat(p) for n, p in model.named_parameters()}
    return out


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    mlp = fill(MLP().double())
    parallelize_module(mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

    def run_mlp(step):
        x = wave(5 * 8, 1.0, 0.1, 0.97 * step).view(5, 8)
        t = wave(5 * 8, 1.0, 0.05, 0.31 * step + 1.5).view(5, 8)
        y = mlp(x)
        return y, (y - t).pow(2).mean()

    lm = fill(LM().double())
    parallelize_module(lm, mesh, {"emb": RowwiseParallel(input_layouts=Replicate()),
                                  "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})

    def run_lm(step):
        tokens = torch.arange(12).mul(7 + step).remainder(11)
        target = torch.arange(12).mul(5 + step).add(1).remainder(12)
        logits = lm(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits, target)
            loss.backward()
        return logits, loss.detach().requires_grad_()  # backward done inside loss_parallel

    out = {"mlp": record(mlp, run_mlp), "lm": record(lm, run_lm)}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
    # The parallelized modules sit in reference cycles through their hooks; nothing that holds the
    # group may outlive it (Gloo's threads join there).
    del mlp, lm, run_mlp, run_lm
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
