#!/usr/bin/env python3
"""The LLM recipe (examples/llm/train_llm) measured: its tokens/s with fully_shard on 2 ranks against
its PyTorch twin (tests/dist/llama_twin.py) under PyTorch's own FSDP2 fully_shard on 2 Gloo ranks,
its MFU, and its peak tensor bytes per rank with full activation checkpointing over none.

    python3 bench/bench_llm.py --build build-torch2 [--rounds 3] [--warmup 2] [--steps 6]
    (cmake --build build-torch2 --target bench_llm first: train_llm, dtrain-run, llm_tensor_bytes)

Both jobs: the same model (--dim/--n_layers/--n_heads/--ffn_hidden), the same initial weights
(train_llm's --checkpoint.export_initial in the first round, which dtrain runs first; the twin loads
them), the same windows of the same token file, batch, sequence length, float32, AdamW with
clipping, 1 intra-op thread per rank (train_llm started by dtrain-run, the twin's ranks as torchrun
starts them). Each round runs both, which goes first alternating, so they see the same load; each
excludes its first --warmup steps. dtrain's tokens/s and MFU come from train_llm's metrics.jsonl
(one line a step: --metrics.log_freq 1, a few values all-reduced, as the twin all-reduces its loss
every step); the twin's from rank 0's wall time of each step. MFU is train_llm's own: model FLOPs
per token (llm::flops_per_token) over the matmul peak it measures at start on every rank at once.
Memory: train_llm at --mem_batch x --mem_seq with activation_checkpoint.mode none, then full, each
rank's bytes counted by LibTorch's CPU allocator (build/lib/libllm_tensor_bytes.so preloaded, which
wraps it as bench/counting_allocator.h): every tensor's bytes, parameters, gradients and AdamW's
state included, not RSS.

    RESULT llm_tokens_vs_python_fsdp2=R llm_mfu=M llm_ac_memory_fraction=F ...
    (R: median over rounds of dtrain's tokens/s over the twin's, goal >= 1.2; M: dtrain's MFU, median
    over rounds; F: the larger rank's peak tensor bytes with full checkpointing over none's, goal <= 0.5)
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWIN = os.path.join(ROOT, "tests", "dist", "llama_twin.py")
PEAK_LINE = re.compile(r"matmul peak ([0-9.]+) GFLOP/s per rank")


def harmonic_mean(values):
    """The rate over equal amounts of work (steps of the same tokens) from each part's rate."""
    return len(values) / sum(1.0 / v for v in values)


def dtrain_rates(jsonl_lines, warmup):
    """(tokens/s of the job, MFU) over the steps after `warmup`, from train_llm's metrics.jsonl lines
    of --metrics.log_freq 1 (each line the rates of one step)."""
    steps = [json.loads(line) for line in jsonl_lines if line.strip()]
    timed = [s for s in steps if s["step"] > warmup]
    if not timed:
        raise ValueError(f"metrics.jsonl has {len(steps)} steps, none after the {warmup} warm-up steps")
    return harmonic_mean([s["tokens_per_s_total"] for s in timed]), harmonic_mean([s["mfu"] for s in timed])


def twin_rate(result, warmup, tokens_per_step):
    """The twin's tokens/s of the job over the steps after `warmup` (rank 0's step times)."""
    times = result["step_s"][warmup:]
    if not times:
        raise ValueError(f"the twin ran {len(result['step_s'])} steps, none after the {warmup} warm-up steps")
    return tokens_per_step * len(times) / sum(times)


def peak_bytes(text):
    """peak_bytes of one rank's llm_tensor_bytes file."""
    m = re.search(r"peak_bytes=(\d+)", text)
    if not m:
        raise ValueError(f"no peak_bytes= in {text!r}")
    return int(m.group(1))


def spread(values):
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


