#!/usr/bin/env bash
# Installs what dtrain needs from Debian's packages; seconds when all is present.
set -euo pipefail
PKGS=(
  build-essential cmake ccache pkg-config
  libtorch-dev libgloo-dev          # LibTorch 1.13 (CPU) and the gloo headers its c10d includes
  libopenblas0-openmp               # takes over libblas.so.3: the reference BLAS is 14x slower
  libcli11-dev nlohmann-json3-dev zlib1g-dev libgtest-dev libbenchmark-dev
  libssl-dev                        # SHA-256 of the trained parameters (train_fashion_mnist)
  python3-torch                     # reference implementation for goldens and benchmarks
  dataset-fashion-mnist             # the real data set
  openmpi-bin                       # the mpirun launch path is tested for real
  iproute2 procps                   # network namespaces for the multi-host test; ps for orphan checks
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
