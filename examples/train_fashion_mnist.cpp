// train_fashion_mnist: the tutorial's multi-machine training template (section 6.3, "完整的多机多卡训练
// 脚本模板") in C++ — a small CNN on Fashion-MNIST with DistributedDataParallel, DistributedSampler and
// Adam, one process per rank started by dtrain-run.
//
//   ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/train_fashion_mnist
//   # two machines, as the tutorial's torchrun lines:
//   dtrain-run --nnodes 2 --node_rank 0 --nproc_per_node 4 --master_addr 192.168.1.1 --master_port 29500
//       train_fashion_mnist --epochs 30 --batch_size 32          # (one line; node_rank 1 on the other)
//
// Python (the tutorial):                            C++ (here):
//   dist.init_process_group(backend)                  dtrain::init_process_group()
//   DistributedSampler(ds, shuffle=True)              dtrain::DistributedSampler(n, ...seed(seed))
//   DataLoader(ds, batch_size, sampler, num_workers)  make_data_loader(train.batched(), sampler, ...)
//   DDP(model)                                        dtrain::DistributedDataParallel ddp(model)
//   sampler.set_epoch(epoch)                          sampler.set_epoch(epoch)
//   clip_grad_norm_(model.parameters(), clip)         torch::nn::utils::clip_grad_norm_(...)
//   if rank == 0: print(...)                          if (rank == 0) std::printf(...)
//
// Output (rank 0 only): a configuration line, progress (a bar on a terminal, else a line every 10% of an
// epoch), one line per epoch with training loss/accuracy averaged over all ranks and the test accuracy,
// and last exactly one line
//   RESULT epochs=E test_accuracy=A train_loss=L params_sha256=H ranks_agree=1
// A: test-set accuracy as a fraction in [0, 1] (every test sample counted once, over all ranks);
// L: mean training loss of the last epoch over all ranks; H: SHA-256 of the raw float32 bytes of all
// parameters in registration order (the bytes --dump_params writes), which every rank also computes
// for ranks_agree.
// Exit status: 0 on success, 1 on any error (one line "train_fashion_mnist: error: ..." on stderr of
// every rank).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/dtrain.h"
#include "dtrain/monitor.h"
#include "sample_log.h"
#include "train_support.h"

