#!/usr/bin/env bash
# Sanitizer runs (called by scripts/test.sh; runs alone too), each in its own tree building only what
# it runs. LibTorch itself is not instrumented; suppressions (tests/sanitizers/*.supp) cover
# LibTorch's own reports only, each commented.
#   build-asan  -DDTRAIN_SANITIZE=ON: AddressSanitizer (+ LeakSanitizer) + UBSan. The unit tests and
#               the multi-process tests on real ranks: collectives (shared memory and Gloo), shared
#               memory, DDP, pipeline (2 and 4 ranks), monitor, AMP, sampler, the randomized
#               collectives, communication hooks, SyncBatchNorm, ZeRO, Join, fully_shard and its
#               sharded checkpoints (saved on 3 ranks, loaded on 2; over the replica groups {0, 1} and
#               {2, 3} of 4 ranks, loaded over {0, 1} and {2} of 3), HSDP on a 2 x 2 mesh (4 ranks:
#               61 s on 2 busy cores), activation checkpointing under DDP, fully_shard, TP and
#               pipelines (2 ranks), tensor parallelism on 4 ranks (layers, its checkpoints through
#               CheckpointManager and dcp's save and load, TP stages of a pipeline), GradScaler over
#               sharded gradients and context parallelism (ring and Ulysses attention, 2 ranks).
#   build-tsan  -DDTRAIN_SANITIZE=thread: ThreadSanitizer over the threads inside one rank: the
#               shared-memory group's worker thread and its atomics, point-to-point's pusher, DDP's
#               bucket hooks and completion callbacks, TensorBoard's flush timer, the asynchronous
#               checkpoint's writer thread, the store server's thread under its limits, the flight
#               recorder's stall watchdog and SIGUSR1 dump (test_flight_recorder.py's cases on the
#               instrumented program: the harness fails a test whose processes report), and the
#               launcher's heartbeat: the shm, SummaryWriter, save_async and store-guard unit tests, shm_dist_test, ddp_test,
#               ddp_overlap_test, pipeline_test and fsdp_test on 2 ranks (fully_shard's prefetches and
#               asynchronous reduce-scatters), the elastic launcher tests.
# Each run first requires its canary to be reported and to fail the process, and fails on any test
# skipped that tests/skips_allowed.txt does not allow (scripts/check_skips.py).
#   ./scripts/sanitize.sh            both
#   ./scripts/sanitize.sh asan|tsan  one
#   ./scripts/sanitize.sh build      both trees built, no test run
#
# To fit CI's time: clang (an instrumented file at -O0 took 0.4 of GCC's CPU time: fsdp_test 4.9 s
# against 13.0 s, the precompiled header 8.0 s against 21.2 s; the runtimes are LLVM's in both
# compilers), build type Sanitize (-O0 -g1, see CMakeLists.txt), a unity build (the
# library's sources compiled in a few batches, so LibTorch's headers are parsed a few times instead of
# once per file), and each unit program run whole, one process for all its cases
# (DTRAIN_TEST_PER_CASE=OFF, tests/CMakeLists.txt). In CI's from-nothing run of 2026-12-03 evening
# (docs/benchmarks.md, "Slowest tests"): build-asan 522 s (unit programs 21 s, multi-process tests
# 71 s), build-tsan 197 s; on that day's slow afternoon 1049 s and 373 s.
set -euo pipefail
cd "$(dirname "$0")/.."
S="$PWD/tests/sanitizers"
runs=${1:-asan tsan}

configure_and_build() {  # <tree> <DTRAIN_SANITIZE> <target>...
  local tree=$1 mode=$2
  shift 2
  local only
  only=$(IFS=';' && echo "sanitizer_canary;dtrain-run;$*")
  if ! command -v clang++ >/dev/null; then
    echo "sanitize.sh: the sanitizer trees compile with clang++, which is not installed: run scripts/setup.sh (Debian: apt-get install clang)" >&2
    exit 1
  fi
  ./scripts/tree_compiler.sh "$tree" clang++
  cmake -S . -B "$tree" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Sanitize -DDTRAIN_SANITIZE="$mode" \
        -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCH=OFF -DDTRAIN_TEST_PER_CASE=OFF \
        -DCMAKE_UNITY_BUILD=ON "-DDTRAIN_BUILD_ONLY=$only" >/dev/null
  # One target whose dependencies are the programs: built in parallel (CMakeLists.txt, DTRAIN_BUILD_ONLY)
  cmake --build "$tree" -j"$(nproc)" --target dtrain_build_only
}

