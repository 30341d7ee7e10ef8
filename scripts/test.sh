#!/usr/bin/env bash
# All tests: setup (apt packages, PyPI's torch in .venv/), then ctest in two trees:
#   build/         against Debian's LibTorch 1.13 (CPU): every test
#   build-torch2/  against the LibTorch 2.x inside .venv's torch wheel (CUDA + NCCL compiled in; the
#                  tests that need a GPU report themselves skipped), compiled by clang where build/ is
#                  by GCC (scripts/build_tree.sh says why): only the tests that depend on the
#                  LibTorch underneath. Those labelled `once` (text checks, the torch-free parts, the
#                  launcher, the trainer's process-level behaviour: tests/CMakeLists.txt) are neither
#                  built nor run there (-DDTRAIN_ONCE_TESTS=OFF), each unit program runs whole
#                  (-DDTRAIN_TEST_PER_CASE=OFF), each multi-process program runs at
#                  one world size per transport (tests/dist/CMakeLists.txt), and the library compiles as a unity
#                  build (a few batches of sources, so LibTorch 2's headers are parsed a few times
#                  instead of once per file; a developer's build/ keeps one file per compile, which
#                  catches a missing include, and CI's build/ is a unity build too)
# and finally the sanitizer trees (scripts/sanitize.sh, LibTorch 1.13, clang): the unit and multi-process tests
# under AddressSanitizer + UBSan (build-asan), the shared-memory and DDP tests under ThreadSanitizer
# (build-tsan). In a full run the trees after the first, and the sanitizer trees, compile in the
# background at nice 19 while the first tree's tests run (scripts/build_tree.sh, `sanitize.sh build`).
#   ./scripts/test.sh              everything
#   ./scripts/test.sh -R dist_     extra arguments go to ctest in both trees; the sanitizer run is skipped
#   DTRAIN_TREES=build ./scripts/test.sh   only the trees named (build, build-torch2)
#   DTRAIN_TIME_BUDGET_S=1800 DTRAIN_TIME_BUDGET_STRICT=1 ./scripts/test.sh   fail past a time budget
#   DTRAIN_BACKGROUND_BUILDS=0 ./scripts/test.sh   each tree built when the run comes to it
# In each tree the single-process tests (label `unit`) run one per core, then the others under
# `ctest -j<2 x cores + 1>`, each counting the halves of a core it was measured to use
# (cmake/test_weights.cmake): waiting tests run beside computing ones, and the tests that compute
# never ask for more than the cores. Each test's time is in ctest's lines, and the 15 slowest follow
# (scripts/slowest_tests.py). Before a tree's full run, scripts/check_required.py fails it when the tree
# registers no test for a name tests/tests_required.txt requires there.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Paths relative to the checkout in ccache's keys: a second clone on the same machine reuses the
# compiled objects (CI runs from a fresh clone).
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
trees=${DTRAIN_TREES:-build build-torch2}
cores=$(nproc)
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
# In a full run the later trees and the sanitizer trees compile in the background while the first
# tree's tests run, at nice 19: they take the cores the tests leave idle (a rank waiting for its
# peers, a launcher's deadline, a process loading LibTorch on one core), and a test that computes
# keeps its cores (beside a nice-0 process the scheduler gives a nice-19 one about 1.5% of a core).
# Each tree's build log is printed when the run comes to that tree; a failed build fails the run
# there, and the background build stops when the run ends for any reason.
bg=''      # the background build's folder: <name>.log and, once built, <name>.rc
bg_pid=''  # its process group
start_background_builds() {  # <sanitizers: 0|1> <tree>...
  bg=$(mktemp -d)
  # shellcheck disable=SC2016  # the variables are the inner script's own
  setsid nice -n 19 bash -c '
    bg=$1 sanitizers=$2
    shift 2
    finish() { echo "$2" >"$bg/$1.rc.tmp" && mv "$bg/$1.rc.tmp" "$bg/$1.rc"; }
    for t in "$@"; do
      if ./scripts/build_tree.sh "$t" >"$bg/$t.log" 2>&1; then finish "$t" 0; else finish "$t" $?; fi
    done
    if ((sanitizers)); then
      if ./scripts/sanitize.sh build >"$bg/sanitizers.log" 2>&1; then finish sanitizers 0; else finish sanitizers $?; fi
    fi' _ "$bg" "$@" &
  bg_pid=$!
  trap 'kill -- "-$bg_pid" 2>/dev/null || true; rm -rf "$bg"' EXIT
}
wait_for_background() {  # <name>: its build's log, once done; fails the run if it failed
  local name=$1
  while [ ! -e "$bg/$name.rc" ]; do
    if ! kill -0 "$bg_pid" 2>/dev/null && [ ! -e "$bg/$name.rc" ]; then
      echo "scripts/test.sh: the background build ended before building $name: its log follows" >&2
      cat "$bg/$name.log" >&2 || true
      exit 1
    fi
    sleep 2
  done
  cat "$bg/$name.log"
  if [ "$(cat "$bg/$name.rc")" != 0 ]; then
    echo "scripts/test.sh: building $name failed (exit $(cat "$bg/$name.rc")): its log is above" >&2
    exit 1
  fi
}
later_trees=''
for tree in $trees; do
  [ "$tree" = "${trees%% *}" ] || later_trees+=" $tree"
done
for tree in $trees; do
  skip=''  # labels left out of this tree, as a ctest -LE regex alternative
  ((first)) || skip='|once'
  echo "=== $tree: configure, build, ctest"
  start=$SECONDS
  if [ -n "$bg" ]; then
    wait_for_background "$tree"
    echo "=== $tree: built in the background; waited $((SECONDS - start)) s for it"
  else
    DTRAIN_FIRST_TREE=$first ./scripts/build_tree.sh "$tree"
    echo "=== $tree: built in $((SECONDS - start)) s"
  fi
  if ((first && $# == 0)) && [ "${DTRAIN_BACKGROUND_BUILDS:-1}" = 1 ]; then
    # shellcheck disable=SC2086  # later_trees is a list of names without spaces
    start_background_builds 1 $later_trees
  fi
  if (($# == 0)); then
    # A full run must contain every test tests/tests_required.txt names for this tree: a test CMake
    # did not register would otherwise be absent from a run that still reports 100%.
    ./scripts/check_required.py "$tree"
    if [ -n "$skip" ]; then
      run_ctest "$tree" -j"$cores" -L '^unit$' -LE '^once$'
    else
      run_ctest "$tree" -j"$cores" -L '^unit$'
    fi
    run_ctest "$tree" -j$((2 * cores + 1)) -LE "^(unit$skip)\$"
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
  if [ -n "$bg" ]; then
    wait_for_background sanitizers
    echo "=== sanitizer trees: built in the background; waited $((SECONDS - start)) s for them"
  fi
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
