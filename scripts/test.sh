#!/usr/bin/env bash
# All tests: setup (apt packages, PyPI's torch in .venv/), then the whole ctest suite twice:
#   build/         against Debian's LibTorch 1.13 (CPU)
#   build-torch2/  against the LibTorch 2.x inside .venv's torch wheel (CUDA + NCCL compiled in;
#                  the tests that need a GPU report themselves skipped)
# and finally the sanitizer trees (scripts/sanitize.sh, LibTorch 1.13): the unit and multi-process tests
# under AddressSanitizer + UBSan (build-asan), the shared-memory and DDP tests under ThreadSanitizer
# (build-tsan).
#   ./scripts/test.sh              everything
#   ./scripts/test.sh -R dist_     extra arguments go to ctest in both trees; the sanitizer run is skipped
#   DTRAIN_TREES=build ./scripts/test.sh   only the trees named (build, build-torch2)
# Tests labelled `once` (text checks, the torch-free launcher, the main job's long elastic run) do
# not depend on the LibTorch a tree builds against: the first tree named runs them, the others not.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Paths relative to the checkout in ccache's keys: a second clone on the same machine reuses the
# compiled objects (CI runs from a fresh clone).
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
trees=${DTRAIN_TREES:-build build-torch2}
once=()  # the first tree runs every test; the next ones skip those labelled `once` (tests/CMakeLists.txt)
for tree in $trees; do
  args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_WERROR=ON)  # a warning in dtrain's own code fails the run
  if [ "$tree" = build-torch2 ]; then
    # The benchmarks build in build/; here they would only add compile time.
    args+=("-DCMAKE_PREFIX_PATH=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
           -DDTRAIN_BUILD_BENCH=OFF)
  fi
  echo "=== $tree: configure, build, ctest"
  start=$SECONDS
  cmake -S . -B "$tree" "${args[@]}" >/dev/null
  cmake --build "$tree" -j"$(nproc)"
  ctest --test-dir "$tree" --output-on-failure --timeout 600 "${once[@]}" "$@"
  if ((${#once[@]} == 0)); then
    once=(-LE '^once$')
    echo "=== the tests labelled once ran in $tree: the next trees leave them out"
  fi
  # ctest counts a skipped test as passed: fail on any skip tests/skips_allowed.txt does not expect here.
  ./scripts/check_skips.py "$tree"
  echo "=== $tree: done in $((SECONDS - start)) s"
done
if (($# == 0)); then
  ./scripts/sanitize.sh
fi
