#!/usr/bin/env bash
# The main job: setup + build + a 2-worker distributed training run through the dtrain-run launcher:
# a CNN on Fashion-MNIST with DistributedDataParallel (examples/train_fashion_mnist.cpp), ending with
# `RESULT epochs=5 test_accuracy=... train_loss=... params_sha256=... ranks_agree=1` (about 0.91 test accuracy).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target dtrain-run train_fashion_mnist
./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/train_fashion_mnist
