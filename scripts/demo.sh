#!/usr/bin/env bash
# The main job: setup + build + a 2-worker distributed run through the dtrain-run launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target dtrain-run hello_distributed
./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/hello_distributed
