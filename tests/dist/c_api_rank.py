"""One rank of tests/dist/test_c_api.py, run by .venv's Python (PyTorch 2.x): the same float64 training
of a 2-layer MLP either through libdtrain_c with ctypes (`capi`: dtrain's DDP over the Python
tensors, PyTorch's autograd running backward) or with PyTorch's own DistributedDataParallel
(`torch`). Writes a JSON: the parameters after training, the collectives' results (capi only).

`fsdp`: dtrain's fully_shard through the C API over the same kind of MLP (its parameters split into a
unit and the root), with clip_grad_norm_ over the shards, against a one-process run of the whole
batch; then a DCP checkpoint of the shards written from C and read by torch.distributed.checkpoint.

  c_api_rank.py capi|torch|fsdp OUT.json      (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; capi: DTRAIN_C_LIB)
"""
import ctypes
import json
import os
import sys
import tempfile

import torch

STEPS = 12
LR = 0.05
NAMES = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]


def init_params(rank):
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own: DDP starts them from rank 0's
    shapes = [((16, 8), 0.3), ((16,), 0.1), ((4, 16), 0.3), ((4,), 0.1)]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * k).requires_grad_() for s, k in shapes]


def loss_of(params, step, rank):
    gen = torch.Generator().manual_seed(step * 100 + rank + 7)
    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(42), dtype=torch.float64))
    h = torch.relu(torch.nn.functional.linear(x, params[0], params[1]))
    return torch.nn.functional.mse_loss(torch.nn.functional.linear(h, params[2], params[3]), y)


def no_sync_step(step):
    """Steps that accumulate locally (DDP's no_sync); the next step averages the sum."""
    return step % 4 == 1


def grad_sum(params):
    """What a no_sync backward left in the gradients: this rank's own, unless DDP averaged them."""
    return float(sum(p.grad.sum() for p in params))


def sgd(params):
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-LR)
            p.grad = None


class CApi:
    """libdtrain_c through ctypes; a failing call raises with dtrain_c_last_error()."""
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.dtrain_c_last_error.restype = ctypes.c_char_p
        self.lib.dtrain_c_init_process_group.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                                         ctypes.c_int, ctypes.c_int64]
        self.tensors = []

    def __call__(self, fn, *args):
        status = getattr(self.lib, "dtrain_c_" + fn)(*args)
        if status != 0:
            raise RuntimeError(f"status {status}: {self.lib.dtrain_c_last_error().decode()}")

    def tensor(self, t):
        """An at::Tensor* sharing the Python tensor (tensor._cdata is its c10::TensorImpl*)."""
        h = ctypes.c_void_p()
        self("tensor_from_impl", ctypes.c_void_p(t._cdata), ctypes.byref(h))
        return h

    def free(self, h):
        self("tensor_free", h)

    def out_int(self, fn, *args):
        v = ctypes.c_int()
        self(fn, *args, ctypes.byref(v))
        return v.value


def capi_collectives(c, rank, world):
    out = {}
    t = torch.full((4,), float(rank + 1), dtype=torch.float64)
    h = c.tensor(t)
    c("all_reduce", h, 0, None, None)  # SUM, blocking
    out["all_reduce_sum"] = t.tolist()
    t.fill_(float(rank + 1))  # the same tensor again: the handle shares it
    work = ctypes.c_void_p()
    c("all_reduce", h, 1, None, ctypes.byref(work))  # AVG, async
    c("work_wait", work)
    out["all_reduce_avg_async_done"] = c.out_int("work_is_completed", work)
    c("work_free", work)
    out["all_reduce_avg"] = t.tolist()
    c.free(h)
    b = torch.full((3,), float(rank * 10), dtype=torch.float32)
    hb = c.tensor(b)
    c("broadcast", hb, world - 1, None, None)
    out["broadcast"] = b.tolist()
    c.free(hb)
    src = torch.arange(2, dtype=torch.float32) + 2 * rank
    dst = torch.zeros(2 * world, dtype=torch.float32)
    hs, hd = c.tensor(src), c.tensor(dst)
    c("all_gather_into_tensor", hd, hs, None, None)
    out["all_gather_into_tensor"] = dst.tolist()
    big = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    part = torch.zeros(2, dtype=torch.float32)
    hbig, hpart = c.tensor(big), c.tensor(part)
    c("reduce_scatter_tensor", hpart, hbig, 0, None, None)
    out["reduce_scatter_tensor"] = part.tolist()
    for x in (hs, hd, hbig, hpart):
        c.free(x)
    ranks = (ctypes.c_int * world)(*range(world))
    group = ctypes.c_void_p()
    c("new_group", ranks, ctypes.c_size_t(world), ctypes.byref(group))
    out["group_size"] = c.out_int("group_size", group)
    c("barrier", group, None)
    c("group_free", group)
    return out


