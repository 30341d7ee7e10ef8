#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run (called by scripts/test.sh; runs alone too):
# a second tree, build-asan, configured with -DDTRAIN_SANITIZE=ON, building only what it runs --
# libdtrain, dtrain-run, the unit tests, the multi-rank DDP test and a canary -- then the unit tests
# and a 2-rank DDP run under the sanitizers. LibTorch itself is not instrumented; suppressions
# (tests/sanitizers/*.supp) cover LibTorch's own reports only, each commented.
#
# To fit CI's time: build type Sanitize (-O1 -g1, see CMakeLists.txt) and a unity build (the
# library's sources compiled in a few batches, so LibTorch's headers are parsed a few times instead of
# once per file). On 2 cores about 7 minutes from nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
B=build-asan
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Sanitize -DDTRAIN_SANITIZE=ON \
      -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF \
      -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=11 >/dev/null
# The unit test executables, as tests/unit/CMakeLists.txt declares them.
mapfile -t UNIT < <(sed -n 's/^dtrain_unit_test(\([A-Za-z0-9_]*\).*/\1/p' tests/unit/CMakeLists.txt)
cmake --build "$B" -j"$(nproc)" --target sanitizer_canary dtrain-run ddp_test "${UNIT[@]}"

S="$PWD/tests/sanitizers"
# detect_leaks: LeakSanitizer at exit. halt_on_error: a UBSan report fails the process (exit 87).
export ASAN_OPTIONS="detect_leaks=1:exitcode=86:suppressions=$S/asan.supp"
export LSAN_OPTIONS="suppressions=$S/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87:suppressions=$S/ubsan.supp"

# A clean run means something only if the sanitizers would have spoken: each canary must fail.
canary() {  # <mode> <report text>
  local out rc=0
  out=$("$B/bin/sanitizer_canary" "$1" 2>&1) || rc=$?
  if [[ $rc -eq 0 || $out != *"$2"* ]]; then
    echo "sanitize.sh: the $1 canary exited $rc without '$2': the sanitizers are not active in $B" >&2
    exit 1
  fi
}
canary heap heap-buffer-overflow
canary ub "signed integer overflow"
canary leak "detected memory leaks"
echo "sanitize.sh: canaries caught a heap overflow, a signed overflow and a leak"

# Unit tests (every test the unit executables registered) and the 2-rank DDP test.
ctest --test-dir "$B" --output-on-failure --timeout 300 -j2 -E '^(dist_|launcher_|example_|py_)'
ctest --test-dir "$B" --output-on-failure --timeout 300 -R '^dist_ddp_test_2$'