class Bench:
    def __init__(self, a, tmp):
        self.a, self.tmp = a, tmp
        self.launcher = os.path.join(a.build, "bin", "dtrain-run")
        self.train_llm = os.path.join(a.build, "bin", "train_llm")
        self.preload = os.path.join(a.build, "lib", "libllm_tensor_bytes.so")
        for path in (self.launcher, self.train_llm, self.preload):
            if not os.path.exists(path):
                sys.exit(f"bench_llm: {path} is missing: cmake --build {a.build} --target bench_llm")
        if not os.access(a.python, os.X_OK):
            sys.exit(f"bench_llm: --python {a.python} is not executable: point it at .venv/bin/python")
        self.initial = os.path.join(tmp, "initial.safetensors")
        # Flags both programs read alike (the twin parses train_llm's flags).
        self.common = ["--job.config_file", os.path.join(ROOT, "examples", "llm", "configs", "debug.toml"),
                       "--data.corpus_dir", a.corpus, "--data.cache_dir", os.path.join(tmp, "tokens"),
                       "--model.dim", str(a.dim), "--model.n_layers", str(a.n_layers), "--model.n_heads",
                       str(a.n_heads), "--model.ffn_hidden", str(a.ffn_hidden), "--training.dtype", "float32",
                       "--parallelism.data_parallel_shard_degree", "2"]
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LD_PRELOAD")}
        self.env["OMP_NUM_THREADS"] = "1"

    def launch(self, program, env=None, timeout=None):
        argv = [self.launcher, "--standalone", "--nproc_per_node", "2", *program]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout or self.a.timeout,
                             env=env or self.env)
        if res.returncode != 0:
            sys.exit(f"bench_llm: {' '.join(argv)} failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res.stdout

    def launch_python(self, argv):
        """2 ranks of a PyTorch program, started as torchrun starts them (env://, rank 0 hosts the
        store: dtrain-run's own store asks for the job's secret, which PyTorch's ranks do not send)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(self.env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(2)]
        outs = [p.communicate(timeout=self.a.timeout)[0] for p in procs]
        for r, p in enumerate(procs):
            if p.returncode != 0:
                sys.exit(f"bench_llm: rank {r} of {' '.join(argv)} failed (exit {p.returncode}):\n{outs[r]}")

    def dtrain(self, name, batch, seq, steps, extra=(), env=None):
        """train_llm on 2 ranks with fully_shard; its stdout and metrics.jsonl lines."""
        dump = os.path.join(self.tmp, name)
        out = self.launch([self.train_llm, *self.common, "--training.local_batch_size", str(batch),
                           "--training.seq_len", str(seq), "--training.steps", str(steps),
                           "--training.threads", "1", "--metrics.log_freq", "1", "--validation.max_windows", "2",
                           "--validation.sample_tokens", "1", "--job.dump_folder", dump, *extra], env=env)
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            lines = f.readlines()
        os.remove(os.path.join(dump, "metrics.jsonl"))  # it appends: the next run starts a fresh file
        return out, lines

    def speed_dtrain(self):
        # The first run also writes the initial weights the twin starts from (before its first step,
        # outside the timed steps).
        export = [] if os.path.exists(self.initial) else ["--checkpoint.export_initial", self.initial]
        out, lines = self.dtrain("speed", self.a.batch, self.a.seq, self.a.warmup + self.a.steps, export)
        m = PEAK_LINE.search(out)
        return (*dtrain_rates(lines, self.a.warmup), float(m.group(1)) if m else float("nan"))

    def speed_twin(self):
        out = os.path.join(self.tmp, "twin.json")
        self.launch_python([self.a.python, TWIN, "--twin.initial", self.initial, *self.common,
                     "--training.local_batch_size", str(self.a.batch), "--training.seq_len", str(self.a.seq),
                     "--training.steps", str(self.a.warmup + self.a.steps), out])
        with open(out) as f:
            result = json.load(f)
        return twin_rate(result, self.a.warmup, 2 * self.a.batch * self.a.seq)

    def memory(self, mode):
        """The larger rank's peak tensor bytes, and its peak RSS (MiB), of mem_steps steps."""
        prefix = os.path.join(self.tmp, f"bytes_{mode}")
        env = dict(self.env, LD_PRELOAD=self.preload, DTRAIN_BENCH_TENSOR_BYTES=prefix)
        _, lines = self.dtrain(f"mem_{mode}", self.a.mem_batch, self.a.mem_seq, self.a.mem_steps,
                               ["--activation_checkpoint.mode", mode], env=env)
        ranks = []
        for r in range(2):
            with open(f"{prefix}.{r}") as f:
                ranks.append(peak_bytes(f.read()))
        return max(ranks), max(json.loads(lines[-1])["peak_rss_mib"])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data", "shakespeare"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per job and round, after --warmup")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--n_layers", type=int, default=4)
    ap.add_argument("--n_heads", type=int, default=4)
    ap.add_argument("--ffn_hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=4, help="windows per rank and step")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mem_batch", type=int, default=16)
    ap.add_argument("--mem_seq", type=int, default=256)
    ap.add_argument("--mem_steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    for name in ("rounds", "steps", "batch", "seq", "mem_batch", "mem_seq", "mem_steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: must be at least 1")
    if a.warmup < 0:
        ap.error(f"--warmup {a.warmup}: must be 0 or more")
    return a


def main():
    a = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_llm.") as tmp:
        b = Bench(a, tmp)
        print(f"model dim {a.dim}, {a.n_layers} layers, {a.n_heads} heads, ffn {a.ffn_hidden}; 2 ranks x 1 thread, "
              f"{a.batch} x {a.seq} tokens per rank and step, float32; {a.warmup} warm-up + {a.steps} timed steps",
              flush=True)
        ratios, mine, theirs, mfus = [], [], [], []
        for r in range(a.rounds):
            got = {}
            for job in (("dtrain", "twin") if r % 2 == 0 else ("twin", "dtrain")):
                got[job] = b.speed_dtrain() if job == "dtrain" else b.speed_twin()
            tps, mfu, peak = got["dtrain"]
            ratios.append(tps / got["twin"])
            mine.append(tps)
            theirs.append(got["twin"])
            mfus.append(mfu)
            print(f"round {r}: dtrain {tps:.0f} tokens/s (MFU {100 * mfu:.1f}% of {peak:.2f} GFLOP/s per rank), "
                  f"PyTorch FSDP2 twin {got['twin']:.0f} tokens/s, ratio {ratios[-1]:.3f}", flush=True)
        none_bytes, none_rss = b.memory("none")
        full_bytes, full_rss = b.memory("full")
    ratio, mfu, fraction = statistics.median(ratios), statistics.median(mfus), full_bytes / none_bytes
    print(f"tokens/s over the twin's: {spread(ratios)} (goal >= 1.2: {'met' if ratio >= 1.2 else 'missed'}); "
          f"MFU {spread(mfus)}")
    print(f"peak tensor bytes per rank at {a.mem_batch} x {a.mem_seq}: none {none_bytes / 2**20:.1f} MiB, full "
          f"{full_bytes / 2**20:.1f} MiB, fraction {fraction:.3f} (goal <= 0.5: {'met' if fraction <= 0.5 else 'missed'}); "
          f"peak RSS none {none_rss:.0f} MiB, full {full_rss:.0f} MiB")
    print(f"RESULT llm_tokens_vs_python_fsdp2={ratio:.3f} llm_mfu={mfu:.4f} llm_ac_memory_fraction={fraction:.3f} "
          f"llm_ratio_min={min(ratios):.3f} llm_ratio_max={max(ratios):.3f} "
          f"llm_tokens_per_s={statistics.median(mine):.0f} llm_fsdp2_tokens_per_s={statistics.median(theirs):.0f} "
          f"llm_ac_peak_none_bytes={none_bytes} llm_ac_peak_full_bytes={full_bytes}")


if __name__ == "__main__":
    main()