def capi_p2p(c, rank, world):
    """send/recv between ranks 0 and 1: blocking from any sender, then asynchronous with a tag."""
    out = {}
    t = torch.arange(3, dtype=torch.float32) + 10 * rank
    h = c.tensor(t)
    if rank == 0:
        c("send", h, 1, None, 0, None)
    elif rank == 1:
        sender = ctypes.c_int(-5)
        c("recv", h, -1, None, 0, ctypes.byref(sender), None)
        out["sender"] = sender.value
        t.add_(100)  # what rank 0 gets back
    work = ctypes.c_void_p()
    if rank == 1:
        c("send", h, 0, None, 7, ctypes.byref(work))
    elif rank == 0:
        c("recv", h, 1, None, 7, None, ctypes.byref(work))
    if rank < 2:
        c("work_wait", work)
        c("work_free", work)
    out["tensor"] = t.tolist()
    c.free(h)
    return out


def capi_sampler(c, rank, world):
    """DistributedSampler's indices through the C API and torch's own, for a few settings."""
    from torch.utils.data import DistributedSampler
    cases = []
    for size, shuffle, seed, drop_last, epoch in [(23, 1, 5, 0, 0), (23, 1, 5, 0, 3), (23, 1, 5, 1, 2), (7, 0, 0, 0, 0)]:
        count = ctypes.c_size_t()
        c("sampler_indices", ctypes.c_size_t(size), -1, -1, shuffle, ctypes.c_int64(seed), drop_last,
          ctypes.c_int64(epoch), None, ctypes.c_size_t(0), ctypes.byref(count))
        buf = (ctypes.c_int64 * count.value)()
        c("sampler_indices", ctypes.c_size_t(size), -1, -1, shuffle, ctypes.c_int64(seed), drop_last,
          ctypes.c_int64(epoch), buf, count, ctypes.byref(count))
        ref = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=bool(shuffle), seed=seed,
                                 drop_last=bool(drop_last))
        ref.set_epoch(epoch)
        cases.append([list(buf), list(ref)])
    return cases


def capi_scaler(c, rank):
    """GradScaler over per-rank gradients: an inf on rank 1 alone makes every rank skip and back off."""
    scaler = ctypes.c_void_p()
    c("grad_scaler_new", None, None, ctypes.byref(scaler))
    p = torch.ones(3, dtype=torch.float32, requires_grad=True)
    hp = c.tensor(p)
    params = (ctypes.c_void_p * 1)(hp.value)
    decisions, scales = [], []
    for step in range(2):
        loss = (p * (rank + 1)).sum()
        hl, scaled = c.tensor(loss), ctypes.c_void_p()
        c("grad_scaler_scale", scaler, hl, ctypes.byref(scaled))
        c.free(scaled)
        c.free(hl)
        scale = ctypes.c_double()
        c("grad_scaler_get_scale", scaler, ctypes.byref(scale))
        p.grad = None
        (loss * scale.value).backward()  # the value scale() returned: this rank's loss times the scale
        if step == 1 and rank == 1:
            with torch.no_grad():
                p.grad[0] = float("inf")
        should = ctypes.c_int(-1)
        c("grad_scaler_step", scaler, params, ctypes.c_size_t(1), ctypes.byref(should))
        decisions.append(should.value)
        c("grad_scaler_update", scaler, ctypes.c_double(0))
        c("grad_scaler_get_scale", scaler, ctypes.byref(scale))
        scales.append(scale.value)
    unscaled = p.grad.tolist()
    c("grad_scaler_free", scaler)
    c.free(hp)
    return {"decisions": decisions, "scales": scales, "unscaled_grad": unscaled}


