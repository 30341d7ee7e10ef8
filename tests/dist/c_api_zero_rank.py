"""One rank of tests/dist/test_c_api.py's ZeRO and CheckpointManager cases, run by .venv's Python
(PyTorch 2.x), in float64 on Gloo:

`zero_capi`: c_api_rank.py's MLP trained with dtrain's DDP and ZeroRedundancyOptimizer through
libdtrain_c (SGD with Nesterov momentum, Adam, AdamW; the learning rate changed half-way), then the
consolidated state saved on rank 0 and loaded into a new ZeRO on every rank, and bad input;
`zero_torch`: the same with PyTorch's DistributedDataParallel and its own
torch.distributed.optim.ZeroRedundancyOptimizer;
`ckpt`: dtrain's CheckpointManager of named tensors through libdtrain_c (rotation, load_latest, an
async save), its newest folder read by torch.distributed.checkpoint.

  c_api_zero_rank.py zero_capi|zero_torch|ckpt OUT.json   (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
                                                           DTRAIN_C_LIB; the OUT folder is shared by the ranks)
"""
import ctypes
import json
import os
import sys

import torch

from c_api_rank import NAMES, CApi, TorchParams, init_params, loss_of

ZERO_STEPS = 8
LR_CHANGE_STEP = 4  # from this step on, the learning rate is halved (a scheduler's change)
# (optimizer, the C API's option fields, torch.optim's keyword arguments): the same optimizer twice.
ZERO_CONFIGS = [
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": 1, "weight_decay": 0.01},
     {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("adam", {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.02},
     {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.02}),
    ("adamw", {"lr": 0.01, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1},
     {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1}),
]


class OptimizerOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("lr", ctypes.c_double), ("momentum", ctypes.c_double),
                ("dampening", ctypes.c_double), ("nesterov", ctypes.c_int), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("amsgrad", ctypes.c_int)]


class CheckpointOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("keep", ctypes.c_int64), ("interval", ctypes.c_int64),
                ("rng", ctypes.c_int)]


def flat(tensors):
    return [v for t in tensors for v in t.detach().flatten().tolist()]


def handles_of(c, tensors):
    hs = [c.tensor(t) for t in tensors]
    return hs, (ctypes.c_void_p * len(hs))(*[h.value for h in hs])


def zero_new(c, arr, n, name, fields):
    opts = OptimizerOptions()
    c("optimizer_options_default", name.encode(), ctypes.byref(opts))
    for k, v in fields.items():
        setattr(opts, k, v)
    z = ctypes.c_void_p()
    c("zero_new", arr, ctypes.c_size_t(n), name.encode(), ctypes.byref(opts), None, ctypes.byref(z))
    return z


def zero_capi_train(c, rank, name, fields, folder):
    params = init_params(rank)
    hs, arr = handles_of(c, params)
    names = (ctypes.c_char_p * len(NAMES))(*[n.encode() for n in NAMES])
    ddp = ctypes.c_void_p()
    c("ddp_new", arr, ctypes.c_size_t(len(hs)), names, None, None, ctypes.byref(ddp))
    z = zero_new(c, arr, len(hs), name, fields)
    for step in range(ZERO_STEPS):
        if step == LR_CHANGE_STEP:
            lr = ctypes.c_double()
            c("zero_get_lr", z, ctypes.byref(lr))
            c("zero_set_lr", z, ctypes.c_double(lr.value / 2))
        c("zero_zero_grad", z, 1)
        c("ddp_forward_begin", ddp)
        loss = loss_of(params, step, rank)
        lh = c.tensor(loss)
        c("ddp_forward_end", ddp, (ctypes.c_void_p * 1)(lh.value), ctypes.c_size_t(1))
        c.free(lh)
        loss.backward()
        c("zero_step", z)
    result = {"params": flat(params)}
    # Resume: the consolidated state, saved by rank 0 and loaded by every rank into a new ZeRO over a
    # copy of the parameters, steps the same gradients to the same bits as the trained one.
    path = os.path.join(folder, f"zero_{name}.pt").encode()
    c("zero_consolidate_state_dict", z, 0)
    if rank == 0:
        c("zero_save", z, path)
    c("barrier", None, None)
    copies = [p.detach().clone().requires_grad_() for p in params]
    chs, carr = handles_of(c, copies)
    z2 = zero_new(c, carr, len(chs), name, fields)
    c("zero_load", z2, path)
    lr = ctypes.c_double()
    c("zero_get_lr", z2, ctypes.byref(lr))
    result["loaded_lr"] = lr.value
    for a, b in zip(params, copies):
        b.grad = a.grad.clone()
    c("zero_step", z)
    c("zero_step", z2)
    result["resumed_equal"] = all(torch.equal(a.detach(), b.detach()) for a, b in zip(params, copies))
    for h in (z, z2):
        c("zero_free", h)
    c("ddp_free", ddp)
    for h in hs + chs:
        c.free(h)
    return result


