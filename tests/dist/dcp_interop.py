"""The Python side of test_dcp.py (PyTorch 2.x from .venv, CPU, Gloo): the model, batches and Adam of
dcp_interop.cpp, saved or loaded with torch.distributed.checkpoint on this job's ranks. Every rank
trains the whole batch itself (the mean over all rows, what dtrain's ranks average to), so any world
size gives the same numbers. Rank 0 writes the whole parameters at the checkpoint and after training on.
  dcp_interop.py save DIR OUT.json     train 3 steps, dcp.save, train 5 more
  dcp_interop.py load DIR[,DIR...] OUT.json   per folder: dcp.load what dtrain saved, train 5 steps
  dcp_interop.py load2d DIR OUT.json   the same into the model parallelized as dtrain's 2d (4 ranks:
                                       parallelize_module on mesh["tp"] of {dp 2, tp 2}, then fully_shard
                                       on mesh["dp"]), each dp row training on its rows of the batch
  dcp_interop.py loadhsdp DIR OUT.json   the same into HSDP (4 ranks: fully_shard of each Linear and
                                       the root on a {replicate 2, shard 2} mesh), each rank training
                                       on its rows of the batch
Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from reference_util import end_group, wave

BATCH, BEFORE, AFTER = 12, 3, 5


def make_model(phase):
    m = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Tanh(),
                            torch.nn.Linear(5, 3)).double()
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k + phase).view(p.shape))
    return m


def make_2d_model(phase):
    """dtrain's 2d: the first Linear Colwise and the second Rowwise over mesh["tp"], then each Linear
    and the root fully_shard'ed over mesh["dp"]."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model(phase)
    # The Colwise output stays a DTensor: its 13 features are torch.chunk's uneven parts (7, 6), which a
    # local tensor rewrapped as Shard(-1) by RowwiseParallel would take for even ones.
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].size(), mesh["dp"].get_local_rank()


def make_hsdp_model(phase):
    """dtrain's hsdp: each Linear and the root fully_shard'ed over a 2-D (replicate, shard) mesh."""
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    model = make_model(phase)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dist.get_world_size(), dist.get_rank()


def train(model, opt, first, steps, rows=(1, 0)):
    n, r = rows
    for step in range(first, first + steps):
        x = wave(BATCH * 8, 1.0, 0.1, 0.97 * step).view(BATCH, 8).chunk(n)[r]
        y = wave(BATCH * 3, 1.0, 0.05, 0.31 * step + 1.5).view(BATCH, 3).chunk(n)[r]
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()


def params(model):
    def whole(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: whole(v.detach()).reshape(-1).tolist() for k, v in model.named_parameters()}


def run(mode, folder):
    rows = (1, 0)
    if mode == "save":
        model = make_model(0.0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, opt, 0, BEFORE)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    else:
        if mode == "load2d":
            model, *rows = make_2d_model(2.0)
        elif mode == "loadhsdp":
            model, *rows = make_hsdp_model(2.0)
        else:
            model = make_model(2.0)
        opt = torch.optim.Adam(model.parameters(), lr=0.5)  # the checkpoint's lr (1e-2) must replace it
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        assert math.isclose(opt.param_groups[0]["lr"], 1e-2), opt.param_groups[0]["lr"]
    at_checkpoint = params(model)
    train(model, opt, BEFORE, AFTER, rows)
    return {"at_checkpoint": at_checkpoint, "after": params(model)}


def main():
    mode, folders, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)  # Adam's step counts as float64, as in dtrain's float64 run
    results = {folder: run(mode, folder) for folder in folders.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    end_group()


if __name__ == "__main__":
    main()
