#!/usr/bin/env python3
"""Runs examples/c/ddp_train.c (the C API) and its C++ twin ddp_train_ref under dtrain-run and fails
unless every rank of both runs printed the same parameters' hash and the loss fell.

  check_same_params.py DTRAIN_RUN NPROC C_PROGRAM CXX_PROGRAM [ARGS...]
"""
import re
import subprocess
import sys

RESULT = re.compile(r"^(?:\[rank (\d+)\] )?RESULT steps=\d+ world=(\d+) first_loss=([0-9.]+) "
                    r"final_loss=([0-9.]+) params_hash=([0-9a-f]{16})$")


def run(launcher, nproc, program, args):
    cmd = [launcher, "--standalone", "--nproc_per_node", str(nproc), "--grace_period", "2", program] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    out = p.stdout + p.stderr
    print(f"$ {' '.join(cmd)}\n{out}")
    if p.returncode != 0:
        sys.exit(f"check_same_params: error: {program} exited {p.returncode}")
    results = {}
    for line in out.splitlines():
        m = RESULT.match(line.strip())
        if m:
            results[int(m.group(1) or 0)] = (float(m.group(3)), float(m.group(4)), m.group(5))
    if sorted(results) != list(range(nproc)):
        sys.exit(f"check_same_params: error: {program}: RESULT lines from ranks {sorted(results)}, expected "
                 f"0..{nproc - 1}")
    return results


def main():
    launcher, nproc, c_program, cxx_program, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
    c = run(launcher, nproc, c_program, args)
    cxx = run(launcher, nproc, cxx_program, args)
    hashes = {f"C rank {r}": v[2] for r, v in c.items()} | {f"C++ rank {r}": v[2] for r, v in cxx.items()}
    if len(set(hashes.values())) != 1:
        sys.exit(f"check_same_params: error: the parameters differ: {hashes}")
    first, final = c[0][0], c[0][1]
    if not final < first:
        sys.exit(f"check_same_params: error: the loss did not fall ({first} -> {final})")
    print(f"check_same_params: C API and C++ DDP: params_hash={c[0][2]} on all {2 * nproc} ranks, "
          f"loss {first:.4f} -> {final:.4f}")


if __name__ == "__main__":
    main()