# A clean run means something only if the sanitizer would have spoken: each canary must fail.
canary() {  # <tree> <mode> <report text>
  local out rc=0
  out=$("${prefix[@]}" "$1/bin/sanitizer_canary" "$2" 2>&1) || rc=$?
  if [[ $rc -eq 0 || $out != *"$3"* ]]; then
    printf '%s\n' "$out" >&2
    echo "sanitize.sh: the $2 canary exited $rc without '$3': the sanitizer is not active in $1" >&2
    exit 1
  fi
  # A report helps only where it names the line: the stack must reach canary.cpp by file and line
  # (the Sanitize build type's line tables; without them a frame reads `main (<program>+0x8b0c)`).
  if [[ $2 != ub && ! $out =~ canary\.cpp:[0-9]+ ]]; then
    printf '%s\n' "$out" >&2
    echo "sanitize.sh: the $2 canary's report names no line of canary.cpp: $1 has no line tables (CMAKE_CXX_FLAGS_SANITIZE: expected -g1)" >&2
    exit 1
  fi
}

# ctest, then a failure for any skip tests/skips_allowed.txt does not expect (ctest counts skips as
# passed, and a GoogleTest case that skips leaves its program passing).
run_ctest() {  # <tree> <ctest arguments>...
  local tree=$1
  shift
  "${prefix[@]}" ctest --test-dir "$tree" --output-on-failure --timeout 300 "$@"
  ./scripts/check_skips.py "$tree"
}

# The multi-process tests run here, as tests/dist/CMakeLists.txt names them: dist_<program>_<ranks>.
dist_regex() { local IFS='|'; echo "^dist_($*)\$"; }

# What each tree builds: build-asan the unit test executables, as tests/unit/CMakeLists.txt declares
# them (dtrain_unit_test, dtrain_unit_gtest or a plain add_executable: every one of them registers ctest tests, which
# fail as NOT_BUILT if left out), and the multi-process programs it runs; build-tsan its programs.
mapfile -t ASAN_TARGETS < <(sed -n -e 's/^dtrain_unit_g\{0,1\}test(\([A-Za-z0-9_]*\).*/\1/p' \
                                 -e 's/^add_executable(\([A-Za-z0-9_]*\).*/\1/p' tests/unit/CMakeLists.txt)
ASAN_TARGETS+=(collectives_test collectives_random_test shm_dist_test ddp_test comm_hooks_test pipeline_test
               monitor_dist_test amp_dist_test sampler_dist_test sync_batchnorm_test zero_test join_test
               fsdp_test fsdp_checkpoint_test fsdp_hsdp_test activation_checkpoint_dist_test
               tensor_parallel_test tp_checkpoint_test tp_pipeline_test context_parallel_test
               expert_parallel_test)
TSAN_TARGETS=(shm_test shm_p2p_test tensorboard_test checkpoint_async_test store_guard_test store_attack_test
              shm_dist_test ddp_test ddp_overlap_test pipeline_test fsdp_test flight_program ft_train)
# `./scripts/sanitize.sh build`: both trees built, nothing run (scripts/test.sh builds them in the
# background while the other trees' tests run).
if [ "$runs" = build ]; then
  configure_and_build build-asan ON "${ASAN_TARGETS[@]}"
  configure_and_build build-tsan thread "${TSAN_TARGETS[@]}"
  exit 0
