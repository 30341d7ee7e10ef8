#!/usr/bin/env bash
# All tests: setup (apt packages) + build into build/ + the whole ctest suite, then the unit tests
# and a 2-rank DDP test again under AddressSanitizer + UBSan (scripts/sanitize.sh, tree build-asan).
#   ./scripts/test.sh            everything
#   ./scripts/test.sh -R dist_   extra arguments go to ctest, and select: the sanitizer run is skipped
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure --timeout 600 "$@"
if (($# == 0)); then
  ./scripts/sanitize.sh
fi
