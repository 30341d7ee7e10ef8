"""The Python side of tests/dist/peer_rank.cpp: the same calls in the same order, with PyTorch 2.x's
torch.distributed (gloo, env://). Prints the same lines."""
import sys

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

failures = 0


def check(ok, what):
    global failures
    print(("ok " if ok else "FAILED ") + what, flush=True)
    failures += 0 if ok else 1


dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
f64 = dict(dtype=torch.float64)



class TwoDtypes(torch.nn.Module):
    """A float32 and a float64 Linear side by side (peer_rank.cpp's TwoDtypes)."""

    def __init__(self):
        super().__init__()
        self.f = torch.nn.Linear(4, 2)
        self.d = torch.nn.Linear(4, 2).double()

    def forward(self, x):
        return self.f(x).sum() + self.d(x.double()).sum().float()


if sys.argv[1:2] == ["--hostile_rebuild"]:
    # A hostile rank 0 beside peer_rank.cpp's `--ddp trained` (DDP over Linear(4, 2): a weight [2, 4]
    # and a bias [2]): DDP's construction and first backward as Python's DDP makes them, then a bucket
    # rebuild (sync_bucket_indices: int32 indices and the bucket count, then int32 sizes) that is no
    # partition of the two parameters. The dtrain rank must refuse it in one line.
    indices, sizes = {"index": ([5, 0, 1], [2]), "count": ([0, 1, 1 << 30], [1]),
                      "sizes": ([1, 0, 1], [1 << 30])}[sys.argv[2]]
    try:
        dist.all_gather([torch.empty(1, dtype=torch.int64) for _ in range(n)], torch.tensor([2]))
        dist.broadcast(torch.tensor([2, 4, 4, 1, 2, 1]), 0)
        dist.broadcast(torch.zeros(10), 0)
        dist.all_reduce(torch.zeros(10))
        dist.broadcast(torch.tensor(indices, dtype=torch.int32), 0)
        dist.broadcast(torch.tensor(sizes, dtype=torch.int32), 0)
        print("peer_rank: hostile rebuild sent", flush=True)
    except Exception as e:  # noqa: BLE001: whichever error Gloo raises for a peer that left
        print(f"peer_rank: hostile rebuild failed: {type(e).__name__}", flush=True)
        sys.exit(3)
    sys.exit(0)

if sys.argv[1:2] == ["--hostile_join"]:
    # A hostile rank 0 beside peer_rank.cpp's `--ddp join`: Python's DDP under Join, three steps
    # against the dtrain rank's one, whose common rank at the Join's end (the source of the final
    # model: the largest offer of an all-reduce MAX) is a rank outside the group.
    from torch.distributed.algorithms.join import Join

    def hostile_common_rank(self, input_rank, rank_cond):
        offer = torch.tensor([1 << 20 if rank_cond else -1])
        dist.all_reduce(offer, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(offer.item())

    torch.nn.parallel.DistributedDataParallel._find_common_rank = hostile_common_rank
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        with Join([ddp]):
            for _ in range(3):
                ddp(torch.ones(2, 4)).sum().backward()
        print("peer_rank: hostile join finished", flush=True)
    except Exception as e:  # noqa: BLE001: whichever error the broadcast from no rank raises
        print(f"peer_rank: hostile join failed: {type(e).__name__}", flush=True)
        sys.exit(3)
    sys.exit(0)

if sys.argv[1:2] == ["--ddp"]:
    # The dtrain rank refuses its DDP in one line (peer_rank.cpp's cases) and leaves: Python's DDP
    # must fail promptly, not wait for it.
    kind = sys.argv[2]
    try:
        model = TwoDtypes() if kind == "dtypes" else torch.nn.Linear(4, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        print("peer_rank: DDP was built", flush=True)
        if kind == "zero_join":
            from torch.distributed.algorithms.join import Join
            with Join([ddp]):
                for _ in range(3):
                    ddp(torch.ones(2, 4)).sum().backward()
        else:
            for _ in range(3):
                ddp(torch.ones(2, 4)).sum().backward()
    except Exception as e:  # noqa: BLE001: whichever error Gloo or DDP raises for a peer that left
        print(f"peer_rank: DDP failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        sys.exit(3)
    print("peer_rank: DDP trained alone", flush=True)
    sys.exit(0)

t = torch.full((5,), r + 1.0, **f64)
dist.all_reduce(t)
check(bool((t == n * (n + 1) / 2).all()), "all_reduce SUM")

b = torch.arange(4, **f64) + 10.0 * r
dist.broadcast(b, n - 1)
check(torch.equal(b, torch.arange(4, **f64) + 10.0 * (n - 1)), "broadcast from the last rank")

parts = [torch.empty(2, **f64) for _ in range(n)]
dist.all_gather(parts, torch.full((2,), float(r), **f64))
check(all(bool((p == i).all()) for i, p in enumerate(parts)), "all_gather")

dist.barrier()
check(True, "barrier")

out, inp = torch.full((3,), 100.0 + r, **f64), torch.empty(3, **f64)
sent = dist.isend(out, (r + 1) % n, tag=7)
dist.recv(inp, (r + n - 1) % n, tag=7)
sent.wait()
check(bool((inp == 100.0 + (r + n - 1) % n).all()), "send/recv ring")

dist.all_reduce(t, op=dist.ReduceOp.MAX)
check(bool((t == n * (n + 1) / 2).all()), "all_reduce MAX")

# Subgroups: ranks 0 and 1 (one of each language in every layout) all-reduce while a third rank does
# not; then a group of every rank, listed in reverse (new_group sorts them).
g1 = dist.new_group([0, 1])
if r < 2:
    s = torch.full((2,), r + 1.0, **f64)
    dist.all_reduce(s, group=g1)
    check(bool((s == 3).all()), "subgroup [0, 1] all_reduce")
else:
    check(g1 == dist.GroupMember.NON_GROUP_MEMBER, "subgroup [0, 1]: not a member")
g2 = dist.new_group(list(reversed(range(n))))
s = torch.full((2,), 10.0 * (r + 1), **f64)
dist.all_reduce(s, group=g2)
check(bool((s == 10 * n * (n + 1) / 2).all()) and dist.get_rank(g2) == r, "second subgroup all_reduce")

sampler = DistributedSampler(range(101), seed=7)
sampler.set_epoch(3)
print("sampler indices " + " ".join(str(i) for i in sampler), flush=True)

del sent  # no reference to a Work or the backend may outlive the group (Gloo's threads join there)
dist.destroy_process_group()
if failures:
    sys.exit(1)
print("peer_rank: ALL OK", flush=True)
print("peer_rank: language Python", flush=True)  # the test checks each position ran the side it asked for
