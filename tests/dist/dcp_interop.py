"""The Python side of test_dcp.py (PyTorch 2.x from .venv, CPU, Gloo): the model, batches and Adam of
dcp_interop.cpp, saved or loaded with torch.distributed.checkpoint on this job's ranks. Every rank
trains the whole batch itself (the mean over all rows, what dtrain's ranks average to), so any world
size gives the same numbers. Rank 0 writes the whole parameters at the checkpoint and after training on.
  dcp_interop.py save DIR OUT.json     train 3 steps, dcp.save, train 5 more
  dcp_interop.py load DIR[,DIR...] OUT.json   per folder: dcp.load what dtrain saved, train 5 steps
Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""
import gc
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

BATCH, BEFORE, AFTER = 12, 3, 5


def wave(n, scale, freq, phase):
    return torch.arange(n, dtype=torch.float64).mul(freq).add(phase).sin().mul(scale)


def make_model(phase):
    m = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Tanh(),
                            torch.nn.Linear(5, 3)).double()
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k + phase).view(p.shape))
    return m


def train(model, opt, first, steps):
    for step in range(first, first + steps):
        x = wave(BATCH * 8, 1.0, 0.1, 0.97 * step).view(BATCH, 8)
        y = wave(BATCH * 3, 1.0, 0.05, 0.31 * step + 1.5).view(BATCH, 3)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()


def params(model):
    return {k: v.detach().reshape(-1).tolist() for k, v in model.named_parameters()}


def run(mode, folder):
    if mode == "save":
        model = make_model(0.0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, opt, 0, BEFORE)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    else:
        model = make_model(2.0)
        opt = torch.optim.Adam(model.parameters(), lr=0.5)  # the checkpoint's lr (1e-2) must replace it
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        assert math.isclose(opt.param_groups[0]["lr"], 1e-2), opt.param_groups[0]["lr"]
    at_checkpoint = params(model)
    train(model, opt, BEFORE, AFTER)
    return {"at_checkpoint": at_checkpoint, "after": params(model)}


def main():
    mode, folders, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)  # Adam's step counts as float64, as in dtrain's float64 run
    results = {folder: run(mode, folder) for folder in folders.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    gc.collect()  # nothing that holds the group may outlive it (Gloo's threads join there)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