def status_and_error(c, fn, *args):
    status = getattr(c.lib, "dtrain_c_" + fn)(*args)
    return [status, c.lib.dtrain_c_last_error().decode()]


def zero_bad_input(c, rank):
    params = init_params(rank)
    hs, arr = handles_of(c, params)
    odd = torch.zeros(3, dtype=torch.float32, requires_grad=True)
    mixed_hs, mixed = handles_of(c, params[:2] + [odd])
    z = ctypes.c_void_p()
    out = {
        "null_step": status_and_error(c, "zero_step", None),
        "unknown_optimizer": status_and_error(c, "zero_new", arr, ctypes.c_size_t(4), b"lamb", None, None,
                                              ctypes.byref(z)),
        "other_dtype": status_and_error(c, "zero_new", mixed, ctypes.c_size_t(3), b"adamw", None, None,
                                        ctypes.byref(z)),
        "bad_default": status_and_error(c, "optimizer_options_default", b"rmsprop", None),
    }
    for h in hs + mixed_hs:
        c.free(h)
    return out


def run_zero_capi(folder):
    c = CApi(os.environ["DTRAIN_C_LIB"])
    c("init_process_group", None, None, -1, -1, 0)
    rank = c.out_int("rank")
    result = {name: zero_capi_train(c, rank, name, fields, folder) for name, fields, _ in ZERO_CONFIGS}
    result["bad_input"] = zero_bad_input(c, rank)
    c("destroy_process_group")
    return result


def zero_torch_train(rank, name, kwargs):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    module = TorchParams(init_params(rank), rank)
    ddp = DDP(module)
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=cls, **kwargs)
    for step in range(ZERO_STEPS):
        if step == LR_CHANGE_STEP:
            for g in opt.param_groups:
                g["lr"] = g["lr"] / 2
        opt.zero_grad()
        ddp(step).backward()
        opt.step()
    return {"params": flat(getattr(module, n) for n in NAMES)}


def run_zero_torch():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {name: zero_torch_train(rank, name, kwargs) for name, _, kwargs in ZERO_CONFIGS}
    # Neither rank tears Gloo down while the other's last broadcasts may still be in flight, nor while
    # a DDP or ZeroRedundancyOptimizer in a reference cycle still holds the group (freed at
    # interpreter exit, after the group ended, it aborted rank 0 once in a busy run: exit -6).
    from reference_util import end_group
    end_group()
    return result


CKPT_NAMES = ["fc1.weight", "fc1.bias", "head.counts"]


def ckpt_tensors():
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(6, 3, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64),
            torch.arange(4, dtype=torch.int64)]


def ckpt_manager(c, folder, keep, interval):
    opts = CheckpointOptions()
    c.lib.dtrain_c_checkpoint_options_default(ctypes.byref(opts))
    opts.keep, opts.interval = keep, interval
    m = ctypes.c_void_p()
    c("checkpoint_new", folder.encode(), ctypes.byref(opts), ctypes.byref(m))
    return m


def ckpt_load(c, m, arr, n):
    step, found = ctypes.c_int64(-1), ctypes.c_int(-1)
    c("checkpoint_load_latest", m, ckpt_names(), arr, ctypes.c_size_t(n), ctypes.byref(step), ctypes.byref(found))
    return found.value, step.value


def ckpt_names():
    return (ctypes.c_char_p * len(CKPT_NAMES))(*[n.encode() for n in CKPT_NAMES])