fi
if [[ " $runs " == *" asan "* ]]; then
  echo "=== build-asan: AddressSanitizer + UBSan"
  start=$SECONDS
  B=build-asan
  configure_and_build "$B" ON "${ASAN_TARGETS[@]}"
  prefix=()
  # detect_leaks: LeakSanitizer at exit. halt_on_error: a UBSan report fails the process (exit 87).
  export ASAN_OPTIONS="detect_leaks=1:exitcode=86:suppressions=$S/asan.supp"
  export LSAN_OPTIONS="suppressions=$S/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87:suppressions=$S/ubsan.supp"
  canary "$B" heap heap-buffer-overflow
  canary "$B" ub "signed integer overflow"
  canary "$B" leak "detected memory leaks"
  echo "sanitize.sh: canaries caught a heap overflow, a signed overflow and a leak"
  # Unit tests: every unit program, each whole.
  run_ctest "$B" -j2 -E '^(dist_|launcher_|example_|py_)'
  run_ctest "$B" -R "$(dist_regex collectives_test_2 collectives_test_3 collectives_test_gloo_2 \
                                  shm_dist_test_2 shm_dist_test_4 ddp_test_2 ddp_test_gloo_2 \
                                  pipeline_test_2 pipeline_test_4 monitor_dist_test_2 \
                                  amp_dist_test_2 sampler_dist_test_2 sampler_dist_test_3 \
                                  collectives_random_test_2 comm_hooks_test_2 sync_batchnorm_test_3 \
                                  zero_test_2 join_test_3 fsdp_test_3 fsdp_test_gloo_2 \
                                  fsdp_checkpoint_3to2 fsdp_checkpoint_4to3 fsdp_hsdp_test_4 \
                                  activation_checkpoint_dist_test_2 amp_dist_test_4 \
                                  tensor_parallel_test_4 tp_checkpoint_test_4 tp_pipeline_test_4 \
                                  context_parallel_test_2 expert_parallel_test_2)"
  unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS
  echo "=== build-asan: done in $((SECONDS - start)) s"
fi

if [[ " $runs " == *" tsan "* ]]; then
  echo "=== build-tsan: ThreadSanitizer"
  start=$SECONDS
  T=build-tsan
  configure_and_build "$T" thread "${TSAN_TARGETS[@]}"
  # Reports exit 66 at the end of the process; second_deadlock_stack: both stacks of a lock-order
  # inversion.
  export TSAN_OPTIONS="exitcode=66:second_deadlock_stack=1:suppressions=$S/tsan.supp"
  # LibTorch's intra-op pool (OpenMP) synchronizes in libgomp's own uninstrumented barriers, which
  # ThreadSanitizer cannot see: one thread per rank keeps at::parallel_for on the calling thread.
  export OMP_NUM_THREADS=1
  # ThreadSanitizer's fixed shadow layout needs the address space of older kernels' randomization;
  # where it stops with "unexpected memory mapping", run everything without randomization.
  prefix=()
  probe=$("$T/bin/sanitizer_canary" race 2>&1 || true)
  if [[ $probe == *"unexpected memory mapping"* ]]; then
    prefix=(setarch "$(uname -m)" -R)
    echo "sanitize.sh: ThreadSanitizer needs setarch -R on this kernel"
  fi
  canary "$T" race "ThreadSanitizer: data race"
  echo "sanitize.sh: the canary's data race was caught"
  # The shm unit tests (forked ranks on one segment; point-to-point's pusher thread), TensorBoard's
  # flush timer, and the multi-process tests (a pipeline's sends through the pusher).
  run_ctest "$T" -j2 -R '^(shm_test|shm_p2p_test|tensorboard_test|checkpoint_async_test)$'
  # The store's thread against hostile and greedy clients, in-process. The 4 cases that fork the
  # server into a child (to stop it, or limit its descriptors, stack or memory) are left out here:
  # the child of a process with ThreadSanitizer's runtime thread hangs in it.
  GTEST_FILTER='-StoreLimits.AChainOfWaitersIsAnsweredWithoutRecursion:StoreLimits.OutOfMemoryDropsOneConnectionAndTheStoreGoesOn:StoreDeadline.AStoppedServerIsATimeoutNotAHang:StoreLimits.OutOfDescriptorsTheServerDoesNotSpin' \
    run_ctest "$T" -R '^store_guard_test$'
  # The attacks on the store by peers without the secret: every case is in-process.
  run_ctest "$T" -R '^store_attack_test$'
  # With them, the launcher's own threads (the elastic agent's heartbeat): its tests run the
  # instrumented dtrain-run, and mostly wait, so they run beside the others (-j3: scripts/test.sh).
  run_ctest "$T" -j3 -R "$(dist_regex shm_dist_test_2 ddp_test_2 ddp_overlap_test_2 ddp_overlap_test_gloo_2 \
                                  pipeline_test_2 fsdp_test_2 py_flight_recorder_threads \
                                  py_replica_ft_threads)|^launcher_elastic_threads\$"

  unset TSAN_OPTIONS OMP_NUM_THREADS
  echo "=== build-tsan: done in $((SECONDS - start)) s"
fi
