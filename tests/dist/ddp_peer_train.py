"""One rank training a small model with torch.nn.parallel.DistributedDataParallel (PyTorch 2.x from
.venv, gloo, env://); tests/dist/ddp_peer_train.cpp is the dtrain side, the same steps call for call
and the same float64 arithmetic, so Python and C++ ranks can train one model in one job
(tests/dist/test_pytorch_peers_ddp.py).

  ddp_peer_train.py --mode MODE[,MODE...] [--steps N] --out DIR
  MODE: unused, default, bucketview, static, small, smallunused, join, joindefault or ignored

small and smallunused are default and unused with bucket_cap_mb=0.001 (1048 bytes): several buckets.
join and joindefault are unused and default with uneven inputs under Join: rank r runs 7 r steps
fewer, and writes one more record, the model after the Join. ignored is default with the branch's
parameters left out of DDP (_set_params_and_buffers_to_ignore_for_model): each rank keeps its own.

The modes run one after another in the one process group, each with a fresh model, DDP and
optimizer (a job of several modes starts its processes once: their start is most of a short job's
time). After every step it appends this rank's parameters (named_parameters order) and then the
BatchNorm buffers running_mean and running_var, as raw little-endian float64, to
DIR/MODE/rank<r>.bin. Prints "ddp_peer_train: ALL OK" and the language at the end; any error: one
line on stderr, exit 1. The group timeout is $DTRAIN_TIMEOUT_S seconds (as on the C++ ranks; default 30 min).
"""
import argparse
import contextlib
import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.branch = torch.nn.Linear(16, 4)

    def forward(self, x, use_branch):
        h = torch.relu(self.bn(self.fc1(x)))
        out = self.fc2(h)
        if use_branch:
            out = out + self.branch(h)
        return out


def use_branch(mode, step, rank):
    if mode in ("unused", "smallunused", "join"):
        # Steps where every rank, only rank 1, or no rank uses the branch.
        return step % 6 == 0 or (step % 6 == 2 and rank == 1)
    return mode != "static"  # static: the branch is never used


def batch(rank, step):
    f64 = dict(dtype=torch.float64)
    x = torch.sin(torch.arange(32 * 8, **f64).reshape(32, 8) * 0.01 * (rank + 1) + step)
    y = torch.cos(torch.arange(32 * 4, **f64).reshape(32, 4) * 0.02 * (rank + 1) + 0.5 * step)
    return x, y


MODES = ("unused", "default", "bucketview", "static", "small", "smallunused", "join", "joindefault", "ignored")


def parse_modes(text):
    modes = text.split(",")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    return modes


def train(mode, steps, out):
    """One mode: a fresh model, DDP and optimizer; writes OUT/MODE/rank<r>.bin."""
    rank = dist.get_rank()
    model = Net()
    with torch.no_grad():
        # Deterministic and independent of any RNG, so that C++ builds the same numbers.
        for k, (_, p) in enumerate(model.named_parameters()):
            p.copy_(0.3 * torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + k).reshape(p.shape))
        if rank != 0:
            # DDP must broadcast rank 0's parameters: without it these ranks would train other numbers.
            for p in model.parameters():
                p.add_(1.0)

    small = mode in ("small", "smallunused")
    if mode == "ignored":
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["branch.weight", "branch.bias"])
    ddp = DDP(model, find_unused_parameters=mode in ("unused", "smallunused", "join"),
              gradient_as_bucket_view=mode == "bucketview", static_graph=mode == "static",
              bucket_cap_mb=0.001 if small else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2, foreach=False)

    def write_record(f):
        state = [p.detach().reshape(-1) for p in model.parameters()]
        state += [model.bn.running_mean.reshape(-1), model.bn.running_var.reshape(-1)]
        f.write(torch.cat(state).to(torch.float64).numpy().astype("<f8").tobytes())

    uneven = mode in ("join", "joindefault")
    os.makedirs(os.path.join(out, mode), exist_ok=True)
    path = os.path.join(out, mode, f"rank{rank}.bin")
    with open(path, "wb") as f, (Join([ddp]) if uneven else contextlib.nullcontext()):
        for step in range(steps - (7 * rank if uneven else 0)):
            x, y = batch(rank, step)
            branch = use_branch(mode, step, rank)
            if step % 5 == 3:
                # Accumulate locally: no optimizer step, the next step's gradients add to these.
                with ddp.no_sync():
                    F.mse_loss(ddp(x, branch), y).backward()
            else:
                F.mse_loss(ddp(x, branch), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            write_record(f)
    if uneven:  # the model every rank holds after the Join
        with open(path, "ab") as f:
            write_record(f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", type=parse_modes, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_default_dtype(torch.float64)
    # One intra-op thread, as the C++ side: no result may depend on how a kernel splits its work.
    torch.set_num_threads(1)
    # $DTRAIN_TIMEOUT_S is the C++ ranks' group timeout: the test sets both, so that a job whose
    # ranks disagree on a call fails within it on every rank instead of waiting 30 min.
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("DTRAIN_TIMEOUT_S", "1800"))))
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # PyTorch's DDP segfaults when it logs its construction on a Gloo group that DETAIL wrapped in
        # a ProcessGroupWrapper (c10d::Logger::set_env_variables takes the wrapper for the Gloo group,
        # even with 1 rank and no dtrain rank). That log line only informs: skip it, keep the
        # wrapper's checks before every collective, which are what a DETAIL job tests.
        class ConstructionNotLogged(dist.Logger):
            def set_construction_data_and_log(self, *args, **kwargs):
                pass

        dist.Logger = ConstructionNotLogged

    for mode in args.mode:
        train(mode, args.steps, args.out)
        # Nothing that holds the group may outlive it (Gloo's threads join there), and no mode's
        # DDP the next one: DDP's reducer sits in reference cycles, which only the collector frees.
        gc.collect()
    dist.destroy_process_group()
    print("ddp_peer_train: ALL OK", flush=True)
    print("ddp_peer_train: language Python", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001: any failure is one line and exit 1
        print(f"ddp_peer_train: error: {type(e).__name__}: {e}".replace("\n", " "), file=sys.stderr, flush=True)
        sys.exit(1)
    # Everything is written and the group destroyed. PyTorch 2.15's own teardown at interpreter exit
    # aborted once ("terminate called without an active exception", all three ranks Python, after
    # ALL OK): leave without it, as the work it would do is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
