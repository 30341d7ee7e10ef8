#!/usr/bin/env python3
"""HSDP against flat fully_shard when the nodes are joined by a slow link (needs root and iproute2).

Two "nodes" of 2 ranks: two network namespaces joined by a veth pair, each end shaped to 1 Gbit/s
(tc tbf) with addresses 10.77.0.1/24 and 10.77.0.2/24 on the ends, made by this script and deleted
on exit, failure and signal alike. Inside a node the ranks share memory (DTRAIN_SHM_HOST names the
node, since both namespaces see one /dev/shm) and loopback; between the nodes Gloo's TCP crosses
the veth. Rank 0 hosts the store on 10.77.0.1, which the other node reaches across the link.

Each repetition runs build/bin/bench_hsdp (bench/bench_hsdp.cpp says what a step is) twice: flat
fully_shard over the 4 ranks and HSDP over {replicate 2, shard 2} (a shard group inside a node),
which goes first alternating, so both see the same load. Reports the median of the repetitions'
HSDP step over flat step, its spread, and the bytes node 0's end of the link sent and received per
step in each mode:

    python3 bench/hsdp_slow_link.py --build build [--reps 5] [--rate 1gbit]

    RESULT hsdp_step_vs_fsdp_slow_link=R hsdp_link_bytes_per_step=H flat_link_bytes_per_step=F
    (goal: R <= 0.6; bytes: tx + rx of node 0's end)
"""
import argparse
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time

TAG = f"{os.getpid() % 100000}"
NS = [f"dtrain-hsdp{TAG}a", f"dtrain-hsdp{TAG}b"]
VETH = [f"dthsdp{TAG}a", f"dthsdp{TAG}b"]
ADDR = ["10.77.0.1", "10.77.0.2"]


def ip(*args):
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise RuntimeError(f"'ip {' '.join(args)}' failed: {res.stderr.strip()}")


def tc(*args):
    res = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise RuntimeError(f"'tc {' '.join(args)}' failed: {res.stderr.strip()}")


class SlowLink:
    """The two namespaces and the shaped veth between them; close() deletes them (and so the veth)."""

    def __init__(self, rate):
        self.made = []
        try:
            for ns in NS:
                ip("netns", "add", ns)
                self.made.append(ns)
                ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
            for i in range(2):
                ip("link", "set", VETH[i], "netns", NS[i])
                ip("-n", NS[i], "addr", "add", f"{ADDR[i]}/24", "dev", VETH[i])
                ip("-n", NS[i], "link", "set", VETH[i], "up")
                # Each direction at `rate`, as a full-duplex link: tbf on both ends' egress.
                tc("-n", NS[i], "qdisc", "add", "dev", VETH[i], "root", "tbf", "rate", rate, "burst", "256kb",
                   "latency", "50ms")
        except Exception:
            self.close()
            raise

    def close(self):
        # A pair whose second end had not moved yet (setup failed between): delete it here first.
        if os.path.exists(f"/sys/class/net/{VETH[1]}"):
            subprocess.run(["ip", "link", "del", VETH[1]], capture_output=True, timeout=20)
        for ns in self.made:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.made = []


def run_ranks(mode, argvs, envs, timeout, first_key):
    """Starts one process per rank (argv, env), waits for all; rank 0's line that starts with
    `first_key=` as a dict of floats. Kills every rank when one fails or the job runs past timeout."""
    procs = []
    try:
        for argv, env in zip(argvs, envs):
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{mode} job exceeded {timeout} s")
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{mode} job: ranks {failed} failed:\n" +
                               "\n".join(f"--- rank {r}:\n{o[-3000:]}" for r, o in enumerate(outs)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for line in outs[0].splitlines():
        if line.startswith(first_key + "="):
            return {k: float(v) for k, v in (kv.split("=") for kv in line.split())}
    raise RuntimeError(f"{mode} job: rank 0 printed no {first_key} line:\n{outs[0][-3000:]}")


def rank_env(rank, world, node, local_ranks, port, secret):
    """A rank's environment on its node: rank 0's store on node 0's end of the link, shared memory only
    inside a node."""
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % local_ranks), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(local_ranks), GROUP_RANK=str(node), MASTER_ADDR=ADDR[0], MASTER_PORT=str(port),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DTRAIN_SHM_HOST=f"node{node}", DTRAIN_JOB_SECRET=secret)