namespace {

using dtrain::datasets::FashionMNIST;

// Defaults: the tutorial's settings, which reach about 0.91 test accuracy in 5 epochs on 2 ranks
// (README, "The main job", has a run; its time per epoch is in docs/benchmarks.md).
constexpr int64_t kDefaultEpochs = 5;
constexpr int64_t kDefaultBatchSize = 32;  // per rank, as the tutorial
constexpr double kDefaultLr = 1e-3;

// conv 32, conv 64, linear 128: ~420K parameters.
struct FashionCNNImpl : torch::nn::Module {
  FashionCNNImpl() {
    using namespace torch::nn;
    conv1 = register_module("conv1", Conv2d(Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", Linear(64 * 7 * 7, 128));
    fc2 = register_module("fc2", Linear(128, 10));
  }
  at::Tensor forward(at::Tensor x) {                           // (B, 1, 28, 28)
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);  // (B, 32, 14, 14)
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);  // (B, 64, 7, 7)
    x = torch::relu(fc1->forward(x.flatten(1)));               // (B, 128)
    return fc2->forward(x);                                    // (B, 10) logits
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(FashionCNN);

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
  int64_t checkpoint_every = 0;  // steps between checkpoints (0: only at the end of each epoch)
  int64_t test_subset = 0;       // evaluate on the first N test samples only (0: all 10000)
  int64_t step_sleep_ms = 0;     // fault-injection tests: slow each step so an outside kill lands mid-epoch
  int64_t threads = 0;
  std::string dump_params;
  int64_t eval_batch_size = 0;          // 0: batch_size
  bool amp = false;                     // autocast (bfloat16 on CPU, float16 on CUDA) + GradScaler
  std::string device = "cpu";           // "cuda": rank r trains on cuda:LOCAL_RANK with backend nccl
  std::string comm_hook = "allreduce";  // allreduce (DDP's own), bf16, or powersgd
  std::string sample_log;               // folder of the per-rank logs of trained indices (sample_log.h)
  double uneven = 0;                    // rank r drops uneven * r / (world - 1) of its batches (Join)
  bool tensorboard = false;             // TensorBoard event files in checkpoint_dir
  // --comm_hook powersgd: the rank and the plain steps before compressing (PyTorch's defaults: 1, 1000)
  int64_t powersgd_rank = dtrain::PowerSGDOptions().matrix_approximation_rank();
  int64_t powersgd_start_iter = dtrain::PowerSGDOptions().start_powerSGD_iter();
};
// doc:end config

// Error text on one line (c10::Error messages may span several).
std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

// True on every rank iff `ok` on every rank: one failing rank stops all of them with a clear message
// instead of leaving the others to hang in the next collective.
bool all_ranks_ok(bool ok) {
  return dtrain::all_reduce_values(std::vector<int64_t>{ok ? 1 : 0}, dtrain::ReduceOp::MIN)[0] == 1;
}

// Runs `fn` on every rank (or on rank 0 only) and rethrows its failure on every rank.
template <typename Fn>
void collectively(const std::string& what, bool this_rank_runs, Fn&& fn) {
  std::string error;
  if (this_rank_runs) {
    try {
      fn();
    } catch (const c10::Error& e) {
      error = one_line(e.what_without_backtrace());
    } catch (const std::exception& e) {
      error = one_line(e.what());
    }
  }
  if (!all_ranks_ok(error.empty()))
    throw dtrain::Error(error.empty() ? what + " failed on another rank (see its error)" : error);
}

// Test accuracy over the whole test set. Each rank takes its shard of a non-shuffled DistributedSampler
// (rank r: samples r, r+W, r+2W, ...); the sampler pads the list to a multiple of W by wrapping around,
// and those padded positions (>= n) are skipped, so every test sample is counted exactly once.
double evaluate(FashionCNN& model, const FashionMNIST& test, int64_t batch_size, at::Device device) {
  torch::NoGradGuard no_grad;
  model->eval();
  const size_t n = test.size().value();
  dtrain::DistributedSampler sampler(n, dtrain::DistributedSamplerOptions().shuffle(false));
  const std::vector<int64_t> shard = sampler.indices();
  std::vector<size_t> mine;
  for (size_t k = 0; k < shard.size(); ++k)
    if (static_cast<size_t>(sampler.rank()) + k * sampler.num_replicas() < n) mine.push_back(shard[k]);
  int64_t correct = 0;
  for (size_t begin = 0; begin < mine.size(); begin += batch_size) {
    const size_t len = std::min<size_t>(batch_size, mine.size() - begin);
    auto batch = test.batch(c10::ArrayRef<size_t>(mine.data() + begin, len));
    correct += model->forward(batch.data.to(device)).argmax(1).eq(batch.target.to(device)).sum().item<int64_t>();
  }
  const auto counts = dtrain::all_reduce_values(std::vector<double>{double(correct), double(mine.size())});
  model->train();
  return counts[0] / counts[1];
}

// The configuration line's hook: "" for DDP's own all-reduce.
std::string comm_hook_text(const Config& cfg) {
  if (cfg.comm_hook == "allreduce") return "";
  if (cfg.comm_hook != "powersgd") return ", comm_hook " + cfg.comm_hook;
  return ", comm_hook powersgd (rank " + std::to_string(cfg.powersgd_rank) + ", after " +
         std::to_string(cfg.powersgd_start_iter) + " plain steps)";
}

int run(const Config& cfg) {
  // doc:begin init
  if (cfg.threads > 0) at::set_num_threads(static_cast<int>(cfg.threads));
  const bool cuda = cfg.device == "cuda";
  // doc:begin elastic
  // Under dtrain-run --nnodes MIN:MAX the world size may differ from one restart to the next: read it
  // after init, never from a flag.
  dtrain::init_process_group(dtrain::InitOptions().backend(cuda ? "nccl" : ""));  // "": gloo or $DTRAIN_BACKEND
  const int rank = dtrain::rank(), world = dtrain::world_size();
  // doc:end elastic
  const bool main_rank = rank == 0;
  // One GPU per rank, as torch.cuda.set_device(local_rank): the model, the batches and every
  // collective's tensors live there.
  if (cuda) dtrain::set_cuda_device(dtrain::local_rank());
  const at::Device device =
      cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(dtrain::local_rank())) : at::Device(at::kCPU);
  if (main_rank) dtrain::warn_if_slow_blas();
  // doc:end init

