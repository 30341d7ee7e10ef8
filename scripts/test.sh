#!/usr/bin/env bash
# All tests: setup (apt packages) + build into build/ + the whole ctest suite.
#   ./scripts/test.sh            everything
#   ./scripts/test.sh -R dist_   extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure --timeout 600 "$@"