def run_job(binary, mode, port, args, timeout):
    """One 4-rank job; rank 0's key=value line as a dict. Kills every rank when one fails."""
    secret = secrets.token_hex(32)
    argvs = [["ip", "netns", "exec", NS[r // 2], binary, "--worker", "--mode", mode, "--link", VETH[r // 2], *args]
             for r in range(4)]
    envs = [rank_env(r, 4, r // 2, 2, port, secret) for r in range(4)]
    return run_ranks(mode, argvs, envs, timeout, "step_ms")


def raise_on_signal(signum, _frame):
    raise SystemExit(f"hsdp_slow_link: signal {signum}, cleaning up")


def prepare(name, build, target):
    """The worker's path, once root and iproute2 are there; SIGTERM and SIGHUP clean up as ^C does."""
    binary = os.path.abspath(os.path.join(build, "bin", target))
    if not os.path.exists(binary):
        sys.exit(f"{name}: {binary} does not exist: build the {target} target (-DDTRAIN_BUILD_BENCH=ON)")
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit(f"{name}: needs root, ip and tc (iproute2) to make the nodes' network namespaces")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_on_signal)
    return binary


def measure(binary, args, reps, timeout):
    rows = {"flat": [], "hsdp": []}
    ratios = []
    port = 29500
    for r in range(reps):
        order = ["flat", "hsdp"] if r % 2 == 0 else ["hsdp", "flat"]
        got = {}
        for mode in order:
            port += 1  # a fresh port: the last job's may still be in TIME_WAIT
            got[mode] = run_job(binary, mode, port, args, timeout)
            rows[mode].append(got[mode])
        ratios.append(got["hsdp"]["step_ms"] / got["flat"]["step_ms"])
        print(f"| {r} | {got['flat']['step_ms']:.0f} | {got['hsdp']['step_ms']:.0f} | {ratios[-1]:.3f} |", flush=True)
    return rows, ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="the build folder with bin/bench_hsdp")
    ap.add_argument("--reps", type=int, default=5, help="repetitions, each one flat and one HSDP job")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per job (after one warm-up step)")
    ap.add_argument("--rate", default="1gbit", help="each direction's rate on the link (tc's units)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="rows per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per job")
    a = ap.parse_args()
    binary = prepare("hsdp_slow_link", a.build, "bench_hsdp")
    args = ["--steps", str(a.steps), "--layers", str(a.layers), "--width", str(a.width), "--batch", str(a.batch)]
    load = open("/proc/loadavg").read().split()[:3]
    link = SlowLink(a.rate)
    try:
        print(f"hsdp_slow_link: load {' '.join(load)}; 2 nodes x 2 ranks, link {a.rate} each way; "
              f"{a.layers} x Linear {a.width}, batch {a.batch} per rank, Adam\n")
        print("| rep | flat step ms | HSDP step ms | HSDP / flat |\n|---|---|---|---|", flush=True)
        rows, ratios = measure(binary, args, a.reps, a.timeout)
    finally:
        link.close()

    def med(mode, key):
        return statistics.median(r[key] for r in rows[mode])

    link_bytes = {m: med(m, "link_tx_per_step") + med(m, "link_rx_per_step") for m in rows}
    ratio = statistics.median(ratios)
    print(f"\nparameters {rows['flat'][0]['params'] / 1e6:.1f} M; median step: flat {med('flat', 'step_ms'):.0f} ms, "
          f"HSDP {med('hsdp', 'step_ms'):.0f} ms")
    for m in ("flat", "hsdp"):
        print(f"{m}: link bytes per step (node 0's end) sent {med(m, 'link_tx_per_step') / 1e6:.1f} MB, received "
              f"{med(m, 'link_rx_per_step') / 1e6:.1f} MB; rank 0's fully_shard collectives received "
              f"{med(m, 'received_per_step') / 1e6:.1f} MB")
    print(f"HSDP / flat: median {ratio:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); goal <= 0.6: "
          f"{'met' if ratio <= 0.6 else 'missed'}")
    print(f"\nRESULT hsdp_step_vs_fsdp_slow_link={ratio:.3f} hsdp_step_vs_fsdp_slow_link_min={min(ratios):.3f} "
          f"hsdp_step_vs_fsdp_slow_link_max={max(ratios):.3f} hsdp_link_bytes_per_step={link_bytes['hsdp']:.0f} "
          f"flat_link_bytes_per_step={link_bytes['flat']:.0f}")


def run_main(name, main_fn):
    """main_fn() with ^C and a failed job as one line each (the namespaces are deleted by then)."""
    try:
        main_fn()
    except KeyboardInterrupt:
        sys.exit(f"{name}: interrupted (namespaces deleted)")
    except RuntimeError as e:
        sys.exit(f"{name}: {e}")


if __name__ == "__main__":
    run_main("hsdp_slow_link", main)