  // doc:begin data
  // Data: every rank loads both sets (an error on any rank stops all of them).
  std::optional<FashionMNIST> train, test;
  collectively("loading Fashion-MNIST", true, [&] {
    auto opts = dtrain::datasets::FashionMNISTOptions().standardize(true);
    if (cfg.subset > 0) opts.max_samples(static_cast<size_t>(cfg.subset));
    train.emplace(cfg.data_dir, FashionMNIST::Mode::kTrain, opts);
    test.emplace(cfg.data_dir, FashionMNIST::Mode::kTest,
                 opts.max_samples(cfg.test_subset > 0 ? std::optional<size_t>(cfg.test_subset) : std::nullopt));
  });
  // doc:end data
  if (!cfg.checkpoint_dir.empty())
    collectively("preparing --checkpoint_dir", main_rank, [&] {
      std::error_code ec;
      std::filesystem::create_directories(cfg.checkpoint_dir, ec);
      DTRAIN_CHECK(!ec && std::filesystem::is_directory(cfg.checkpoint_dir), "--checkpoint_dir ", cfg.checkpoint_dir,
                   ": cannot create the folder: ", ec ? ec.message() : "not a folder");
    });

  // doc:begin model
  // Model: the same seed everywhere (DDP broadcasts rank 0's parameters anyway).
  torch::manual_seed(static_cast<uint64_t>(cfg.seed));
  FashionCNN model;
  model->to(device);
  dtrain::DistributedDataParallel ddp(model);
  // doc:begin comm_hook
  // Communication hooks (dtrain/comm_hooks.h): bf16 halves the bytes of every all-reduce; PowerSGD
  // sends rank-r factors of each weight's gradient after plain all-reduce for the first steps.
  if (cfg.comm_hook == "bf16") ddp.register_comm_hook(dtrain::Group(), dtrain::bf16_compress_hook);
  std::optional<dtrain::PowerSGDState> powersgd;  // a handle shared with DDP's copy: read for the summary
  if (cfg.comm_hook == "powersgd") {
    powersgd.emplace(dtrain::PowerSGDOptions()
                         .matrix_approximation_rank(cfg.powersgd_rank)
                         .start_powerSGD_iter(cfg.powersgd_start_iter));
    ddp.register_comm_hook(*powersgd, dtrain::powerSGD_hook);
  }
  // doc:end comm_hook
  // Adam as the tutorial; SGD (momentum 0.9) has updates linear in the gradient, which makes
  // parameter equivalence checks exact up to float rounding (Adam's first steps are ~lr * sign(grad),
  // so rounding noise in a near-zero gradient can move a parameter by up to 2 * lr).
  std::unique_ptr<torch::optim::Optimizer> optimizer_ptr;
  if (cfg.optimizer == "sgd")
    optimizer_ptr =
        std::make_unique<torch::optim::SGD>(ddp.parameters(), torch::optim::SGDOptions(cfg.lr).momentum(0.9));
  else
    optimizer_ptr = std::make_unique<torch::optim::Adam>(ddp.parameters(), torch::optim::AdamOptions(cfg.lr));
  torch::optim::Optimizer& optimizer = *optimizer_ptr;
  // The tutorial's AMP recipe; disabled, every call is a pass-through.
  dtrain::GradScaler scaler(dtrain::GradScalerOptions().enabled(cfg.amp));
  // doc:end model

