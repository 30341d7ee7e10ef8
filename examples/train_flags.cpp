// train_fashion_mnist's flags: every flag, its default, and the checks that span several flags.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <CLI/CLI.hpp>

#include "train_config.h"
#include "train_support.h"

namespace train {
namespace {

// --local_sgd and --diloco against the flags they cannot meet, one line each (0: fine).
int check_local_averaging(const Config& cfg) {
  if (cfg.local_sgd == 0 && cfg.diloco == 0) return 0;
  const char* flag = cfg.local_sgd > 0 ? "--local_sgd" : "--diloco";
  // Each replica's own step count drives its meetings: a step one rank skips (--amp's overflow, a
  // rank out of batches) would leave the replicas at different meetings.
  const std::string other = cfg.local_sgd > 0 && cfg.diloco > 0 ? "--diloco"
                            : cfg.fsdp                          ? "--fsdp"
                            : cfg.comm_hook != "allreduce"      ? "--comm_hook " + cfg.comm_hook
                            : cfg.uneven > 0                    ? "--uneven"
                            : cfg.amp                           ? "--amp"
                            : !cfg.checkpoint_dir.empty()       ? "--checkpoint_dir"
                                                                : "";
  if (other.empty()) return 0;
  std::fprintf(stderr,
               "train_fashion_mnist: error: %s cannot be combined with %s (the replicas meet every H steps of their "
               "own, %s): drop one of them\n",
               flag, other.c_str(),
               other == "--checkpoint_dir" ? "and the meetings' state is not in checkpoints"
                                           : "without DDP's per-step all-reduce");
  return 1;
}

}  // namespace

std::optional<int> parse_flags(int argc, char** argv, Config& cfg) {
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) cfg.threads = std::max(0, std::atoi(omp));
  int64_t local_rank = -1;

