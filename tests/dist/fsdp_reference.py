"""The Python side of test_fsdp_pytorch.py: PyTorch's own fully_shard (FSDP2) on the model, data
and optimizers of fsdp_reference.cpp, writing the same JSON (local shard shapes after sharding,
whole parameters after 20 steps). With FSDP_REFERENCE_HSDP=1 (4 ranks), HSDP: every unit on the
2-D mesh init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")).
  python fsdp_reference.py OUT.json   (every rank; env:// as torchrun sets it)
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from reference_util import wave, write_and_close

STEPS, BATCH = 20, 12


def make_model():
    m = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k).view(p.shape))
    return m


def train(kind, mesh):
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shapes = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    n, r = dist.get_world_size(), dist.get_rank()
    for s in range(STEPS):
        x = wave(BATCH * 8, 1.0, 0.1, 0.97 * s).view(BATCH, 8).chunk(n)[r]
        y = wave(BATCH * 3, 1.0, 0.05, 0.31 * s + 1.5).view(BATCH, 3).chunk(n)[r]
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    params = {name: p.full_tensor().reshape(-1).tolist() for name, p in model.named_parameters()}
    return {"shapes": shapes, "params": params}


def main():
    dist.init_process_group("gloo")
    mesh = None
    if os.environ.get("FSDP_REFERENCE_HSDP") == "1":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {"sgd": train("sgd", mesh), "adam": train("adam", mesh)}
    write_and_close(out, sys.argv[1])


if __name__ == "__main__":
    main()
