#!/usr/bin/env bash
# Configures and builds one of scripts/test.sh's trees with the options that tree is tested with.
#   ./scripts/build_tree.sh build          the first tree: every test (LibTorch 1.13, Debian's)
#   ./scripts/build_tree.sh build-torch2   a later tree: only what depends on the LibTorch underneath
# A tree is "first" when it is the first of the run (scripts/test.sh passes first=1 in the
# environment): it builds and registers the tests labelled `once`; the later trees leave them out.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$1
first=${DTRAIN_FIRST_TREE:-0}
args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_WERROR=ON)  # a warning in dtrain's own code fails the run
if ((first == 0)); then
  args+=(-DDTRAIN_ONCE_TESTS=OFF -DCMAKE_UNITY_BUILD=ON -DDTRAIN_TEST_PER_CASE=OFF)
fi
# CI compiles without debug information: -g took 1.5-2x the compile time of a file (side by side:
# src/ddp/reducer.cpp 19.5 s without, 34 s with; src/comm/collectives.cpp 14.6 s against 25 s) and
# 25x its object's size for the linker. The same -O2; a developer's trees keep -g.
# Every CI tree compiles in batches (unity, as the next trees always do): in build/ the library's 75
# files and the unit programs' 31 took 400 s of CPU one by one, about half of it in batches. A
# missing include shows in a developer's build/, which keeps one file per compile.
# The tests' and examples' own code compiles at -O1 there (about 0.75 of -O2's compile time; the
# library keeps -O2): CMakeLists.txt, DTRAIN_CONSUMER_OPTIMIZE.
if [ "${CI:-}" = true ]; then
  args+=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG"
         -DDTRAIN_CONSUMER_OPTIMIZE=-O1)
  ((first == 0)) || args+=(-DCMAKE_UNITY_BUILD=ON)
  # Each unit program runs whole there, as in the next trees: its ~280 cases one process each spent
  # about 0.45 s of CPU apiece starting LibTorch. A developer's build/ keeps one ctest test per case.
  ((first == 0)) || args+=(-DDTRAIN_TEST_PER_CASE=OFF)
fi
# The benchmarks build in a developer's build/ only, where a change that breaks one shows at once:
# CI compiles what it runs (they cost about 2 minutes of compiling from nothing).
if [ "${CI:-}" = true ] || [ "$tree" != build ]; then
  args+=(-DDTRAIN_BUILD_BENCH=OFF)
fi
# The next tree compiles with clang, the first with GCC: the library and its tests build with both
# compilers (clang 14 refused code GCC 12 took: a vexing parse, lambdas that captured structured
# bindings, a CPU feature its builtin does not know), and clang compiles it with less CPU (this tree
# without ccache: 474 s with four files failing, against GCC's 728 s): it instantiates the templates
# of the precompiled header's inline code once, in the header, where GCC instantiates them again in
# every file that uses it (2.4 s of the 2.5 s an empty file took).
if [ "$tree" = build-torch2 ]; then
  if ! command -v clang++ >/dev/null; then
    echo "build_tree.sh: build-torch2 compiles with clang++, which is not installed: run scripts/setup.sh (Debian: apt-get install clang)" >&2
    exit 1
  fi
  args+=(-DCMAKE_CXX_COMPILER=clang++)
  ./scripts/tree_compiler.sh "$tree" clang++
  args+=("-DCMAKE_PREFIX_PATH=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')")
fi
cmake -S . -B "$tree" "${args[@]}" >/dev/null
cmake --build "$tree" -j"$(nproc)"