  CLI::App app{"train_fashion_mnist: a CNN on Fashion-MNIST with DistributedDataParallel (start it with dtrain-run)"};
  // Numeric flags go through train::NumericFlags: one error line naming the flag, the value and what
  // is allowed (train_support.h says why not CLI11's own checks).
  using train::Allowed;
  train::NumericFlags numbers(app);
  numbers.add("--epochs", cfg.epochs, Allowed::kPositiveInteger, "passes over the training set");
  numbers.add("--batch_size", cfg.batch_size, Allowed::kPositiveInteger,
              "samples per step on each rank (global batch = this x ranks)");
  numbers.add("--lr", cfg.lr, Allowed::kPositiveNumber, "learning rate");
  app.add_option("--optimizer", cfg.optimizer, "adam, or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adam", "sgd"}))
      ->capture_default_str();
  numbers.add("--seed", cfg.seed, Allowed::kInteger, "seed of the initial weights and of the sampler's shuffle");
  numbers.add("--num_workers", cfg.num_workers, Allowed::kNonNegativeInteger,
              "data-loader threads per rank (0: load in the training thread)");
  numbers.add("--subset", cfg.subset, Allowed::kNonNegativeInteger,
              "train on the first N training samples only (0: all 60000)");
  app.add_option("--data_dir", cfg.data_dir, "folder with the Fashion-MNIST IDX files")->capture_default_str();
  numbers.add("--grad_clip", cfg.grad_clip, Allowed::kNonNegativeNumber,
              "clip the gradient norm to this after backward (0: off)");
  CLI::Option* checkpoint_dir = app.add_option(
      "--checkpoint_dir", cfg.checkpoint_dir,
      "rank 0 writes <dir>/checkpoint_<step>.pt (model, optimizer, scaler, sampler position, RNG) after "
      "every epoch and every --checkpoint_every steps, keeping the newest 2; a run resumes from the newest "
      "good one there");
  numbers.add("--checkpoint_every", cfg.checkpoint_every, Allowed::kNonNegativeInteger,
              "steps between checkpoints (0: at the end of each epoch only)");
  app.add_flag("--async_checkpoint", cfg.async_checkpoint,
               "write checkpoints in the background (CheckpointManager::save_async): a step waits only for the "
               "state's copy in memory")
      ->needs(checkpoint_dir);
  numbers.add("--test_subset", cfg.test_subset, Allowed::kNonNegativeInteger,
              "evaluate on the first N test samples only (0: all 10000)");
  numbers.add("--step_sleep_ms", cfg.step_sleep_ms, Allowed::kNonNegativeInteger,
              "sleep this long after every step (fault-injection tests: lets an outside kill land mid-epoch)");
  numbers.add("--threads", cfg.threads, Allowed::kNonNegativeInteger,
              "intra-op threads per rank (default: $OMP_NUM_THREADS; 0: LibTorch's)");
  app.add_flag("--tensorboard", cfg.tensorboard,
               "rank 0 also writes TensorBoard event files into --checkpoint_dir (open them with `tensorboard "
               "--logdir DIR`): loss, accuracy, samples/s, phase and communication times, min/max over ranks, "
               "per-epoch train and test accuracy, histograms of parameters and gradients")
      ->needs(checkpoint_dir);
  app.add_flag("--amp", cfg.amp, "mixed precision: autocast (bfloat16 on CPU, float16 on CUDA) + GradScaler");
  app.add_option("--device", cfg.device,
                 "cpu, or cuda: rank r trains on cuda:LOCAL_RANK with backend nccl (one GPU per rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--comm_hook", cfg.comm_hook,
                 "how DDP averages gradients: allreduce (its own all-reduce), bf16 (bfloat16 compression), powersgd "
                 "(PowerSGD with error feedback and warm start, set by --powersgd_rank and --powersgd_start_iter; its "
                 "state is not in checkpoints, so a resumed run starts its plain steps again)")
      ->check(CLI::IsMember({"allreduce", "bf16", "powersgd"}))
      ->capture_default_str();
  numbers.add("--powersgd_rank", cfg.powersgd_rank, Allowed::kPositiveInteger,
              "with --comm_hook powersgd: the rank r of each compressed gradient matrix's factors (PyTorch's "
              "matrix_approximation_rank)");
  numbers.add("--powersgd_start_iter", cfg.powersgd_start_iter, Allowed::kInteger,
              "with --comm_hook powersgd: plain all-reduce for this many steps before compressing, at least 2 "
              "(PyTorch's start_powerSGD_iter)");
  CLI::Option* fsdp = app.add_flag(
      "--fsdp", cfg.fsdp,
      "fully sharded data parallel (dtrain::fully_shard, FSDP2) instead of DDP: each rank holds its rows of every "
      "parameter, gradient and optimizer state; fc1 is a unit of its own, the rest the root's; checkpoints are "
      "written by every rank, its own shards");
  std::string reshard = "true";
  app.add_option("--reshard_after_forward", reshard,
                 "with --fsdp: true frees fc1's gathered parameters after its forward and gathers them again in "
                 "backward (ZeRO-3), false keeps them until its backward (ZeRO-2 for the parameters)")
      ->check(CLI::IsMember({"true", "false"}))
      ->needs(fsdp)
      ->capture_default_str();
  app.add_option("--fsdp_mesh", cfg.fsdp_mesh,
                 "with --fsdp: R,S shards over groups of S ranks and replicates across R of them (HSDP, FSDP2's "
                 "2-D mesh (replicate, shard)); R x S must be the world size")
      ->delimiter(',')
      ->expected(2)
      ->check(CLI::PositiveNumber)
      ->needs(fsdp);
  std::string ac = "none";
  app.add_option("--activation_checkpoint", ac,
                 "recompute activations in backward instead of keeping them (dtrain::checkpoint): none, full (both "
                 "conv blocks, where the activations are) or every:K (every K-th conv block)")
      ->check([](const std::string& v) {
        if (v == "none" || v == "full") return std::string();
        if (v.rfind("every:", 0) == 0 && v.size() > 6 && v.find_first_not_of("0123456789", 6) == std::string::npos &&
            std::stoll(v.substr(6)) >= 1)
          return std::string();
        return "give none, full or every:K with K >= 1, got '" + v + "'";
      })
      ->capture_default_str();
  app.add_option("--sample_log", cfg.sample_log,
                 "folder where each rank appends every dataset index it trains to "
                 "samples.rank<RANK>.attempt<TORCHELASTIC_RESTART_COUNT or 0>.txt, one line 'EPOCH STEP INDEX' per "
                 "sample (epoch 1-based; STEP the global optimizer step, 1-based, so lines with a step after the "
                 "resumed checkpoint's were replayed), flushed after every step");
  numbers.add("--local_sgd", cfg.local_sgd, Allowed::kNonNegativeInteger,
              "LocalSGD: no per-step gradient all-reduce; the replicas average their parameters every H optimizer "
              "steps (dtrain::LocalSGD; 0: off, DDP)");
  numbers.add("--diloco", cfg.diloco, Allowed::kNonNegativeInteger,
              "DiLoCo: no per-step gradient all-reduce; every H optimizer steps (the inner ones) the replicas average "
              "how far they moved and take an outer Nesterov SGD step, lr 0.7, momentum 0.9 (dtrain::DiLoCo; 0: off)");
  numbers.add("--uneven", cfg.uneven, Allowed::kNonNegativeNumber,
              "uneven inputs under dtrain::Join: rank r trains on only (1 - F * r / (ranks - 1)) of its batches per "
              "epoch, F in [0, 1) (0: even; not with --checkpoint_dir; the per-step monitor is off)");
  app.add_option("--save_safetensors", cfg.save_safetensors,
                 "rank 0 writes the trained model here as a .safetensors file (Python: "
                 "safetensors.torch.load_file; examples/eval_safetensors.py evaluates it)");
  app.add_option("--dump_params", cfg.dump_params,
                 "rank 0 writes the final parameters' raw float32 bytes here (what params_sha256 hashes)");
  // Note [eval batch size]: evaluating with batches larger than the training batch was up to 10x
  // slower per sample here (1000: 39 s for the test set, 64: 3 s): activations above glibc's adaptive
  // mmap threshold are mmap'ed and page-faulted afresh on every forward. Training sizes are warm.
  numbers.add("--eval_batch_size", cfg.eval_batch_size, Allowed::kNonNegativeInteger,
              "samples per forward when measuring test accuracy (0: --batch_size; see Note [eval batch size])");
  numbers.add("--local_rank,--local-rank", local_rank, Allowed::kInteger,
              "passed by dtrain-run --use_local_rank_arg (unused)");
  if (std::optional<int> exit_code = numbers.parse(argc, argv, "train_fashion_mnist")) return exit_code;
  cfg.reshard_after_forward = reshard == "true";
  cfg.activation_checkpoint = ac == "none" ? 0 : ac == "full" ? 1 : static_cast<int>(std::stoll(ac.substr(6)));
  // fully_shard has neither DDP's communication hooks nor Join: say so rather than ignore the flag.
  if (cfg.fsdp && (cfg.comm_hook != "allreduce" || cfg.uneven > 0)) {
    std::fprintf(stderr,
                 "train_fashion_mnist: error: --fsdp cannot be combined with %s (DDP's only): drop one of them\n",
                 cfg.comm_hook != "allreduce" ? ("--comm_hook " + cfg.comm_hook).c_str() : "--uneven");
    return 1;
  }
  if (check_local_averaging(cfg) != 0) return 1;
  if (cfg.uneven >= 1 || (cfg.uneven > 0 && !cfg.checkpoint_dir.empty())) {
    std::fprintf(stderr, "train_fashion_mnist: error: --uneven %g: %s\n", cfg.uneven,
                 cfg.uneven >= 1 ? "must be below 1 (the fraction of its batches the last rank drops)"
                                 : "cannot be combined with --checkpoint_dir (a checkpoint is a collective that a "
                                   "rank which has run out does not shadow): drop one of them");
    return 1;
  }
  // PyTorch's PowerSGDState refuses start_powerSGD_iter <= 1 when error feedback or warm start is on
  // (both are here, its defaults): their memories are kept per bucket, and its DDP may rebuild the buckets
  // after the first step. dtrain::PowerSGDState checks the same; here it is the flag's one-line error.
  if (cfg.powersgd_start_iter < 2) {
    std::fprintf(stderr,
                 "train_fashion_mnist: error: --powersgd_start_iter must be an integer >= 2, got '%lld' (PowerSGD's "
                 "error feedback and warm start need 2 plain steps first, as in PyTorch)\n",
                 static_cast<long long>(cfg.powersgd_start_iter));
    return 1;
  }
  // Tuning a hook that is not used would change nothing: say so rather than run without it.
  for (const char* flag : {"--powersgd_rank", "--powersgd_start_iter"})
    if (app.count(flag) > 0 && cfg.comm_hook != "powersgd") {
      std::fprintf(stderr,
                   "train_fashion_mnist: error: %s applies to --comm_hook powersgd only, got --comm_hook %s: add "
                   "--comm_hook powersgd or drop %s\n",
                   flag, cfg.comm_hook.c_str(), flag);
      return 1;
    }
  return std::nullopt;
}

}  // namespace train
