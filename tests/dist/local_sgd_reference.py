"""The Python side of test_local_sgd_pytorch.py: torchft's LocalSGD and DiLoCo algorithms (torchft's
local_sgd.py, without its Manager: the all-reduce is torch.distributed's, SUM then a division by the
world size, as the Manager averages) on the model and data of local_sgd_reference.cpp, writing the
same JSON: every parameter after 200 steps of
  localsgd:  SGD (lr 0.05, momentum 0.9), parameters averaged every 5 steps;
  diloco:    inner AdamW (lr 1e-2), outer SGD (lr 0.7, momentum 0.9, Nesterov), sync every 5 steps;
  streaming: the same with 2 fragments (one per Linear), one outer SGD each, sync_every 4;
  streaming_delay: 2 fragments, sync_every 8, fragment_sync_delay 3 (the all-reduce 3 steps early);
  diloco_delay_alpha: inner SGD, sync_every 5, fragment_sync_delay 2, fragment_update_alpha 0.25;
  diloco_bf16: diloco with the pseudo-gradient summed in bfloat16 (reduce_dtype).
  python local_sgd_reference.py OUT.json   (every rank; env:// as torchrun sets it)
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

from reference_util import wave, write_and_close

STEPS, BATCH = 200, 8


def make_model():
    m = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).double()
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k).view(p.shape))
    return m


def batch(s, r):
    # Each replica its own data: the phase depends on the rank.
    x = wave(BATCH * 6, 1.0, 0.1, 0.97 * s + 2.1 * r).view(BATCH, 6)
    y = wave(BATCH * 4, 1.0, 0.05, 0.31 * s + 1.5 + 0.7 * r).view(BATCH, 4)
    return x, y


def average(t):
    dist.all_reduce(t)
    t /= dist.get_world_size()


def inner_step(model, opt, s):
    x, y = batch(s, dist.get_rank())
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()


def local_sgd():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    local = 0
    for s in range(STEPS):
        inner_step(model, opt, s)
        # LocalSGD._step_post_hook, sync() and _perform_sync()
        local += 1
        if local >= 5:
            avg = [p.detach().clone() for p in model.parameters()]
            for a in avg:
                average(a)
            with torch.no_grad():
                for p, a in zip(model.parameters(), avg):
                    p.data.copy_(a)
            local = 0
    return model


def diloco(fragments_of, sync_every, inner_kind, delay=0, alpha=0.0, reduce_dtype=None):
    model = make_model()
    fragments = fragments_of(model)
    if inner_kind == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    outers = [torch.optim.SGD(f, lr=0.7, momentum=0.9, nesterov=True, foreach=False) for f in fragments]
    original = [[p.detach().clone() for p in f] for f in fragments]  # DiLoCo.__init__: _save_parameters
    per = sync_every // len(fragments)
    local, manager_step, grads = 0, 0, None
    for s in range(STEPS):
        inner_step(model, inner, s)
        # _step_post_hook: prepare_sync fragment_sync_delay steps before the sync point
        local += 1
        i = manager_step % len(fragments)
        if local == per - delay:
            # prepare_sync: _save_grads, then the all-reduce of the pseudo-gradients
            grads = [o - p.detach() for o, p in zip(original[i], fragments[i])]
            if reduce_dtype is None:
                for g in grads:
                    average(g)
            else:  # summed in reduce_dtype, divided in the parameters' dtype
                sent = [g.to(reduce_dtype) for g in grads]
                for g in sent:
                    dist.all_reduce(g)
                grads = [g.to(torch.float64) / dist.get_world_size() for g in sent]
        if local == per:
            # perform_sync: _save_local_parameters, restore_parameters, _set_grads, outer step,
            # save_parameters, _merge_parameters (lerp toward the local ones by alpha), zero_grad
            with torch.no_grad():
                own = [p.detach().clone() for p in fragments[i]]
                for p, o in zip(fragments[i], original[i]):
                    p.data.copy_(o)
            for p, g in zip(fragments[i], grads):
                p.grad = g
            outers[i].step()
            with torch.no_grad():
                for p, o, mine in zip(fragments[i], original[i], own):
                    o.copy_(p.data)
                    p.data.lerp_(mine, alpha)
            outers[i].zero_grad()
            manager_step += 1
            local = 0
    return model


def dump(model):
    return {"params": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}}


def main():
    dist.init_process_group("gloo")
    out = {
        "localsgd": dump(local_sgd()),
        "diloco": dump(diloco(lambda m: [list(m.parameters())], 5, "adamw")),
        "diloco_sgd": dump(diloco(lambda m: [list(m.parameters())], 5, "sgd")),
        "streaming": dump(diloco(lambda m: [list(m[0].parameters()), list(m[2].parameters())], 4, "adamw")),
        "streaming_delay": dump(diloco(lambda m: [list(m[0].parameters()), list(m[2].parameters())], 8, "adamw",
                                       delay=3)),
        "diloco_delay_alpha": dump(diloco(lambda m: [list(m.parameters())], 5, "sgd", delay=2, alpha=0.25)),
        "diloco_bf16": dump(diloco(lambda m: [list(m.parameters())], 5, "adamw", reduce_dtype=torch.bfloat16)),
    }
    write_and_close(out, sys.argv[1])


if __name__ == "__main__":
    main()
