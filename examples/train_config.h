// The configuration of examples/train_fashion_mnist.cpp and its command line (train_flags.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm_hooks.h"
#include "dtrain/datasets/fashion_mnist.h"

namespace train {

using dtrain::datasets::FashionMNIST;

// Defaults: the tutorial's settings, which reach about 0.91 test accuracy in 5 epochs on 2 ranks
// (README, "The main job", has a run; its time per epoch is in docs/benchmarks.md).
constexpr int64_t kDefaultEpochs = 5;
constexpr int64_t kDefaultBatchSize = 32;  // per rank, as the tutorial
constexpr double kDefaultLr = 1e-3;

// doc:begin config
struct Config {
  int64_t epochs = kDefaultEpochs;
  int64_t batch_size = kDefaultBatchSize;
  double lr = kDefaultLr;
  std::string optimizer = "adam";
  int64_t seed = 0;
  int64_t num_workers = 0;
  int64_t subset = 0;
  std::string data_dir = FashionMNIST::kDefaultRoot;
  double grad_clip = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;   // steps between checkpoints (0: only at the end of each epoch)
  bool async_checkpoint = false;  // CheckpointManager::save_async
  int64_t test_subset = 0;        // evaluate on the first N test samples only (0: all 10000)
  int64_t step_sleep_ms = 0;      // fault-injection tests: slow each step so an outside kill lands mid-epoch
  int64_t threads = 0;
  std::string dump_params;
  std::string save_safetensors;
  int64_t eval_batch_size = 0;          // 0: batch_size
  bool amp = false;                     // autocast (bfloat16 on CPU, float16 on CUDA) + GradScaler
  std::string device = "cpu";           // "cuda": rank r trains on cuda:LOCAL_RANK with backend nccl
  std::string comm_hook = "allreduce";  // allreduce (DDP's own), bf16, or powersgd
  std::string sample_log;               // folder of the per-rank logs of trained indices (sample_log.h)
  double uneven = 0;                    // rank r drops uneven * r / (world - 1) of its batches (Join)
  // Replicas that train alone between meetings (dtrain/local_sgd.h), no per-step gradient all-reduce:
  int64_t local_sgd = 0;     // LocalSGD: average the parameters every H optimizer steps (0: off)
  int64_t diloco = 0;        // DiLoCo: an outer Nesterov SGD step (lr 0.7, momentum 0.9) every H steps (0: off)
  bool tensorboard = false;  // TensorBoard event files in checkpoint_dir
  bool fsdp = false;         // fully_shard instead of DDP: each rank holds its rows only
  bool reshard_after_forward = true;  // --fsdp: free fc1's whole parameters after its forward (ZeRO-3)
  std::vector<int64_t> fsdp_mesh;     // --fsdp over a 2-D mesh {replicate, shard} (HSDP); empty: 1-D
  int activation_checkpoint = 0;      // recompute every K-th conv block in backward (0: none, 1: full)
  // --comm_hook powersgd: the rank and the plain steps before compressing (PyTorch's defaults: 1, 1000)
  int64_t powersgd_rank = dtrain::PowerSGDOptions().matrix_approximation_rank();
  int64_t powersgd_start_iter = dtrain::PowerSGDOptions().start_powerSGD_iter();
};
// doc:end config

// The command line into `cfg`. Returns std::nullopt to go on, else the exit code (0 after --help, 1
// after one error line). It runs before init_process_group, so every rank fails alone and at once on
// a bad flag.
std::optional<int> parse_flags(int argc, char** argv, Config& cfg);

}  // namespace train