  // doc:begin loader
  dtrain::DistributedSampler sampler(train->size().value(), dtrain::DistributedSamplerOptions().seed(cfg.seed));
  // IndexedBatches: FashionMNIST::batched() whose batches also carry their indices (--sample_log).
  auto loader = torch::data::make_data_loader(
      train::IndexedBatches(*train), sampler,
      torch::data::DataLoaderOptions().batch_size(cfg.batch_size).workers(cfg.num_workers));
  const int64_t steps = (static_cast<int64_t>(sampler.size()) + cfg.batch_size - 1) / cfg.batch_size;
  // doc:end loader
  // --uneven: this rank's batches per epoch (the last rank the fewest, rank 0 all of them).
  const int64_t my_steps = world > 1 ? steps - static_cast<int64_t>(cfg.uneven * steps * rank / (world - 1)) : steps;

  // doc:begin resume
  // Fault tolerance (dtrain/checkpoint.h): with --checkpoint_dir every rank resumes from the newest
  // good checkpoint there (after a dtrain-run --max_restarts restart, or a new run), mid-epoch at the
  // sampler's position, with this epoch's running sums, so the run ends bit-identical to one never
  // interrupted (Note [exact resume]).
  dtrain::TrainingState state;
  state.model = ddp.module().get();
  state.optimizer = &optimizer;
  state.scaler = &scaler;
  state.sampler = &sampler;
  std::optional<dtrain::CheckpointManager> checkpoints;
  int64_t start_epoch = 1, global_step = 0;
  bool resharded = false;  // resumed from a checkpoint of another world size
  if (!cfg.checkpoint_dir.empty()) {
    checkpoints.emplace(cfg.checkpoint_dir);
    if (auto path = checkpoints->load_latest(state)) {
      start_epoch = state.epoch;
      global_step = state.step;
      // Saved by another world size: the sampler continues with the rest of the epoch split over
      // this world (Note [Resharded epoch]), and the epoch's running sums of all saved ranks go to
      // rank 0, so the epoch's statistics still count every step once.
      resharded = state.saved_world_size != world;
      if (resharded) {
        std::map<std::string, double> sums;
        if (main_rank)
          for (const auto& values : state.saved_values)
            for (const auto& [key, value] : values) sums[key] += value;
        state.values = sums;
      }
      if (main_rank) {
        std::printf("resumed from %s: epoch %lld, step %lld of the epoch, %lld steps done (restart %d)%s\n",
                    path->c_str(), static_cast<long long>(start_epoch),
                    static_cast<long long>(state.sampler_position / cfg.batch_size),
                    static_cast<long long>(global_step), dtrain::restart_count(),
                    resharded ? (", saved by " + std::to_string(state.saved_world_size) +
                                 " rank(s): the rest of the epoch is resharded over " + std::to_string(world))
                                    .c_str()
                              : "");
        std::fflush(stdout);
      }
    }
  }
  // doc:end resume

  if (main_rank) {
    std::printf(
        "train_fashion_mnist: %d rank(s) x %d thread(s), %s, backend %s | %zu training samples, %zu test | "
        "batch %lld per rank (%lld global), %lld steps/epoch | %s lr %g, grad_clip %g, %lld epoch(s), "
        "seed %lld%s\n",
        world, at::get_num_threads(), cuda ? "cuda:LOCAL_RANK" : "cpu", dtrain::backend().c_str(),
        train->size().value(), test->size().value(), static_cast<long long>(cfg.batch_size),
        static_cast<long long>(cfg.batch_size * world), static_cast<long long>(steps),
        cfg.optimizer == "sgd" ? "SGD(momentum 0.9)"
                               : (cfg.amp ? (cuda ? "Adam+amp(fp16)" : "Adam+amp(bf16)") : "Adam"),
        cfg.lr, cfg.grad_clip, static_cast<long long>(cfg.epochs), static_cast<long long>(cfg.seed),
        comm_hook_text(cfg).c_str());
    std::fflush(stdout);
  }

