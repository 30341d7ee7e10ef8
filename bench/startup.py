#!/usr/bin/env python3
"""Startup benchmark: wall time from starting a 2-rank job to both ranks past their first barrier.

Side by side, in one run, each variant started the same way from this driver:
  dtrain   dtrain-run --standalone --nproc_per_node 2 hello_distributed --report_times (launcher included)
  bare     two C++ ranks on LibTorch's c10d alone (TCPStore + ProcessGroupGloo), env vars
  python   two /usr/bin/python3 ranks (PyTorch 1.13): import torch; init_process_group("gloo"); barrier()
  python2  the same on PyTorch 2.x (.venv/bin/python, when scripts/setup.sh installed it)

Time is measured from just before the first process is spawned to the later of the two ranks'
"first_barrier_unix_ns" stamps. Median of --repeat whole runs. Peak memory is each rank's VmHWM
(max over ranks, median over runs).

    python3 bench/startup.py --build build [--repeat 5]
Prints a table and a final `RESULT ...` line.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "common"))
from proc_util import free_port  # noqa: E402


def parse(out):
    stamps, rss = [], []
    for line in out.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("first_barrier_unix_ns="):
            stamps.append(int(line.split("=", 1)[1]))
        elif line.startswith("peak_rss_kb="):
            rss.append(int(line.split("=", 1)[1]))
    return stamps, rss


def run_launcher(cmd):
    t0 = time.time_ns()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        sys.exit(f"startup bench: {cmd[0]} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return t0, p.stdout


def run_env_ranks(argv, world=2):
    port = free_port()
    t0 = time.time_ns()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = ""
    for p in procs:
        o, e = p.communicate(timeout=120)
        if p.returncode != 0:
            sys.exit(f"startup bench: {argv[0]} failed ({p.returncode}):\n{o}{e}")
        out += o
    return t0, out


def measure(name, fn, repeat):
    times, mems = [], []
    for _ in range(repeat):
        t0, out = fn()
        stamps, rss = parse(out)
        if len(stamps) != 2:
            sys.exit(f"startup bench: {name}: expected 2 barrier stamps, got {len(stamps)}:\n{out}")
        times.append((max(stamps) - t0) / 1e9)
        mems.append(max(rss) / 1024 if rss else float("nan"))
    return statistics.median(times), statistics.median(mems), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    b = os.path.join(a.build, "bin")
    variants = [
        ("dtrain", lambda: run_launcher([os.path.join(b, "dtrain-run"), "--standalone", "--nproc_per_node",
                                         "2", os.path.join(b, "hello_distributed"), "--report_times"])),
        ("bare_c10d", lambda: run_env_ranks([os.path.join(b, "bare_c10d_hello")])),
        ("python", lambda: run_env_ranks(["/usr/bin/python3", os.path.join(HERE, "python", "hello_barrier.py")])),
    ]
    venv_python = os.path.join(HERE, "..", ".venv", "bin", "python")
    if os.access(venv_python, os.X_OK):  # PyTorch 2.x, installed by scripts/setup.sh
        variants.append(("python2", lambda: run_env_ranks([venv_python, os.path.join(HERE, "python",
                                                                                       "hello_barrier.py")])))
    # Warm the page cache once so the first variant is not charged for cold disk reads.
    for _, fn in variants:
        fn()
    rows = {name: measure(name, fn, a.repeat) for name, fn in variants}
    print(f"{'variant':<10} {'median s':>9} {'peak MiB/rank':>14}   runs (s)")
    for name, (t, m, ts) in rows.items():
        print(f"{name:<10} {t:>9.3f} {m:>14.1f}   " + " ".join(f"{x:.3f}" for x in ts))
    d, bare, py = rows["dtrain"][0], rows["bare_c10d"][0], rows["python"][0]
    py2 = rows["python2"][0] if "python2" in rows else float("nan")
    print(f"python 1.13/dtrain = {py / d:.2f}x   python 2.x/dtrain = {py2 / d:.2f}x (goal >= 1.8x)   "
          f"bare_c10d/dtrain = {bare / d:.2f}x (goal >= 1.0x)")
    print(f"RESULT dtrain_s={d:.3f} bare_c10d_s={bare:.3f} python_s={py:.3f} python2_s={py2:.3f} "
          f"speedup_vs_python={py / d:.2f} speedup_vs_python2={py2 / d:.2f} speedup_vs_bare={bare / d:.2f} "
          f"dtrain_peak_mib={rows['dtrain'][1]:.1f} bare_peak_mib={rows['bare_c10d'][1]:.1f} "
          f"python_peak_mib={rows['python'][1]:.1f}"
          + (f" python2_peak_mib={rows['python2'][1]:.1f}" if "python2" in rows else ""))


if __name__ == "__main__":
    main()
