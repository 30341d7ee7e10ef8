#!/usr/bin/env python3
"""DiLoCo across a slow link (needs root and iproute2): 2 replicas of the main job's CNN
(build/bin/bench_ft; 421,642 float32 parameters), one rank each, in two network namespaces joined by
a veth (bench/hsdp_slow_link.py's SlowLink) whose ends are shaped with tc tbf to --rate each way, or
not shaped at all. Gloo's TCP crosses the veth (DTRAIN_SHM_HOST differs per namespace).

Each repetition runs six jobs, the order rotating: DiLoCo (sync every --sync_every steps, the
all-reduce blocking) shaped and unshaped, DiLoCo with its all-reduce overlapped with the last
--sync_delay inner steps of each round (Streaming DiLoCo's tau, with alpha --update_alpha) shaped and
unshaped, DDP shaped and unshaped, each --steps timed steps after --warmup. Reports the median
over the repetitions of DiLoCo's steps/s shaped over unshaped, DDP's likewise, and the bytes rank 0's
end of the veth sent per step (against 4 P / H for DiLoCo). Beside it, a load-robust estimate from
each shaped DiLoCo job alone: its step time with its sync time replaced by the unshaped job's
(`_within`; the compute, which other jobs on the machine move, cancels out):

    python3 bench/diloco_slow_link.py --build build [--reps 3] [--rate 200mbit]

    RESULT diloco_slow_link_fraction=F diloco_overlap_slow_link_fraction=O ddp_slow_link_fraction=D
    diloco_link_bytes_per_step=B ...   (goal: F >= 0.9)
"""
import argparse
import os
import secrets
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hsdp_slow_link import NS, VETH, SlowLink, prepare, rank_env, run_main, run_ranks, tc  # noqa: E402


def shape(rate):
    """Both ends' egress at `rate` (tbf), or no qdisc of ours at all (None)."""
    for i in range(2):
        subprocess.run(["tc", "-n", NS[i], "qdisc", "del", "dev", VETH[i], "root"], capture_output=True, timeout=20)
        if rate:
            tc("-n", NS[i], "qdisc", "add", "dev", VETH[i], "root", "tbf", "rate", rate, "burst", "256kb",
               "latency", "50ms")


