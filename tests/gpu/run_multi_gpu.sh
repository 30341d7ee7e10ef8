#!/bin/sh
# Usage: run_multi_gpu.sh NRANKS DTRAIN_RUN PROGRAM [ARGS...]
# Runs PROGRAM on NRANKS ranks, one GPU each, through dtrain-run; exits 77 (ctest: skipped) with the
# reason when this machine has fewer GPUs than that.
n="$1"; run="$2"; shift 2
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "${gpus:-0}" -lt "$n" ]; then
  echo "SKIPPED: needs $n CUDA devices, this machine has ${gpus:-0} (nvidia-smi -L)"
  exit 77
fi
exec "$run" --standalone --nproc_per_node "$n" "$@"
