"""The PyTorch twin of examples/llm/train_llm (run by .venv's PyTorch 2.x, CPU; test_llama_twin.py
drives it): torchtitan's Llama written in plain torch.nn with dtrain's parameter names, loaded from
the safetensors file train_llm writes with --checkpoint.export_initial, trained on the same windows
of the same token file in the same order, with torch.optim.AdamW, a LambdaLR of train_llm's warmup
and cosine schedule and torch.nn.utils.clip_grad_norm_.

  llama_twin.py --twin.initial FILE [--twin.dcp DIR] [--twin.final FILE] [train_llm's flags...] OUT.json

The train_llm flags are read as train_llm reads them (defaults, then --job.config_file's TOML, then
the flags), so a test hands both programs one argument list. On one process the twin trains the
whole local batch itself; on several (env://, Gloo) each rank is a data-parallel rank of PyTorch's
own fully_shard (FSDP2: each block a unit, then the root, as torchtitan's apply_fsdp). Rank 0 writes
OUT.json: every step's loss (averaged over the ranks), gradient norm, learning rate and wall time
(rank 0's, seconds: bench/bench_llm.py's tokens/s), and with
--twin.dcp, per parameter the largest difference between the twin's trained parameters and what
torch.distributed.checkpoint's dcp.load read from dtrain's DCP folder DIR into a fresh twin's
state dict (names missing on either side listed); with --twin.final, the same against the
safetensors file train_llm wrote with --checkpoint.export_final.
"""
import json
import math
import os
import sys
import time
import tomllib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from reference_util import end_group

# train_llm's defaults (examples/llm/job_config.h) of the keys the twin uses; every other key is
# accepted and has no effect here (logging, checkpoints, validation, threads).
DEFAULTS = {
    "model.vocab_size": 264, "model.dim": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 0,
    "model.ffn_hidden": 384, "model.rope_theta": 500000.0,
    "data.corpus_dir": "data/shakespeare", "data.cache_dir": "",
    "training.steps": 100, "training.local_batch_size": 8, "training.seq_len": 256,
    "training.gradient_accumulation_steps": 1, "training.max_norm": 1.0, "training.seed": 0,
    "training.dtype": "float32",
    "optimizer.lr": 8e-4, "optimizer.beta1": 0.9, "optimizer.beta2": 0.95, "optimizer.eps": 1e-8,
    "optimizer.weight_decay": 0.1,
    "lr_scheduler.warmup_steps": 10, "lr_scheduler.lr_min": 0.1,
    "parallelism.data_parallel_replicate_degree": 1, "parallelism.data_parallel_shard_degree": -1,
    "parallelism.tensor_parallel_degree": 1,
}
NORM_EPS = 1e-5  # llama::ModelArgs::norm_eps (not a train_llm key)


def parse_config(argv):
    """(config, twin options, OUT): train_llm's precedence, defaults < TOML < flags."""
    out, flags, twin = argv[-1], {}, {}
    for name, value in zip(argv[:-1:2], argv[1:-1:2]):
        (twin if name.startswith("--twin.") else flags)[name[2:]] = value
    cfg = dict(DEFAULTS)
    if "job.config_file" in flags:
        with open(flags["job.config_file"], "rb") as f:
            for section, table in tomllib.load(f).items():
                for key, value in table.items():
                    if f"{section}.{key}" in cfg:
                        cfg[f"{section}.{key}"] = value
    for name, text in flags.items():
        if name in cfg:
            cfg[name] = type(DEFAULTS[name])(text)
    return cfg, twin, out


