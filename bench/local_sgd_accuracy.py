#!/usr/bin/env python3
"""Accuracy of LocalSGD and DiLoCo against DDP on the main job: examples/train_fashion_mnist as
README runs it (5 epochs, batch 32 per rank, Adam, seed 0), 2 ranks, once with DDP's per-step
gradient all-reduce and once each with the replicas meeting every H steps instead (--local_sgd H,
--diloco H). Accuracy does not depend on the machine's load, so the jobs run one after the other.

    python3 bench/local_sgd_accuracy.py --build build [--sync_every 20] [--epochs 5]

    RESULT local_sgd_accuracy_gap_points=G diloco_accuracy_gap_points=D ddp_test_accuracy=A ...
    (the gaps: DDP's test accuracy minus the method's, in points; goal: |gap| <= 0.5)
"""
import argparse
import os
import re
import subprocess
import sys

RESULT = re.compile(r"RESULT epochs=\d+ test_accuracy=([0-9.]+) ")


def run(build, epochs, flags, timeout):
    argv = [os.path.join(build, "bin", "dtrain-run"), "--standalone", "--nproc_per_node", "2",
            os.path.join(build, "bin", "train_fashion_mnist"), "--epochs", str(epochs), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    m = RESULT.search(res.stdout)
    if res.returncode != 0 or not m:
        sys.exit(f"local_sgd_accuracy: {' '.join(argv)} failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    for line in res.stdout.splitlines():
        if "Epoch " in line or "RESULT" in line:
            print("   ", line, flush=True)
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--sync_every", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args()
    acc = {}
    for name, flags in (("ddp", []), ("local_sgd", ["--local_sgd", str(a.sync_every)]),
                        ("diloco", ["--diloco", str(a.sync_every)])):
        print(f"{name}: {' '.join(flags) or 'DDP'}", flush=True)
        acc[name] = run(a.build, a.epochs, flags, a.timeout)
    gaps = {k: 100 * (acc["ddp"] - acc[k]) for k in ("local_sgd", "diloco")}
    for k, g in gaps.items():
        print(f"{k} at H = {a.sync_every}: test accuracy {acc[k]:.4f}, {g:+.2f} points below DDP's {acc['ddp']:.4f} "
              f"(goal: within 0.5: {'met' if abs(g) <= 0.5 else 'missed'})")
    print(f"RESULT local_sgd_accuracy_gap_points={gaps['local_sgd']:.2f} diloco_accuracy_gap_points={gaps['diloco']:.2f} "
          f"ddp_test_accuracy={acc['ddp']:.4f} local_sgd_test_accuracy={acc['local_sgd']:.4f} "
          f"diloco_test_accuracy={acc['diloco']:.4f}")


if __name__ == "__main__":
    main()