  // doc:begin monitor
  // Monitoring (dtrain/monitor.h): progress on rank 0 (a bar on a terminal, else a line every 10% of
  // an epoch); with --checkpoint_dir also metrics.jsonl (every 50 steps, min/mean/max over ranks),
  // trace.json (the first 50 steps of every rank) and plot.svg, next to the checkpoints; with
  // --tensorboard also TensorBoard's event files there (histograms every 10th window).
  dtrain::Monitor monitor(dtrain::MonitorOptions()
                              .output_dir(cfg.checkpoint_dir)
                              .log_every(50)
                              .trace_steps(50)
                              .tensorboard(cfg.tensorboard)
                              .histogram_every(10));
  monitor.watch(ddp);
  // doc:end monitor

  std::optional<train::SampleLog> sample_log;
  collectively("opening --sample_log", true,
               [&] { sample_log.emplace(cfg.sample_log, rank, dtrain::restart_count()); });
  const auto t0 = std::chrono::steady_clock::now();
  double train_loss = 0, test_accuracy = 0;
  for (int64_t epoch = start_epoch; epoch <= cfg.epochs; ++epoch) {
    // doc:begin set-epoch
    sampler.set_epoch(epoch - 1);  // a new shuffle every epoch, the same on every rank
    // doc:end set-epoch
    const auto te = std::chrono::steady_clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0, step = 0;
    // This epoch's steps on this rank: fewer in an epoch resharded from another world size.
    const int64_t epoch_steps = (static_cast<int64_t>(sampler.epoch_size()) + cfg.batch_size - 1) / cfg.batch_size;
    if (epoch == start_epoch && (state.sampler_position > 0 || resharded)) {
      // resumed mid-epoch: the loader skips ahead, and the running sums go on
      step = state.sampler_position / cfg.batch_size;
      loss_sum = state.values["loss_sum"];
      correct = static_cast<int64_t>(state.values["correct"]);
      seen = static_cast<int64_t>(state.values["seen"]);
    }
    // doc:begin begin-epoch
    monitor.begin_epoch(epoch, cfg.epochs, epoch_steps, step);
    // doc:end begin-epoch
    // doc:begin save-checkpoint
    // This rank's progress through the epoch, as the checkpoint stores it.
    auto save_checkpoint = [&] {
      state.step = global_step;
      state.epoch = epoch;
      state.sampler_position = std::min<int64_t>(step * cfg.batch_size, static_cast<int64_t>(sampler.epoch_size()));
      state.values = {
          {"loss_sum", loss_sum}, {"correct", static_cast<double>(correct)}, {"seen", static_cast<double>(seen)}};
      checkpoints->save(state);
    };
    // doc:end save-checkpoint
    // doc:begin uneven
    // --uneven: ranks run out of batches at different steps. Inside the Join a rank that has run out
    // shadows the others' gradient all-reduces until all are done (enable(false): no Join at all).
    dtrain::Join join({&ddp}, dtrain::JoinOptions().enable(cfg.uneven > 0));
    // doc:end uneven
    // doc:begin batch-loop
    for (auto& indexed : *loader) {
      if (step >= my_steps) break;  // --uneven
      torch::data::Example<>& batch = indexed.example;
      at::Tensor logits, loss;
      double grad_norm = NAN;  // known with --grad_clip; else the monitor samples it
      {
        auto phase = monitor.phase(dtrain::Phase::kForward);
        // Autocast's defaults, as PyTorch's: bfloat16 on the CPU, float16 on CUDA.
        dtrain::Autocast autocast(device.type(), cuda ? at::kHalf : at::kBFloat16, /*enabled=*/cfg.amp);
        batch.data = batch.data.to(device);
        batch.target = batch.target.to(device);
        logits = ddp(batch.data);  // (B, 10)
        loss = torch::nn::functional::cross_entropy(logits, batch.target);
      }
      {
        auto phase = monitor.phase(dtrain::Phase::kBackward);
        optimizer.zero_grad();
        scaler.scale(loss).backward();  // gradients are averaged over the ranks here
      }
      {
        auto phase = monitor.phase(dtrain::Phase::kOptimizer);
        if (cfg.grad_clip > 0) {
          scaler.unscale_(optimizer);  // clip the true gradients (a no-op without --amp)
          grad_norm = torch::nn::utils::clip_grad_norm_(ddp.parameters(), cfg.grad_clip);
        }
        scaler.step(optimizer);  // skipped after an overflow (--amp)
        scaler.update();
      }

      const int64_t b = batch.target.size(0);
      const double step_loss = loss.item<double>();
      const int64_t step_correct = logits.argmax(1).eq(batch.target).sum().item<int64_t>();
      loss_sum += step_loss * b;
      correct += step_correct;
      seen += b;
      ++step;
      // The monitor's windows are collectives that a joined rank would not shadow: off with --uneven.
      if (cfg.uneven == 0)
        monitor.end_step(dtrain::StepInfo()
                             .loss(step_loss)
                             .samples(b)
                             .accuracy(static_cast<double>(step_correct) / b)
                             .lr(cfg.lr)
                             .grad_norm(grad_norm));
      ++global_step;
      sample_log->write(epoch, global_step, indexed.indices);
      if (checkpoints && cfg.checkpoint_every > 0 && global_step % cfg.checkpoint_every == 0) save_checkpoint();
      if (cfg.step_sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.step_sleep_ms));
    }
    // doc:end batch-loop
    join.join();  // --uneven: wait for (and shadow) the ranks with batches left
    monitor.end_epoch();
    // The end of every epoch is a checkpoint too (unless the last step just wrote one).
    if (checkpoints && !(cfg.checkpoint_every > 0 && global_step % cfg.checkpoint_every == 0)) save_checkpoint();