# --- the model: torchtitan's llama3 ------------------------------------------------------------------
def precompute_freqs_cis(head_dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex128 [end, head_dim / 2]


def apply_rotary_emb(x, freqs_cis):
    """x [B, T, heads, head_dim]: each adjacent pair a complex number times freqs_cis[t]."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    # In x's precision, as dtrain rounds its cos and sin tables to x's dtype (complex64 in float32:
    # not a complex128 product per element, which would also slow the benchmark's twin).
    freqs = freqs_cis.to(xc.dtype).view(1, x.shape[1], 1, -1)
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


def repeat_kv(x, n_rep):
    b, t, kv, hd = x.shape
    return x if n_rep == 1 else x[:, :, :, None, :].expand(b, t, kv, n_rep, hd).reshape(b, t, kv * n_rep, hd)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis[:t]), apply_rotary_emb(k, freqs_cis[:t])
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=NORM_EPS)
        self.ffn_norm = nn.RMSNorm(dim, eps=NORM_EPS)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, heads = cfg["model.dim"], cfg["model.n_heads"]
        kv_heads = cfg["model.n_kv_heads"] or heads
        self.tok_embeddings = nn.Embedding(cfg["model.vocab_size"], dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, kv_heads, cfg["model.ffn_hidden"])
                                    for _ in range(cfg["model.n_layers"]))
        self.norm = nn.RMSNorm(dim, eps=NORM_EPS)
        self.output = nn.Linear(dim, cfg["model.vocab_size"], bias=False)
        # Not a buffer, as in dtrain: the state dict holds the parameters alone.
        self.freqs_cis = precompute_freqs_cis(dim // heads, cfg["training.seq_len"], cfg["model.rope_theta"])

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# --- the data: train_llm's loader ----------------------------------------------------------------------
class Windows:
    """train_llm's next_batch: DistributedSampler(drop_last) over the token file's non-overlapping
    windows of seq_len + 1 tokens, the next local_batch_size of this rank's indices, a new epoch when
    fewer are left."""

    def __init__(self, path, seq, dp, dp_rank, seed):
        self.tokens = np.fromfile(path, dtype=np.uint16)
        self.seq = seq
        n = (len(self.tokens) - 1) // seq if len(self.tokens) > seq else 0
        self.sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=dp, rank=dp_rank, shuffle=True,
                                                           seed=seed, drop_last=True)
        self.epoch, self.indices, self.pos = 0, None, 0

    def next(self, batch):
        while True:
            if self.indices is None:
                self.sampler.set_epoch(self.epoch)
                self.indices, self.pos = list(self.sampler), 0
            if self.pos + batch <= len(self.indices):
                rows = [torch.from_numpy(self.tokens[i * self.seq:i * self.seq + self.seq + 1].astype(np.int64))
                        for i in self.indices[self.pos:self.pos + batch]]
                self.pos += batch
                return torch.stack(rows)
            self.epoch, self.indices = self.epoch + 1, None


def lr_lambda(cfg):
    """train_llm's lr_at(step) / lr for LambdaLR, whose last_epoch is the steps done (step - 1)."""
    warmup, steps, lr_min = cfg["lr_scheduler.warmup_steps"], cfg["training.steps"], cfg["lr_scheduler.lr_min"]

    def factor(done):
        step = done + 1
        if step <= warmup:
            return step / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return lr_min + (1 - lr_min) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


# --- training -------------------------------------------------------------------------------------
def build(cfg, initial, world):
    dtype = torch.float64 if cfg["training.dtype"] == "float64" else torch.float32
    model = Transformer(cfg).to(dtype)
    model.load_state_dict(load_file(initial), strict=True)
    if world > 1:
        tp, replicas = cfg["parallelism.tensor_parallel_degree"], cfg["parallelism.data_parallel_replicate_degree"]
        if tp != 1 or replicas != 1:
            raise SystemExit(f"llama_twin: tensor_parallel_degree {tp}, data_parallel_replicate_degree {replicas}: "
                             "on several ranks the twin is fully_shard over all of them; set both to 1")
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def train(cfg, model, world, rank):
    seq, batch, accum = cfg["training.seq_len"], cfg["training.local_batch_size"], \
        cfg["training.gradient_accumulation_steps"]
    cache = cfg["data.cache_dir"] or os.path.join(cfg["data.corpus_dir"], "tokens")
    data = Windows(os.path.join(cache, "train.bin"), seq, world, rank, cfg["training.seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer.lr"],
                            betas=(cfg["optimizer.beta1"], cfg["optimizer.beta2"]), eps=cfg["optimizer.eps"],
                            weight_decay=cfg["optimizer.weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    log = {"loss": [], "grad_norm": [], "lr": [], "step_s": []}
    for _ in range(cfg["training.steps"]):
        started = time.perf_counter()
        opt.zero_grad()
        loss_sum = 0.0
        for _ in range(accum):
            w = data.next(batch)
            logits = model(w[:, :seq])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1)) / accum
            loss.backward()
            loss_sum += loss.item()
        max_norm = cfg["training.max_norm"]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        log["lr"].append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if world > 1:
            t = torch.tensor([loss_sum], dtype=torch.float64)
            dist.all_reduce(t)
            loss_sum = t.item() / world
        log["loss"].append(loss_sum)
        log["grad_norm"].append(norm.item())
        log["step_s"].append(time.perf_counter() - started)
    return log


def differences(model, loaded):
    """Per parameter of `model`, the largest difference from `loaded` (names missing on either side listed)."""
    mine = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    return {"missing": sorted(set(mine) ^ set(loaded)),
            "shapes": {k: [list(mine[k].shape), list(loaded[k].shape)] for k in mine if k in loaded},
            "max_abs_diff": {k: (loaded[k] - mine[k]).abs().max().item() for k in mine
                             if k in loaded and loaded[k].shape == mine[k].shape},
            "max_abs": {k: mine[k].abs().max().item() for k in mine}}


def compare_dcp(cfg, model, folder):
    """dcp.load of dtrain's folder into a fresh twin's state dict (model.* keys), against `model`."""
    import torch.distributed.checkpoint as dcp
    fresh = Transformer(cfg).to(next(model.parameters()).dtype)
    loaded = fresh.state_dict()
    dcp.load({"model": loaded}, checkpoint_id=folder)
    return differences(model, loaded)


def main():
    cfg, twin, out = parse_config(sys.argv[1:])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64 if cfg["training.dtype"] == "float64" else torch.float32)
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    model = build(cfg, twin["twin.initial"], world)
    result = train(cfg, model, world, rank)
    if "twin.dcp" in twin:
        result["dcp"] = compare_dcp(cfg, model, twin["twin.dcp"])
    if "twin.final" in twin:  # safetensors' own reader of train_llm's --checkpoint.export_final
        result["final"] = differences(model, load_file(twin["twin.final"]))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if world > 1:
        del model
        end_group()  # fully_shard's hooks hold their module: freed before the group ends


if __name__ == "__main__":
    main()
