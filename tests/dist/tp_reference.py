"""The Python side of test_tp_pytorch.py: PyTorch's own parallelize_module (ColwiseParallel,
RowwiseParallel, loss_parallel, SequenceParallel, PrepareModuleInput/Output) on the models and data
of tp_reference.cpp, writing the same JSON: each rank's local shard shapes, its local outputs,
input gradients and parameter gradients at the first step, and its local parameters after 5 Adam
steps.
  python tp_reference.py OUT.json   (every rank; env:// as torchrun sets it)
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from reference_util import end_group, wave

STEPS = 5


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


class RMSNorm(nn.Module):
    """Llama's (examples/llm/llama.h), the Python implementation SequenceParallel documents."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SPBlock(nn.Module):
    """norm -> colwise w1 -> relu -> rowwise w2 -> norm, the norms sequence-parallel."""

    def __init__(self):
        super().__init__()
        self.norm1, self.w1, self.w2, self.norm2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8), RMSNorm(8)

    def forward(self, x):
        return self.norm2(self.w2(torch.relu(self.w1(self.norm1(x)))))


class SPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = SPBlock()

    def forward(self, x):
        return self.block(x)


SP_PLAN = {"block.norm1": SequenceParallel(), "block.w1": ColwiseParallel(input_layouts=Shard(1)),
           "block.w2": RowwiseParallel(output_layouts=Shard(1)), "block.norm2": SequenceParallel()}
SEQ = 6  # [2, SEQ, 8] inputs: 3 positions a rank


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def flat(t):
    return local(t).detach().reshape(-1).tolist()


def summed(g):
    """A gradient's value on this rank: PyTorch 2.15 leaves a SequenceParallel parameter's gradient
    Partial(sum) (each rank's positions' part; Adam sums it), where dtrain sums it in backward."""
    if not isinstance(g, DTensor) or not any(p.is_partial() for p in g.placements):
        return g
    return g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])


def record(model, run, x=None):
    """x: the input whose gradient is recorded too (a leaf run(step) fills at each step)."""
    out = {"shapes": {n: list(local(p).shape) for n, p in model.named_parameters()}}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        y, loss = run(step)
        loss.backward()
        if step == 0:
            out["output"] = flat(y)
            out["grads"] = {n: flat(summed(p.grad)) for n, p in model.named_parameters()}
            out["grad_shapes"] = {n: list(local(p.grad).shape) for n, p in model.named_parameters()}
            if x is not None:
                out["input_grad"] = flat(x["leaf"].grad)
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

    rank, world = dist.get_rank(), dist.get_world_size()
    # Sequence parallel: each rank's input and output are its positions (dim 1) of the block's.
    sp = fill(SPNet().double())
    parallelize_module(sp, mesh, SP_PLAN)
    sp_x = {}

    def run_sp(step):
        x = wave(2 * SEQ * 8, 1.0, 0.13, 0.7 * step).view(2, SEQ, 8).chunk(world, 1)[rank]
        t = wave(2 * SEQ * 8, 1.0, 0.05, 0.31 * step + 1.5).view(2, SEQ, 8).chunk(world, 1)[rank]
        sp_x["leaf"] = x.clone().requires_grad_()
        y = local(sp(sp_x["leaf"]))
        return y, (y - t).pow(2).sum()  # each rank's loss is its positions': the sum is the block's

    # ... and whole on every rank around it: PrepareModuleInput cuts it, PrepareModuleOutput gathers.
    spio = fill(SPNet().double())
    parallelize_module(spio, mesh, {"block": PrepareModuleInput(input_layouts=Replicate(),
                                                                desired_input_layouts=Shard(1)), **SP_PLAN})
    parallelize_module(spio, mesh, {"block": PrepareModuleOutput(output_layouts=Shard(1),
                                                                 desired_output_layouts=Replicate())})
    spio_x = {}

    def run_spio(step):
        x = wave(2 * SEQ * 8, 1.0, 0.13, 0.7 * step).view(2, SEQ, 8)
        t = wave(2 * SEQ * 8, 1.0, 0.05, 0.31 * step + 1.5).view(2, SEQ, 8)
        spio_x["leaf"] = x.clone().requires_grad_()
        y = spio(spio_x["leaf"])
        return y, (y - t).pow(2).mean()

    out = {"mlp": record(mlp, run_mlp), "lm": record(lm, run_lm), "sp": record(sp, run_sp, sp_x),
           "spio": record(spio, run_spio, spio_x)}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
    # The parallelized modules sit in reference cycles through their hooks; nothing that holds the
    # group may outlive it (Gloo's threads join there).
    del mlp, lm, sp, spio, run_mlp, run_lm, run_sp, run_spio
    end_group()


if __name__ == "__main__":
    main()
