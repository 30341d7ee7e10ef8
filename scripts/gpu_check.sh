#!/usr/bin/env bash
# The GPU check: on a machine with NVIDIA GPUs, builds dtrain against the PyTorch found there and runs
# the CUDA/NCCL tests (ctest -L gpu) and a DDP run of the trainer on the GPUs, then prints one line
#   RESULT gpu_check=pass|fail gpus=N torch=<version> cuda_test=<ctest outcome> nccl_test=<...> ddp_train=<...>
#
#   scripts/gpu_check.sh prepare   here (Debian, registries reachable): downloads the header-only and
#                                  test dependencies that a GPU image may lack (GoogleTest, CLI11,
#                                  nlohmann-json, zlib headers) into .gpu-deps/ (git-ignored)
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
  rm -rf .gpu-deps/debs
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
if [ -d .gpu-deps/root ]; then
  r=$PWD/.gpu-deps/root
  deps=";$r/usr;$r/usr/lib/x86_64-linux-gnu/cmake;$r/usr/share/cmake"
  export CPATH="$r/usr/include${CPATH:+:$CPATH}"
fi
log=build-gpu/gpu_check.log
mkdir -p build-gpu
{
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_BUILD_BENCH=OFF \
        "-DCMAKE_PREFIX_PATH=$prefix$deps" &&
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
nccl=$(outcome gpu_nccl_dist_test_2)

# DDP of the trainer's companion on the GPUs: ddp_amp_train picks NCCL and cuda:LOCAL_RANK by itself.
nproc=$(( gpus >= 2 ? 2 : 1 ))
train_out=$(build-gpu/bin/dtrain-run --standalone --nproc_per_node "$nproc" build-gpu/bin/ddp_amp_train --steps 50 2>&1)
echo "$train_out" >>"$log"
ddp=$(echo "$train_out" | grep -o 'params_agree=1' >/dev/null && echo "passed_on_${nproc}" || echo failed)
echo "$train_out" | grep RESULT | sed 's/^/gpu_check: /'

verdict=pass
for v in "$cuda" "$nccl" "$ddp"; do case "$v" in failed) verdict=fail ;; esac; done
[ "$cuda" = passed ] || verdict=fail  # one GPU is enough for these: skipping them here is a failure
echo "RESULT gpu_check=$verdict gpus=$gpus torch=$torch_version cuda_test=$cuda nccl_test=$nccl ddp_train=$ddp"
[ $verdict = pass ]