def ckpt_saves(c, m, tensors, arr, result):
    """Steps 1..7, interval 2, keep 2: writes 2, 4, 6 and leaves 4 and 6."""
    saved = ctypes.c_int()
    result["saved"] = []
    for step in range(1, 8):
        with torch.no_grad():
            for t in tensors:
                t.add_(step)
        c("checkpoint_save", m, ctypes.c_int64(step), ckpt_names(), arr, ctypes.c_size_t(len(tensors)),
          ctypes.byref(saved))
        result["saved"].append(saved.value)
        if saved.value:
            snapshot = [t.clone() for t in tensors]
    return snapshot


def ckpt_async(c, m, tensors, arr, result):
    """An async save at step 8, the tensors changed while it writes, then wait and load."""
    with torch.no_grad():
        for t in tensors:
            t.mul_(3)
    at_save = [t.clone() for t in tensors]
    c("checkpoint_save_async", m, ctypes.c_int64(8), ckpt_names(), arr, ctypes.c_size_t(len(tensors)), None)
    with torch.no_grad():
        for t in tensors:
            t.fill_(-7)
    c("checkpoint_wait", m)
    result["async_load"] = ckpt_load(c, m, arr, len(tensors))
    result["async_equal"] = all(torch.equal(a, b) for a, b in zip(tensors, at_save))
    return at_save


def ckpt_bad_input(c, m, arr):
    bad = (ctypes.c_char_p * 3)(b"fc1..weight", b"fc1.bias", b"head.counts")
    wrong = [torch.zeros(5, 3, dtype=torch.float64), torch.zeros(6, dtype=torch.float64),
             torch.zeros(4, dtype=torch.int64)]
    whs, warr = handles_of(c, wrong)
    step, found = ctypes.c_int64(-1), ctypes.c_int(-1)
    out = {
        "null_save": status_and_error(c, "checkpoint_save", None, ctypes.c_int64(1), ckpt_names(), arr,
                                      ctypes.c_size_t(3), None),
        "empty_part": status_and_error(c, "checkpoint_save", m, ctypes.c_int64(10), bad, arr, ctypes.c_size_t(3),
                                       None),
        "wrong_shape": status_and_error(c, "checkpoint_load_latest", m, ckpt_names(), warr, ctypes.c_size_t(3),
                                        ctypes.byref(step), ctypes.byref(found)),
        "wrong_shape_untouched": all(int(t.count_nonzero()) == 0 for t in wrong),
    }
    for h in whs:
        c.free(h)
    return out


def run_ckpt(folder):
    c = CApi(os.environ["DTRAIN_C_LIB"])
    c("init_process_group", None, None, -1, -1, 0)
    ckdir = os.path.join(folder, "ckpt")
    tensors = ckpt_tensors()
    hs, arr = handles_of(c, tensors)
    m = ckpt_manager(c, ckdir, 2, 2)
    result = {"empty_load": ckpt_load(c, m, arr, len(tensors))}
    snapshot = ckpt_saves(c, m, tensors, arr, result)
    c("barrier", None, None)
    result["files_after_saves"] = sorted(os.listdir(ckdir))
    with torch.no_grad():
        for t in tensors:
            t.zero_()
    result["load"] = ckpt_load(c, m, arr, len(tensors))
    result["load_equal"] = all(torch.equal(a, b) for a, b in zip(tensors, snapshot))
    at_save = ckpt_async(c, m, tensors, arr, result)
    c("barrier", None, None)
    result["files_after_async"] = sorted(os.listdir(ckdir))
    result["bad_input"] = ckpt_bad_input(c, m, arr)
    c("checkpoint_free", m)
    for h in hs:
        c.free(h)
    c("destroy_process_group")
    # Python's torch.distributed.checkpoint reads the newest folder (one process, no group).
    import torch.distributed.checkpoint as dcp
    state = {"model": {n: torch.zeros_like(t) for n, t in zip(CKPT_NAMES, tensors)}}
    dcp.load(state, checkpoint_id=os.path.join(ckdir, "checkpoint_0000000008.dcp"))
    result["dcp_torch_equal"] = all(torch.equal(state["model"][n], t) for n, t in zip(CKPT_NAMES, at_save))
    return result


def main():
    mode, out = sys.argv[1], sys.argv[2]
    folder = os.path.dirname(os.path.abspath(out))
    result = {"zero_capi": lambda: run_zero_capi(folder), "zero_torch": run_zero_torch,
              "ckpt": lambda: run_ckpt(folder)}[mode]()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
