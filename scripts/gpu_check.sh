#!/usr/bin/env bash
# The GPU check: on a machine with NVIDIA GPUs, builds dtrain against the PyTorch found there and runs
# the CUDA/NCCL tests (ctest -L gpu), a DDP run of ddp_amp_train (autocast float16 + GradScaler) and
# of the trainer (--device cuda, then resumed from its checkpoint) on up to 2 GPUs, then prints
#   RESULT gpu_check=pass|fail gpus=N torch=<version> cuda_test=<ctest outcome> nccl_1=<...> nccl_2=<...>
#          amp_train=<...> trainer=<...> trainer_resume=<...>
# (a test needing more GPUs than the machine has is "skipped", which does not fail the check); a
# failed one-rank NCCL test is rerun under cuda-gdb, its backtrace in the log.
#
#   scripts/gpu_check.sh prepare   here (Debian, registries reachable): downloads the header-only and
#                                  test dependencies that a GPU image may lack (GoogleTest, CLI11,
#                                  nlohmann-json, zlib headers) and copies Fashion-MNIST into
#                                  .gpu-deps/ (git-ignored; carry it to the GPU machine)
#   scripts/gpu_check.sh           there: build into build-gpu/ and run; .gpu-deps/ is used when present
#
# Python: $DTRAIN_PYTHON, else .venv/bin/python when it imports torch, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  set -e
  rm -rf .gpu-deps && mkdir -p .gpu-deps/debs
  (cd .gpu-deps/debs && apt-get download libgtest-dev googletest libcli11-dev nlohmann-json3-dev zlib1g-dev)
  for f in .gpu-deps/debs/*.deb; do dpkg-deb -x "$f" .gpu-deps/root; done
  # zlib's headers only: its libz.a is not position-independent, and the libz.so link points to a
  # libz.so.1 the deb does not carry; the GPU machine's own libz.so.1 is used.
  rm -f .gpu-deps/root/usr/lib/x86_64-linux-gnu/libz.*
  rm -rf .gpu-deps/debs
  mkdir -p .gpu-deps/fashion-mnist && cp /usr/share/datasets/fashion-mnist/*.gz .gpu-deps/fashion-mnist/
  echo "gpu_check: dependencies in .gpu-deps/root ($(du -sh .gpu-deps | cut -f1))"
  exit 0
fi

py=${DTRAIN_PYTHON:-}
if [ -z "$py" ]; then
  if .venv/bin/python -c 'import torch' 2>/dev/null; then py=.venv/bin/python; else py=python3; fi
fi
torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) || {
  echo "gpu_check: $py cannot import torch: set DTRAIN_PYTHON to a Python with PyTorch" >&2; exit 2; }
prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
echo "gpu_check: torch $torch_version ($prefix), ${gpus} GPU(s)"

deps=""
extra=()
if [ -d .gpu-deps/root ]; then
  r=$PWD/.gpu-deps/root
  deps=";$r/usr;$r/usr/lib/x86_64-linux-gnu/cmake;$r/usr/share/cmake"
  export CPATH="$r/usr/include${CPATH:+:$CPATH}"
  # The deb's libz.so links to a libz.so.1.x it does not carry: point CMake at the machine's own.
  [ -e /usr/include/zlib.h ] || extra+=("-DZLIB_INCLUDE_DIR=$r/usr/include")
  if ! ldconfig -p | grep -q 'libz\.so .*x86-64'; then
    extra+=("-DZLIB_LIBRARY=$(ldconfig -p | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')")
  fi
fi
data=/usr/share/datasets/fashion-mnist
[ -d .gpu-deps/fashion-mnist ] && data=$PWD/.gpu-deps/fashion-mnist
log=build-gpu/gpu_check.log
mkdir -p build-gpu
{
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_BUILD_BENCH=OFF \
        "-DCMAKE_PREFIX_PATH=$prefix$deps" "${extra[@]}" &&
  cmake --build build-gpu -j"$(nproc)" --target dtrain-run cuda_test nccl_dist_test train_fashion_mnist ddp_amp_train
} >"$log" 2>&1
build_rc=$?
if [ $build_rc -ne 0 ]; then
  tail -30 "$log"
  echo "RESULT gpu_check=fail gpus=$gpus torch=$torch_version build=fail (see $log)"
  exit 1
fi

# ctest's verdict for one test: passed, skipped or failed.
outcome() {
  local out
  out=$(ctest --test-dir build-gpu -R "^$1\$" --output-on-failure --timeout 600 2>&1)
  echo "$out" >>"$log"
  if echo "$out" | grep -q 'tests passed, 0 tests failed\|100% tests passed'; then
    echo "$out" | grep -q '\*\*\*Skipped\|Not Run' && echo skipped || echo passed
  else
    echo "$out" | tail -40 >&2; echo failed
  fi
}
cuda=$(outcome gpu_cuda_test)
nccl1=$(outcome gpu_nccl_dist_test_1)
nccl2=$(outcome gpu_nccl_dist_test_2)
# A one-rank failure again under cuda-gdb (the image has it, not gdb): the backtrace of a crash,
# which ctest's output does not show.
if [ "$nccl1" = failed ] && command -v cuda-gdb >/dev/null; then
  echo "== nccl_dist_test under cuda-gdb" >>"$log"
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
    timeout 300 cuda-gdb -batch -ex run -ex bt --args build-gpu/bin/nccl_dist_test 2>&1 | tee -a "$log" | tail -40 >&2
fi
nproc=$(( gpus >= 2 ? 2 : 1 ))

# ran NAME COMMAND...: runs a DDP job, logs it, echoes its RESULT lines; the verdict goes to $verdict_of.
ran() {
  local name=$1; shift
  local out
  out=$("$@" 2>&1)
  echo "== $name: $*" >>"$log"; echo "$out" >>"$log"
  echo "$out" | grep -E 'RESULT|resumed from|error' | sed "s/^/gpu_check: $name: /"
  if echo "$out" | grep -q 'RESULT.*ranks_agree=1\|RESULT.*params_agree=1'; then
    verdict_of="passed_on_$nproc"
  else
    echo "$out" | tail -20 >&2; verdict_of=failed
  fi
}
run=build-gpu/bin/dtrain-run
# ddp_amp_train picks NCCL and cuda:LOCAL_RANK by itself: autocast float16 and GradScaler on CUDA.
ran amp_train "$run" --standalone --nproc_per_node "$nproc" build-gpu/bin/ddp_amp_train --steps 50
amp=$verdict_of
ckpt=build-gpu/gpu_check_ckpt
rm -rf "$ckpt"
common=(--device cuda --data_dir "$data" --subset 8192 --test_subset 2000 --checkpoint_dir "$ckpt" --checkpoint_every 40)
ran trainer "$run" --standalone --nproc_per_node "$nproc" build-gpu/bin/train_fashion_mnist --epochs 1 "${common[@]}"
trainer=$verdict_of
# A second epoch resumed from the first one's checkpoint: rank 0's tensors back on every rank's GPU.
ran trainer_resume "$run" --standalone --nproc_per_node "$nproc" build-gpu/bin/train_fashion_mnist --epochs 2 "${common[@]}"
resume=$verdict_of
grep -q "resumed from" "$log" || resume=failed

verdict=pass
for v in "$cuda" "$nccl1" "$nccl2" "$amp" "$trainer" "$resume"; do case "$v" in failed) verdict=fail ;; esac; done
# One GPU is enough for these: skipping them here is a failure.
[ "$cuda" = passed ] && [ "$nccl1" = passed ] || verdict=fail
line="RESULT gpu_check=$verdict gpus=$gpus torch=$torch_version cuda_test=$cuda nccl_1=$nccl1 nccl_2=$nccl2 amp_train=$amp trainer=$trainer trainer_resume=$resume"
echo "$line" | tee -a "$log"
[ -n "${OUT:-}" ] && cp "$log" "$OUT/" 2>/dev/null
[ $verdict = pass ]