def capi_train(c, rank, local):
    params = init_params(rank)
    handles = [c.tensor(p) for p in params]
    arr = (ctypes.c_void_p * len(handles))(*[h.value for h in handles])
    names = (ctypes.c_char_p * len(NAMES))(*[n.encode() for n in NAMES])
    ddp = ctypes.c_void_p()
    c("ddp_new", arr, ctypes.c_size_t(len(handles)), names, None, None, ctypes.byref(ddp))
    for step in range(STEPS):
        if no_sync_step(step):
            c("ddp_no_sync_begin", ddp)
        c("ddp_forward_begin", ddp)
        loss = loss_of(params, step, rank)
        lh = c.tensor(loss)
        c("ddp_forward_end", ddp, (ctypes.c_void_p * 1)(lh.value), ctypes.c_size_t(1))
        c.free(lh)
        loss.backward()  # PyTorch's autograd: dtrain's hooks on the accumulators average the gradients
        if no_sync_step(step):
            c("ddp_no_sync_end", ddp)
            local.append(grad_sum(params))
        else:
            sgd(params)
    c("ddp_free", ddp)
    # A checkpoint of the trained parameters, read back into zeros.
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.safetensors").encode()
        c("save_safetensors", path, names, arr, ctypes.c_size_t(len(handles)))
        back = [torch.zeros_like(p) for p in params]
        hback = [c.tensor(t) for t in back]
        c("load_safetensors", path, names, (ctypes.c_void_p * 4)(*[h.value for h in hback]), ctypes.c_size_t(4))
        loaded_equal = all(torch.equal(a, b.detach()) for a, b in zip(back, params))
        for h in hback:
            c.free(h)
    for h in handles:
        c.free(h)
    return params, loaded_equal


def run_capi():
    c = CApi(os.environ["DTRAIN_C_LIB"])
    c("init_process_group", None, None, -1, -1, 0)
    rank, world = c.out_int("rank"), c.out_int("world_size")
    result = {"abi": c.lib.dtrain_c_abi_version(), "rank": rank, "world": world,
              "collectives": capi_collectives(c, rank, world), "p2p": capi_p2p(c, rank, world),
              "sampler": capi_sampler(c, rank, world), "scaler": capi_scaler(c, rank)}
    result["no_sync_grads"] = []
    params, result["safetensors_roundtrip"] = capi_train(c, rank, result["no_sync_grads"])
    result["params"] = [v for p in params for v in p.detach().flatten().tolist()]
    c("destroy_process_group")
    return result


class TorchParams(torch.nn.Module):
    """The MLP's parameters (copies) as a module for PyTorch's DDP; forward(step) is rank's loss."""
    def __init__(self, params, rank):
        super().__init__()
        self.rank = rank
        for n, p in zip(NAMES, params):
            self.register_parameter(n, torch.nn.Parameter(p.detach().clone()))

    def forward(self, step):
        return loss_of([getattr(self, n) for n in NAMES], step, self.rank)


def run_torch():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    module = TorchParams(init_params(rank), rank)
    ddp = DDP(module)
    params = [getattr(module, n) for n in NAMES]
    local = []
    for step in range(STEPS):
        if no_sync_step(step):
            with ddp.no_sync():
                ddp(step).backward()
            local.append(grad_sum(params))
        else:
            ddp(step).backward()
            sgd(params)
    dist.destroy_process_group()
    return {"rank": rank, "params": [v for p in params for v in p.detach().flatten().tolist()], "no_sync_grads": local}


FSDP_NAMES = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
FSDP_UNITS = [0, 0, -1, -1]  # fc1 a unit of its own, fc2 in the root
MAX_NORM = 0.05  # below the gradients' norm: clipping scales every step


def fsdp_init():
    """The same on every rank (FSDP2 broadcasts nothing); 15 rows: shards of 8 and 7 rows."""
    gen = torch.Generator().manual_seed(77)
    shapes = [((15, 8), 0.3), ((15,), 0.1), ((4, 15), 0.3), ((4,), 0.1)]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * k).requires_grad_() for s, k in shapes]


def fsdp_batch(step, rank):
    gen = torch.Generator().manual_seed(step * 100 + rank + 7)
    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(42), dtype=torch.float64))
    return x, y


def fsdp_reference(world):
    """One process, the whole batch (every rank's part), torch's clip_grad_norm_: what FSDP must equal."""
    params = fsdp_init()
    norms = []
    for step in range(STEPS):
        xs, ys = zip(*[fsdp_batch(step, r) for r in range(world)])
        x, y = torch.cat(xs), torch.cat(ys)
        h = torch.relu(torch.nn.functional.linear(x, params[0], params[1]))
        torch.nn.functional.mse_loss(torch.nn.functional.linear(h, params[2], params[3]), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        sgd(params)
    return params, norms


def fsdp_step(c, fsdp, params, step, rank):
    """One forward through the C API's unit scopes (root, then unit 0 inside it) and PyTorch's backward."""
    x, y = fsdp_batch(step, rank)
    c("fsdp_forward_begin", fsdp, -1)
    c("fsdp_forward_begin", fsdp, 0)
    h = torch.relu(torch.nn.functional.linear(x, params[0], params[1]))
    hh = c.tensor(h)
    c("fsdp_forward_end", fsdp, 0, (ctypes.c_void_p * 1)(hh.value), ctypes.c_size_t(1))
    c.free(hh)
    loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(h, params[2], params[3]), y)
    hl = c.tensor(loss)
    c("fsdp_forward_end", fsdp, -1, (ctypes.c_void_p * 1)(hl.value), ctypes.c_size_t(1))
    c.free(hl)
    loss.backward()  # PyTorch's autograd; fully_shard's hooks reduce-scatter each unit's gradients


