#!/usr/bin/env bash
# All tests: setup (apt packages, PyPI's torch in .venv/), then ctest in two trees:
#   build/         against Debian's LibTorch 1.13 (CPU): every test
#   build-torch2/  against the LibTorch 2.x inside .venv's torch wheel (CUDA + NCCL compiled in; the
#                  tests that need a GPU report themselves skipped): only the tests that depend on the
#                  LibTorch underneath. Those labelled `once` (text checks, the torch-free parts, the
#                  launcher, the trainer's process-level behaviour: tests/CMakeLists.txt) are neither
#                  built nor run there (-DDTRAIN_ONCE_TESTS=OFF), each unit program runs whole
#                  (-DDTRAIN_TEST_PER_CASE=OFF), each multi-process program runs at
#                  one world size per transport (tests/dist/CMakeLists.txt), and the library compiles as a unity
#                  build (a few batches of sources, so LibTorch 2's headers are parsed a few times
#                  instead of once per file; a developer's build/ keeps one file per compile, which
#                  catches a missing include, and CI's build/ is a unity build too)
# and finally the sanitizer trees (scripts/sanitize.sh, LibTorch 1.13): the unit and multi-process tests
# under AddressSanitizer + UBSan (build-asan), the shared-memory and DDP tests under ThreadSanitizer
# (build-tsan).
#   ./scripts/test.sh              everything
#   ./scripts/test.sh -R dist_     extra arguments go to ctest in both trees; the sanitizer run is skipped
#   DTRAIN_TREES=build ./scripts/test.sh   only the trees named (build, build-torch2)
#   DTRAIN_TIME_BUDGET_S=1800 DTRAIN_TIME_BUDGET_STRICT=1 ./scripts/test.sh   fail past a time budget
# In each tree the single-process tests (label `unit`) run two at a time, then the others under
# `ctest -j3`: a test that computes counts 2 of the 3 and a test that mostly waits counts 1
# (cmake/test_weights.cmake), so a waiting test runs beside a computing one and two computing tests
# never share the 2 cores. Each test's time is in ctest's lines, and the 15 slowest follow
# (scripts/slowest_tests.py). Before a tree's full run, scripts/check_required.py fails it when the tree
# registers no test for a name tests/tests_required.txt requires there.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Paths relative to the checkout in ccache's keys: a second clone on the same machine reuses the
# compiled objects (CI runs from a fresh clone).
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
trees=${DTRAIN_TREES:-build build-torch2}
total_start=$SECONDS
first=1
phases=()  # "name seconds" per part, for the budget line at the end
# ctest in <tree> on the tests selected by the arguments, then a failure for any skip that
# tests/skips_allowed.txt does not expect (ctest counts a skipped test as passed), then the slowest.
run_ctest() {  # <tree> <ctest arguments>...
  local tree=$1
  shift
  ctest --test-dir "$tree" --output-on-failure --timeout 600 "$@"
  ./scripts/check_skips.py "$tree"
  ./scripts/slowest_tests.py "$tree"
}
for tree in $trees; do
  args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_WERROR=ON)  # a warning in dtrain's own code fails the run
  skip=''  # labels left out of this tree, as a ctest -LE regex alternative
  if ((first == 0)); then
    args+=(-DDTRAIN_ONCE_TESTS=OFF -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=11 -DDTRAIN_TEST_PER_CASE=OFF)
    skip='|once'
  fi
  # CI compiles without debug information: -g took 1.5-2x the compile time of a file (side by side:
  # src/ddp/reducer.cpp 19.5 s without, 34 s with; src/comm/collectives.cpp 14.6 s against 25 s) and
  # 25x its object's size for the linker. The same -O2; a developer's trees keep -g.
  # Every CI tree compiles in batches (unity, as the next trees always do): in build/ the library's 75
  # files and the unit programs' 31 took 400 s of CPU one by one, about half of it in batches. A
  # missing include shows in a developer's build/, which keeps one file per compile.
  if [ "${CI:-}" = true ]; then
    args+=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG")
    ((first == 0)) || args+=(-DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=11)
  fi
  # The benchmarks build in a developer's build/ only, where a change that breaks one shows at once:
  # CI compiles what it runs (they cost about 2 minutes of compiling from nothing).
  if [ "${CI:-}" = true ] || [ "$tree" != build ]; then
    args+=(-DDTRAIN_BUILD_BENCH=OFF)
  fi
  if [ "$tree" = build-torch2 ]; then
    args+=("-DCMAKE_PREFIX_PATH=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')")
  fi
  echo "=== $tree: configure, build, ctest"
  start=$SECONDS
  cmake -S . -B "$tree" "${args[@]}" >/dev/null
  cmake --build "$tree" -j"$(nproc)"
  echo "=== $tree: built in $((SECONDS - start)) s"
  if (($# == 0)); then
    # A full run must contain every test tests/tests_required.txt names for this tree: a test CMake
    # did not register would otherwise be absent from a run that still reports 100%.
    ./scripts/check_required.py "$tree"
    if [ -n "$skip" ]; then
      run_ctest "$tree" -j2 -L '^unit$' -LE '^once$'
    else
      run_ctest "$tree" -j2 -L '^unit$'
    fi
    run_ctest "$tree" -j3 -LE "^(unit$skip)\$"
  elif [ -n "$skip" ]; then
    run_ctest "$tree" -LE '^once$' "$@"
  else
    run_ctest "$tree" "$@"
  fi
  if ((first)); then
    echo "=== the tests labelled once ran in $tree: the next trees leave them out"
  fi
  first=0
  echo "=== $tree: done in $((SECONDS - start)) s"
  phases+=("$tree $((SECONDS - start))")
done
if (($# == 0)); then
  start=$SECONDS
  ./scripts/sanitize.sh
  echo "=== sanitizer trees: done in $((SECONDS - start)) s"
  phases+=("sanitizers $((SECONDS - start))")
fi
total=$((SECONDS - total_start))
echo "=== scripts/test.sh: done in $total s"
# The time budget of a full run (CI stops a run at 90 minutes and lands nothing): the parts and the
# total against DTRAIN_TIME_BUDGET_S (default 2400 s, the 40 minutes a run from nothing may take).
# Past it the run says so in one line; DTRAIN_TIME_BUDGET_STRICT=1 makes that a failure (a quiet
# machine's timing run), while CI's runs on a busy machine still land.
if (($# == 0)); then
  budget=${DTRAIN_TIME_BUDGET_S:-2400}
  echo "=== time budget: $total s of $budget s (${phases[*]})"
  if ((total > budget)); then
    echo "scripts/test.sh: the run took $total s, over its budget of $budget s: see the slowest tests above" >&2
    if [ "${DTRAIN_TIME_BUDGET_STRICT:-0}" = 1 ]; then exit 1; fi
  fi
fi