def run_job(binary, mode, port, args, timeout):
    """One 2-rank job, a rank in each namespace; rank 0's steps_per_s line as a dict."""
    secret = secrets.token_hex(32)
    argvs = [["ip", "netns", "exec", NS[r], binary, "--mode", mode, "--link", VETH[r], *args] for r in range(2)]
    return run_ranks(mode, argvs, [rank_env(r, 2, r, 1, port, secret) for r in range(2)], timeout, "steps_per_s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--sync_every", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per job (a multiple of --sync_every)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--sync_delay", type=int, default=5, help="the overlapped DiLoCo's fragment_sync_delay")
    ap.add_argument("--update_alpha", type=float, default=0.5, help="the overlapped DiLoCo's fragment_update_alpha")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    binary = prepare("diloco_slow_link", a.build, "bench_ft")
    args = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--sync_every", str(a.sync_every), "--batch",
            str(a.batch)]
    load = open("/proc/loadavg").read().split()[:3]
    link = SlowLink(a.rate)
    rows = {k: [] for k in ("diloco_slow", "diloco_fast", "overlap_slow", "overlap_fast", "ddp_slow", "ddp_fast")}
    frac = {"diloco": [], "overlap": [], "ddp": []}
    overlap = ["--sync_delay", str(a.sync_delay), "--update_alpha", str(a.update_alpha)]
    within, within_overlap = [], []
    port = 29700
    try:
        print(f"diloco_slow_link: load {' '.join(load)}; 2 replicas x 1 rank, link {a.rate} each way (tbf) or "
              f"unshaped; FashionCNN, batch {a.batch}, DiLoCo H = {a.sync_every}\n")
        print("| rep | DiLoCo shaped steps/s | unshaped | fraction | overlapped shaped | unshaped | fraction | "
              "DDP shaped | unshaped | fraction | DiLoCo sync "
              "ms/step shaped | unshaped | fraction from the shaped job's own step | overlapped: wait ms/step "
              "shaped | unshaped | fraction from its own step |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
              "---|---|---|",
              flush=True)
        for r in range(a.reps):
            jobs = [(k, rate) for k in ("diloco", "overlap", "ddp") for rate in (a.rate, None)]
            jobs = jobs[r % 6:] + jobs[:r % 6]
            got = {}
            for kind, rate in jobs:
                shape(rate)
                port += 1
                key = f"{kind}_{'slow' if rate else 'fast'}"
                mode, extra = ("diloco", overlap) if kind == "overlap" else (kind, [])
                got[key] = run_job(binary, mode, port, args + extra, a.timeout)
                rows[key].append(got[key])
            for m in frac:
                frac[m].append(got[f"{m}_slow"]["steps_per_s"] / got[f"{m}_fast"]["steps_per_s"])
            # The same from the shaped job alone: its step time with the unshaped job's sync time in
            # place of its own (the compute, which the machine's load moves between jobs, cancels).
            slow, fast = got["diloco_slow"], got["diloco_fast"]
            step_s = 1 / slow["steps_per_s"]
            within.append((step_s - slow["sync_s_per_step"] + fast["sync_s_per_step"]) / step_s)
            o_slow, o_fast = got["overlap_slow"], got["overlap_fast"]
            o_step_s = 1 / o_slow["steps_per_s"]
            within_overlap.append((o_step_s - o_slow["sync_s_per_step"] + o_fast["sync_s_per_step"]) / o_step_s)
            print(f"| {r} | {got['diloco_slow']['steps_per_s']:.1f} | {got['diloco_fast']['steps_per_s']:.1f} | "
                  f"{frac['diloco'][-1]:.3f} | {got['overlap_slow']['steps_per_s']:.1f} | "
                  f"{got['overlap_fast']['steps_per_s']:.1f} | {frac['overlap'][-1]:.3f} | "
                  f"{got['ddp_slow']['steps_per_s']:.1f} | "
                  f"{got['ddp_fast']['steps_per_s']:.1f} | {frac['ddp'][-1]:.3f} | "
                  f"{slow['sync_s_per_step'] * 1e3:.2f} | {fast['sync_s_per_step'] * 1e3:.2f} | {within[-1]:.3f} | "
                  f"{o_slow['sync_s_per_step'] * 1e3:.2f} | {o_fast['sync_s_per_step'] * 1e3:.2f} | "
                  f"{within_overlap[-1]:.3f} |",
                  flush=True)
    finally:
        link.close()
    P = rows["diloco_slow"][0]["params"]
    tx = {k: statistics.median(x["link_tx_per_step"] for x in v) for k, v in rows.items()}
    d, p, o = statistics.median(frac["diloco"]), statistics.median(frac["ddp"]), statistics.median(frac["overlap"])
    print(f"\nP = {P:.0f}; 4 P / H = {4 * P / a.sync_every:.0f} bytes; rank 0's end of the veth sent per step: "
          f"DiLoCo {tx['diloco_slow']:.0f} (shaped), {tx['diloco_fast']:.0f} (unshaped); DDP {tx['ddp_slow']:.0f}")
    print(f"DiLoCo shaped / unshaped: median {d:.3f} (min {min(frac['diloco']):.3f}, max {max(frac['diloco']):.3f}); "
          f"goal >= 0.9: {'met' if d >= 0.9 else 'missed'}")
    print(f"DiLoCo overlapped (fragment_sync_delay {a.sync_delay}, alpha {a.update_alpha}) shaped / unshaped: "
          f"median {o:.3f} (min {min(frac['overlap']):.3f}, max {max(frac['overlap']):.3f})")
    print(f"DDP shaped / unshaped: median {p:.3f} (min {min(frac['ddp']):.3f}, max {max(frac['ddp']):.3f})")
    w, wo = statistics.median(within), statistics.median(within_overlap)
    print(f"DiLoCo from the shaped job's own step (sync time swapped for the unshaped one's): median {w:.3f} "
          f"(min {min(within):.3f}, max {max(within):.3f})")
    print(f"\nRESULT diloco_slow_link_fraction={d:.3f} diloco_slow_link_fraction_min={min(frac['diloco']):.3f} "
          f"diloco_slow_link_fraction_max={max(frac['diloco']):.3f} diloco_overlap_slow_link_fraction={o:.3f} "
          f"diloco_overlap_slow_link_fraction_min={min(frac['overlap']):.3f} "
          f"diloco_overlap_slow_link_fraction_max={max(frac['overlap']):.3f} ddp_slow_link_fraction={p:.3f} "
          f"ddp_slow_link_fraction_min={min(frac['ddp']):.3f} ddp_slow_link_fraction_max={max(frac['ddp']):.3f} "
          f"diloco_link_bytes_per_step={tx['diloco_slow']:.0f} ddp_link_bytes_per_step={tx['ddp_slow']:.0f} "
          f"four_p_over_h={4 * P / a.sync_every:.0f} diloco_slow_link_fraction_within={w:.3f} "
          f"diloco_slow_link_fraction_within_min={min(within):.3f} diloco_slow_link_fraction_within_max={max(within):.3f} "
          f"diloco_overlap_slow_link_fraction_within={wo:.3f} "
          f"diloco_overlap_slow_link_fraction_within_min={min(within_overlap):.3f} "
          f"diloco_overlap_slow_link_fraction_within_max={max(within_overlap):.3f}")


if __name__ == "__main__":
    run_main("diloco_slow_link", main)