def fsdp_checkpoint(c, arr, names, params, folder, rank):
    """A DCP folder of the shards written from C; read back by C into zeroed shards."""
    c("dcp_save", folder.encode(), names, arr, ctypes.c_size_t(len(params)), None)
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.zero_()
    c("dcp_load", folder.encode(), names, arr, ctypes.c_size_t(len(params)), None)
    return all(torch.equal(a, p.detach()) for a, p in zip(saved, params))


def fsdp_whole(c, fsdp, shapes):
    """Every parameter whole, put together from the ranks' shards by the C API."""
    whole = []
    for i, shape in enumerate(shapes):
        full = torch.zeros(shape, dtype=torch.float64)
        hf = c.tensor(full)
        c("fsdp_full_parameter", fsdp, ctypes.c_size_t(i), hf)
        c.free(hf)
        whole.append(full)
    return [v for t in whole for v in t.flatten().tolist()]


def fsdp_train(c, rank, reshard_after_forward, unshard_first, folder=None):
    """Trains a fresh model through the C API's fully_shard; `unshard_first` gathers each unit with
    dtrain_c_fsdp_unshard before its forward (FSDPModule.unshard()), as a binding that prefetches would."""
    params = fsdp_init()
    shapes = [tuple(p.shape) for p in params]
    handles = [c.tensor(p) for p in params]
    arr = (ctypes.c_void_p * len(handles))(*[h.value for h in handles])
    names = (ctypes.c_char_p * len(FSDP_NAMES))(*[n.encode() for n in FSDP_NAMES])
    units = (ctypes.c_int * len(FSDP_UNITS))(*FSDP_UNITS)
    options = FsdpOptions()
    c.lib.dtrain_c_fsdp_options_default(ctypes.byref(options))
    options.reshard_after_forward = reshard_after_forward
    fsdp = ctypes.c_void_p()
    c("fsdp_new", arr, ctypes.c_size_t(len(handles)), names, units, ctypes.byref(options), None, ctypes.byref(fsdp))
    result = {"shard_rows": [p.shape[0] for p in params], "norms": [], "shapes": shapes}
    for step in range(STEPS):
        if unshard_first:
            c("fsdp_unshard", fsdp, -1)
            c("fsdp_unshard", fsdp, 0)
        fsdp_step(c, fsdp, params, step, rank)
        norm = ctypes.c_double()
        c("clip_grad_norm_", arr, ctypes.c_size_t(len(handles)), ctypes.c_double(MAX_NORM), ctypes.c_double(2.0),
          ctypes.byref(norm))
        result["norms"].append(norm.value)
        sgd(params)  # PyTorch's optimizer step on the shards
    result["params"] = fsdp_whole(c, fsdp, shapes)
    if folder:
        result["dcp_c_roundtrip"] = fsdp_checkpoint(c, arr, names, params, folder, rank)
    c("fsdp_free", fsdp)
    for h in handles:
        c.free(h)
    return result


class FsdpOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("reshard_after_forward", ctypes.c_int)]


def run_fsdp(out):
    c = CApi(os.environ["DTRAIN_C_LIB"])
    c("init_process_group", None, None, -1, -1, 0)
    rank, world = c.out_int("rank"), c.out_int("world_size")
    folder = os.path.join(os.path.dirname(os.path.abspath(out)), "fsdp_dcp")
    result = fsdp_train(c, rank, -1, False, folder)  # FSDP2's defaults, and a checkpoint
    result["rank"] = rank
    # ZeRO-2 for the parameters (kept whole from forward to backward), gathered ahead by unshard().
    result["variants"] = {"reshard_false_unshard": fsdp_train(c, rank, 0, True)["params"]}
    c("destroy_process_group")
    # PyTorch's own reader, no process group: the whole tensors from every rank's chunks.
    import torch.distributed.checkpoint as dcp
    state = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in zip(FSDP_NAMES, result["shapes"])}
    dcp.load(state, checkpoint_id=folder)
    result["dcp_torch"] = [v for n in FSDP_NAMES for v in state[n].flatten().tolist()]
    ref, norms = fsdp_reference(world)
    result["reference"] = [v for p in ref for v in p.detach().flatten().tolist()]
    result["reference_norms"] = norms
    return result


def main():
    mode, out = sys.argv[1], sys.argv[2]
    result = run_capi() if mode == "capi" else run_fsdp(out) if mode == "fsdp" else run_torch()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