    // doc:begin epoch-stats
    // Epoch statistics over all ranks (each rank's samples, padded duplicates included, as PyTorch).
    const auto stats = dtrain::all_reduce_values(std::vector<double>{loss_sum, double(correct), double(seen)});
    train_loss = stats[0] / stats[2];
    const double train_accuracy = stats[1] / stats[2];
    const double epoch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - te).count();
    const auto tt = std::chrono::steady_clock::now();
    test_accuracy = evaluate(model, *test, cfg.eval_batch_size > 0 ? cfg.eval_batch_size : cfg.batch_size, device);
    const double test_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - tt).count();
    // doc:begin progress
    monitor.log_epoch(epoch, dtrain::EpochInfo()
                                 .train_loss(train_loss)
                                 .train_accuracy(train_accuracy)
                                 .test_accuracy(test_accuracy));  // plot.svg's points, TensorBoard's epoch/*
    // doc:end progress
    if (main_rank) {
      std::printf("Epoch %lld/%lld: Loss=%.4f, Acc=%.4f, Test Acc=%.4f | train %.1f s (%.0f samples/s), test %.1f s\n",
                  static_cast<long long>(epoch), static_cast<long long>(cfg.epochs), train_loss, train_accuracy,
                  test_accuracy, epoch_s, stats[2] / epoch_s, test_s);
      std::fflush(stdout);
    }
    // doc:end epoch-stats
  }

  // doc:begin monitor-close
  monitor.close();  // every rank: the last metrics window, the merged trace, the plot
  // doc:end monitor-close
  // doc:begin ranks-agree
  // DDP keeps every rank's parameters identical: check it (each rank's hash, compared on rank 0).
  const std::string bytes = train::parameter_bytes(ddp.parameters());
  const std::string sha = train::sha256_hex(bytes);
  const std::vector<std::string> all = dtrain::all_gather_bytes(sha);
  int first_disagreeing = -1;
  for (int r = 0; r < dtrain::world_size() && first_disagreeing < 0; ++r)
    if (all[r] != all[0]) first_disagreeing = r;
  // doc:end ranks-agree
  if (main_rank) {
    const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!cfg.dump_params.empty()) train::write_file(cfg.dump_params, bytes);
    if (first_disagreeing >= 0)
      std::fprintf(stderr, "train_fashion_mnist: warning: rank %d's final parameters differ from rank 0's\n",
                   first_disagreeing);
    // What PowerSGD did, from its state (not the flags): a run that never left its plain steps
    // compressed nothing.
    if (powersgd) {
      const dtrain::PowerSGDOptions& o = powersgd->options();
      const int64_t synced = powersgd->iter();
      const int64_t compressed = std::max<int64_t>(0, synced - o.start_powerSGD_iter());
      const auto stats = powersgd->compression_stats();
      std::printf("PowerSGD: %lld of %lld steps compressed (rank %lld, plain all-reduce for the first %lld)",
                  static_cast<long long>(compressed), static_cast<long long>(synced),
                  static_cast<long long>(o.matrix_approximation_rank()),
                  static_cast<long long>(o.start_powerSGD_iter()));
      if (compressed > 0)
        std::printf(": %lld -> %lld gradient elements sent per step (%.1fx fewer)",
                    static_cast<long long>(stats.numel_before / compressed),
                    static_cast<long long>(stats.numel_after / compressed), stats.rate);
      std::printf("\n");
    }
    std::printf("training took %.1f s\n", total_s);
    std::printf("RESULT epochs=%lld test_accuracy=%.4f train_loss=%.4f params_sha256=%s ranks_agree=%d\n",
                static_cast<long long>(cfg.epochs), test_accuracy, train_loss, sha.c_str(),
                first_disagreeing < 0 ? 1 : 0);
    std::fflush(stdout);
  }
  dtrain::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // doc:begin allocator
  dtrain::reduce_allocator_churn();  // Note [malloc churn] in dtrain/system.h
  // doc:end allocator
  Config cfg;
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
  app.add_option("--sample_log", cfg.sample_log,
                 "folder where each rank appends every dataset index it trains to "
                 "samples.rank<RANK>.attempt<TORCHELASTIC_RESTART_COUNT or 0>.txt, one line 'EPOCH STEP INDEX' per "
                 "sample (epoch 1-based; STEP the global optimizer step, 1-based, so lines with a step after the "
                 "resumed checkpoint's were replayed), flushed after every step");
  numbers.add("--uneven", cfg.uneven, Allowed::kNonNegativeNumber,
              "uneven inputs under dtrain::Join: rank r trains on only (1 - F * r / (ranks - 1)) of its batches per "
              "epoch, F in [0, 1) (0: even; not with --checkpoint_dir; the per-step monitor is off)");
  app.add_option("--dump_params", cfg.dump_params,
                 "rank 0 writes the final parameters' raw float32 bytes here (what params_sha256 hashes)");
  // Note [eval batch size]: evaluating with batches larger than the training batch was up to 10x
  // slower per sample here (1000: 39 s for the test set, 64: 3 s): activations above glibc's adaptive
  // mmap threshold are mmap'ed and page-faulted afresh on every forward. Training sizes are warm.
  numbers.add("--eval_batch_size", cfg.eval_batch_size, Allowed::kNonNegativeInteger,
              "samples per forward when measuring test accuracy (0: --batch_size; see Note [eval batch size])");
  numbers.add("--local_rank,--local-rank", local_rank, Allowed::kInteger,
              "passed by dtrain-run --use_local_rank_arg (unused)");
  // Parsing comes before init_process_group, so every rank fails alone and at once on a bad flag.
  if (std::optional<int> exit_code = numbers.parse(argc, argv, "train_fashion_mnist")) return *exit_code;
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

  try {
    return run(cfg);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "train_fashion_mnist: error: %s\n", one_line(e.what_without_backtrace()).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: error: %s\n", one_line(e.what()).c_str());
  }
  return 1;
}
