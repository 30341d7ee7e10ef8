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
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/dtrain.h"
#include "dtrain/fsdp.h"
#include "dtrain/local_sgd.h"
#include "dtrain/monitor.h"
#include "collective_errors.h"
#include "sample_log.h"
#include "train_config.h"
#include "train_support.h"

namespace {

using dtrain::datasets::FashionMNIST;
using train::collectively;
using train::Config;
using train::one_line;

// conv 32, conv 64, linear 128: ~420K parameters. fc1 (401K of them) is declared as a unit of
// --fsdp; without it, FSDPModule is a plain pass-through.
struct FashionCNNImpl : torch::nn::Module {
  FashionCNNImpl() {
    using namespace torch::nn;
    conv1 = register_module("conv1", Conv2d(Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = dtrain::FSDPModule<LinearImpl>(register_module("fc1", std::make_shared<LinearImpl>(64 * 7 * 7, 128)));
    fc2 = register_module("fc2", Linear(128, 10));
  }
  at::Tensor forward(at::Tensor x) {     // (B, 1, 28, 28)
    x = conv_block(0, conv1, x);         // (B, 32, 14, 14)
    x = conv_block(1, conv2, x);         // (B, 64, 7, 7)
    x = torch::relu(fc1(x.flatten(1)));  // (B, 128)
    return fc2->forward(x);              // (B, 10) logits
  }
  // conv, relu, pool; with --activation_checkpoint, block i is recomputed in backward when i is a
  // multiple of checkpoint_every (dtrain/activation_checkpoint.h): the conv blocks hold most of the
  // activations (32 x 28 x 28 and 64 x 14 x 14 per sample against fc1's 128).
  at::Tensor conv_block(int i, torch::nn::Conv2d& conv, const at::Tensor& x) {
    // doc:begin activation_checkpoint
    auto block = [&](const std::vector<at::Tensor>& in) {
      return torch::max_pool2d(torch::relu(conv->forward(in[0])), 2);
    };
    if (checkpoint_every == 0 || i % checkpoint_every != 0) return block({x});
    return dtrain::checkpoint(block, {x}, dtrain::ActivationCheckpointOptions().parameters(conv->parameters()));
    // doc:end activation_checkpoint
  }
  int checkpoint_every = 0;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  dtrain::FSDPModule<torch::nn::LinearImpl> fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(FashionCNN);
using DDP = dtrain::DistributedDataParallel<FashionCNNImpl>;

// The model as the ranks train it: DDP (every rank whole) or, with --fsdp, fully_shard (each rank its
// rows of every parameter, gathered unit by unit while it runs).
struct Parallel {
  std::optional<DDP> ddp;
  std::optional<dtrain::FSDPModule<FashionCNNImpl>> fsdp;
  at::Tensor operator()(const at::Tensor& x) { return ddp ? (*ddp)(x) : (*fsdp)(x); }
  std::vector<at::Tensor> parameters() const { return ddp ? ddp->parameters() : fsdp->parameters(); }
  // clip_grad_norm_ over whole gradients: DDP's are whole on every rank, fully_shard's across the ranks.
  double clip_grad_norm_(double max_norm) {
    return ddp ? torch::nn::utils::clip_grad_norm_(ddp->parameters(), max_norm)
               : dtrain::clip_grad_norm_(fsdp->parameters(), max_norm);
  }
  // The whole parameters by name, in registration order, on every rank (fully_shard's: gathered).
  std::vector<std::pair<std::string, at::Tensor>> whole_named() {
    if (fsdp) return fsdp->full_state_dict();
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& kv : ddp->module()->named_parameters()) out.emplace_back(kv.key(), kv.value());
    return out;
  }
  std::vector<at::Tensor> whole_parameters() {
    std::vector<at::Tensor> out;
    for (auto& kv : whole_named()) out.push_back(kv.second);
    return out;
  }
};

// Test accuracy over the whole test set. Each rank takes its shard of a non-shuffled DistributedSampler
// (rank r: samples r, r+W, r+2W, ...); the sampler pads the list to a multiple of W by wrapping around,
// and those padded positions (>= n) are skipped, so every test sample is counted exactly once.
double evaluate(FashionCNN& model, Parallel& par, const FashionMNIST& test, int64_t batch_size, at::Device device) {
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
    correct += par(batch.data.to(device)).argmax(1).eq(batch.target.to(device)).sum().item<int64_t>();
  }
  if (par.fsdp) par.fsdp->reshard();  // no backward follows to free the root's gathered parameters
  const auto counts = dtrain::all_reduce_values(std::vector<double>{double(correct), double(mine.size())});
  model->train();
  return counts[0] / counts[1];
}

// The configuration line's hook: "" for DDP's own all-reduce; fully_shard's mode with --fsdp; LocalSGD's
// or DiLoCo's meetings; and the
// conv blocks recomputed in backward with --activation_checkpoint.
std::string comm_hook_text(const Config& cfg) {
  std::string ac;
  if (cfg.activation_checkpoint > 0)
    ac = cfg.activation_checkpoint == 1 ? ", activation checkpoint (conv blocks 1, 2)"
                                        : ", activation checkpoint (conv block 1)";
  if (cfg.fsdp)
    return std::string(", fully_shard (reshard_after_forward ") + (cfg.reshard_after_forward ? "true" : "false") +
           (cfg.fsdp_mesh.empty() ? std::string()
                                  : ", HSDP: replicate " + std::to_string(cfg.fsdp_mesh[0]) + " x shard " +
                                        std::to_string(cfg.fsdp_mesh[1])) +
           ")" + ac;
  if (cfg.local_sgd > 0)
    return ", LocalSGD (parameters averaged every " + std::to_string(cfg.local_sgd) + " steps)" + ac;
  if (cfg.diloco > 0)
    return ", DiLoCo (outer Nesterov SGD lr 0.7 every " + std::to_string(cfg.diloco) + " inner steps)" + ac;
  if (cfg.comm_hook == "allreduce") return ac;
  if (cfg.comm_hook != "powersgd") return ", comm_hook " + cfg.comm_hook + ac;
  return ", comm_hook powersgd (rank " + std::to_string(cfg.powersgd_rank) + ", after " +
         std::to_string(cfg.powersgd_start_iter) + " plain steps)" + ac;
}

// --local_sgd / --diloco (dtrain/local_sgd.h): DDP's per-step all-reduce gives way to a meeting of
// the replicas every H optimizer steps. Each rank evaluates its part of the test set with its own
// parameters, which differ from the others' between meetings, but after the last epoch's steps,
// where the replicas average their parameters once more.
struct ReplicaMeetings {
  std::optional<dtrain::LocalSGD> local_sgd;
  std::unique_ptr<torch::optim::SGD> outer;  // DiLoCo's, as its paper and torchft's examples
  std::optional<dtrain::DiLoCo> diloco;
  void step() { local_sgd ? local_sgd->step() : diloco->step(); }
  // After the last step: the replicas' parameters averaged (they differ by the steps since the last
  // meeting), so the job ends with one model, as DDP's does.
  void finish(const Parallel& par) { dtrain::LocalSGD(par.parameters(), 1).sync(); }
};

std::unique_ptr<ReplicaMeetings> replica_meetings(const Config& cfg, Parallel& par, torch::optim::Optimizer& inner) {
  if (cfg.local_sgd == 0 && cfg.diloco == 0) return nullptr;
  auto m = std::make_unique<ReplicaMeetings>();
  if (cfg.local_sgd > 0) {
    m->local_sgd.emplace(par.parameters(), cfg.local_sgd);
  } else {
    m->outer = std::make_unique<torch::optim::SGD>(par.parameters(),
                                                   torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
    m->diloco.emplace(par.parameters(), inner, *m->outer, cfg.diloco);
  }
  return m;
}

// The steps below, in the order run() takes them: setup, data, model, resume, train_epoch,
// end_epoch (statistics and evaluate), report. Each step is a tutorial snippet (doc:begin regions).

// Where this rank trains (setup's result).
struct Place {
  int rank = 0, world = 1;
  bool main_rank = true, cuda = false;
  at::Device device = at::Device(at::kCPU);
};

// The process group, and this rank's device and threads.
Place setup(const Config& cfg) {
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
  return {rank, world, main_rank, cuda, device};
}

struct Datasets {
  std::optional<FashionMNIST> train, test;
};

Datasets load_data(const Config& cfg) {
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
  return {std::move(train), std::move(test)};
}

void prepare_checkpoint_dir(const Config& cfg, const Place& place) {
  if (cfg.checkpoint_dir.empty()) return;
  collectively("preparing --checkpoint_dir", place.main_rank, [&] {
    std::error_code ec;
    std::filesystem::create_directories(cfg.checkpoint_dir, ec);
    DTRAIN_CHECK(!ec && std::filesystem::is_directory(cfg.checkpoint_dir), "--checkpoint_dir ", cfg.checkpoint_dir,
                 ": cannot create the folder: ", ec ? ec.message() : "not a folder");
  });
}

// --comm_hook: DDP's own all-reduce (nothing to register), bf16, or PowerSGD, whose state is returned
// for the final summary.
std::optional<dtrain::PowerSGDState> register_comm_hook(const Config& cfg, DDP& ddp) {
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
  return powersgd;
}

// Adam as the tutorial; SGD (momentum 0.9) has updates linear in the gradient, which makes parameter
// equivalence checks exact up to float rounding (Adam's first steps are ~lr * sign(grad), so rounding
// noise in a near-zero gradient can move a parameter by up to 2 * lr).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& cfg, const std::vector<at::Tensor>& params) {
  if (cfg.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(cfg.lr).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(cfg.lr));
}

// Where training starts: epoch 1 and step 0, or where the newest checkpoint left off.
struct Start {
  int64_t epoch = 1;
  int64_t global_step = 0;
  bool resharded = false;  // resumed from a checkpoint of another world size
  bool resumed = false;    // from a checkpoint: its epoch's running sums go on
};

// Loads the newest good checkpoint of --checkpoint_dir into `state`, if there is one.
Start resume(const Config& cfg, const Place& place, std::optional<dtrain::CheckpointManager>& checkpoints,
             dtrain::TrainingState& state) {
  Start start;
  if (!checkpoints) return start;
  // doc:begin load-checkpoint
  const std::optional<std::string> path = checkpoints->load_latest(state);
  if (!path) return start;
  start.resumed = true;
  start.epoch = state.epoch;
  start.global_step = state.step;
  // Saved by another world size: the sampler continues with the rest of the epoch split over this
  // world (Note [Resharded epoch]), and the epoch's running sums of all saved ranks go to rank 0, so
  // the epoch's statistics still count every step once.
  start.resharded = state.saved_world_size != place.world;
  if (start.resharded) {
    std::map<std::string, double> sums;
    if (place.main_rank)
      for (const auto& values : state.saved_values)
        for (const auto& [key, value] : values) sums[key] += value;
    state.values = sums;
  }
  // doc:end load-checkpoint
  if (place.main_rank) {
    std::printf("resumed from %s: epoch %lld, step %lld of the epoch, %lld steps done (restart %d)%s\n", path->c_str(),
                static_cast<long long>(start.epoch), static_cast<long long>(state.sampler_position / cfg.batch_size),
                static_cast<long long>(start.global_step), dtrain::restart_count(),
                start.resharded ? (", saved by " + std::to_string(state.saved_world_size) +
                                   " rank(s): the rest of the epoch is resharded over " + std::to_string(place.world))
                                      .c_str()
                                : "");
    std::fflush(stdout);
  }
  return start;
}

void print_configuration(const Config& cfg, const Place& place, const Datasets& data, int64_t steps) {
  if (!place.main_rank) return;
  std::printf(
      "train_fashion_mnist: %d rank(s) x %d thread(s), %s, backend %s | %zu training samples, %zu test | "
      "batch %lld per rank (%lld global), %lld steps/epoch | %s lr %g, grad_clip %g, %lld epoch(s), "
      "seed %lld%s\n",
      place.world, at::get_num_threads(), place.cuda ? "cuda:LOCAL_RANK" : "cpu", dtrain::backend().c_str(),
      data.train->size().value(), data.test->size().value(), static_cast<long long>(cfg.batch_size),
      static_cast<long long>(cfg.batch_size * place.world), static_cast<long long>(steps),
      cfg.optimizer == "sgd" ? "SGD(momentum 0.9)"
                             : (cfg.amp ? (place.cuda ? "Adam+amp(fp16)" : "Adam+amp(bf16)") : "Adam"),
      cfg.lr, cfg.grad_clip, static_cast<long long>(cfg.epochs), static_cast<long long>(cfg.seed),
      comm_hook_text(cfg).c_str());
  std::fflush(stdout);
}

// This rank's running sums of one epoch (the checkpoint's `values`).
struct EpochSums {
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  std::chrono::steady_clock::time_point te;  // when the epoch started
};

// What an epoch trains with: built once by run(), borrowed for every epoch.
struct Training {
  const Config& cfg;
  const at::Device device;
  const bool cuda;
  Parallel& par;
  torch::optim::Optimizer& optimizer;
  dtrain::GradScaler& scaler;
  dtrain::DistributedSampler& sampler;
  dtrain::Monitor& monitor;
  train::SampleLog& sample_log;
  dtrain::TrainingState& state;
  std::optional<dtrain::CheckpointManager>& checkpoints;
  const int64_t my_steps;  // --uneven: this rank's batches per epoch
  int64_t global_step;     // optimizer steps so far, over all epochs
  // --local_sgd / --diloco: the replicas meet every H steps instead of all-reducing gradients (null: DDP's).
  std::function<void()> after_optimizer_step;

  // One pass over this rank's shard of the training set; `resumed`: this epoch continues a checkpoint.
  template <typename Loader>
  EpochSums train_epoch(Loader& loader, int64_t epoch, bool resumed);
};

template <typename Loader>
EpochSums Training::train_epoch(Loader& loader, int64_t epoch, bool resumed) {
  const auto te = std::chrono::steady_clock::now();
  double loss_sum = 0;
  int64_t correct = 0, seen = 0, step = 0;
  // This epoch's steps on this rank: fewer in an epoch resharded from another world size.
  const int64_t epoch_steps = (static_cast<int64_t>(sampler.epoch_size()) + cfg.batch_size - 1) / cfg.batch_size;
  if (resumed) {
    // resumed mid-epoch: the loader skips ahead, and the running sums go on
    step = state.sampler_position / cfg.batch_size;
    loss_sum = state.values["loss_sum"];
    correct = static_cast<int64_t>(state.values["correct"]);
    seen = static_cast<int64_t>(state.values["seen"]);
  }
  // doc:begin begin-epoch
  // Resumed on another world size from the end of an epoch: none of it is left to train here.
  const bool nothing_left = epoch_steps == 0;
  if (!nothing_left) monitor.begin_epoch(epoch, cfg.epochs, epoch_steps, step);
  // doc:end begin-epoch
  // doc:begin save-checkpoint
  // This rank's progress through the epoch, as the checkpoint stores it.
  auto save_checkpoint = [&] {
    state.step = global_step;
    state.epoch = epoch;
    state.sampler_position = std::min<int64_t>(step * cfg.batch_size, static_cast<int64_t>(sampler.epoch_size()));
    state.values = {
        {"loss_sum", loss_sum}, {"correct", static_cast<double>(correct)}, {"seen", static_cast<double>(seen)}};
    if (cfg.async_checkpoint)
      checkpoints->save_async(state);  // written by a thread while the next steps train
    else
      checkpoints->save(state);
  };
  // doc:end save-checkpoint
  // doc:begin uneven
  // --uneven: ranks run out of batches at different steps. Inside the Join a rank that has run out
  // shadows the others' gradient all-reduces until all are done (enable(false): no Join at all).
  // (fully_shard is not a joinable: --fsdp takes no --uneven.)
  std::optional<dtrain::Join> join;
  if (par.ddp) join.emplace(std::vector<dtrain::Joinable*>{&*par.ddp}, dtrain::JoinOptions().enable(cfg.uneven > 0));
  // doc:end uneven
  // doc:begin batch-loop
  for (auto& indexed : *loader) {
    if (step >= my_steps) break;  // --uneven
    torch::data::Example<>& batch = indexed.example;
    at::Tensor logits, loss;
    double grad_norm = NAN;  // known with --grad_clip; else the monitor samples it
    // --local_sgd / --diloco: each replica keeps its own gradients (no_sync spans the forward too).
    std::optional<dtrain::NoSyncGuard> local;
    if (after_optimizer_step) local.emplace(par.ddp->no_sync());
    {
      auto phase = monitor.phase(dtrain::Phase::kForward);
      // Autocast's defaults, as PyTorch's: bfloat16 on the CPU, float16 on CUDA.
      dtrain::Autocast autocast(device.type(), cuda ? at::kHalf : at::kBFloat16, /*enabled=*/cfg.amp);
      batch.data = batch.data.to(device);
      batch.target = batch.target.to(device);
      logits = par(batch.data);  // (B, 10)
      loss = torch::nn::functional::cross_entropy(logits, batch.target);
    }
    {
      auto phase = monitor.phase(dtrain::Phase::kBackward);
      optimizer.zero_grad();
      scaler.scale(loss).backward();  // gradients are averaged over the ranks here (but in `local`)
    }
    {
      auto phase = monitor.phase(dtrain::Phase::kOptimizer);
      if (cfg.grad_clip > 0) {
        scaler.unscale_(optimizer);  // clip the true gradients (a no-op without --amp)
        grad_norm = par.clip_grad_norm_(cfg.grad_clip);
      }
      scaler.step(optimizer);  // skipped after an overflow (--amp)
      scaler.update();
      if (after_optimizer_step) after_optimizer_step();  // every H steps the replicas meet
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
    sample_log.write(epoch, global_step, indexed.indices);
    if (checkpoints && cfg.checkpoint_every > 0 && global_step % cfg.checkpoint_every == 0) save_checkpoint();
    if (cfg.step_sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.step_sleep_ms));
  }
  // doc:end batch-loop
  if (join) join->join();  // --uneven: wait for (and shadow) the ranks with batches left
  if (!nothing_left) monitor.end_epoch();
  // The end of every epoch is a checkpoint too (unless the last step just wrote one).
  if (checkpoints && !(cfg.checkpoint_every > 0 && global_step % cfg.checkpoint_every == 0)) save_checkpoint();
  return {loss_sum, correct, seen, te};
}

// The epoch's results over all ranks.
struct EpochResult {
  double train_loss = 0, test_accuracy = 0;
};

// Epoch statistics over all ranks, the test accuracy, and the epoch's line.
EpochResult end_epoch(const Config& cfg, const Place& place, FashionCNN& model, Parallel& par,
                      const std::optional<FashionMNIST>& test, dtrain::Monitor& monitor, int64_t epoch,
                      const EpochSums& sums) {
  const auto [loss_sum, correct, seen, te] = sums;
  const at::Device device = place.device;
  const bool main_rank = place.main_rank;
  double train_loss = 0, test_accuracy = 0;
  // doc:begin epoch-stats
  // Epoch statistics over all ranks (each rank's samples, padded duplicates included, as PyTorch).
  const auto stats = dtrain::all_reduce_values(std::vector<double>{loss_sum, double(correct), double(seen)});
  train_loss = stats[0] / stats[2];
  const double train_accuracy = stats[1] / stats[2];
  const double epoch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - te).count();
  const auto tt = std::chrono::steady_clock::now();
  test_accuracy = evaluate(model, par, *test, cfg.eval_batch_size > 0 ? cfg.eval_batch_size : cfg.batch_size, device);
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
  return {train_loss, test_accuracy};
}

// What PowerSGD did, from its state (not the flags): a run that never left its plain steps compressed
// nothing.
void print_powersgd_summary(dtrain::PowerSGDState& powersgd) {
  const dtrain::PowerSGDOptions& o = powersgd.options();
  const int64_t synced = powersgd.iter();
  const int64_t compressed = std::max<int64_t>(0, synced - o.start_powerSGD_iter());
  const auto stats = powersgd.compression_stats();
  std::printf("PowerSGD: %lld of %lld steps compressed (rank %lld, plain all-reduce for the first %lld)",
              static_cast<long long>(compressed), static_cast<long long>(synced),
              static_cast<long long>(o.matrix_approximation_rank()), static_cast<long long>(o.start_powerSGD_iter()));
  if (compressed > 0)
    std::printf(": %lld -> %lld gradient elements sent per step (%.1fx fewer)",
                static_cast<long long>(stats.numel_before / compressed),
                static_cast<long long>(stats.numel_after / compressed), stats.rate);
  std::printf("\n");
}

// The end of the run: every rank's parameters compared, --dump_params, and rank 0's RESULT line.
void report(const Config& cfg, const Place& place, Parallel& par, std::optional<dtrain::PowerSGDState>& powersgd,
            const EpochResult& last, std::chrono::steady_clock::time_point t0) {
  // doc:begin ranks-agree
  // DDP keeps every rank's parameters identical: check it (each rank's hash, compared on rank 0).
  // fully_shard's whole parameters are gathered from the shards, so they agree unless a shard is lost.
  const auto whole = par.whole_named();
  std::vector<at::Tensor> tensors;
  for (const auto& kv : whole) tensors.push_back(kv.second);
  const std::string bytes = train::parameter_bytes(tensors);
  const std::string sha = train::sha256_hex(bytes);
  const std::vector<std::string> all = dtrain::all_gather_bytes(sha);
  int first_disagreeing = -1;
  for (int r = 0; r < dtrain::world_size() && first_disagreeing < 0; ++r)
    if (all[r] != all[0]) first_disagreeing = r;
  // doc:end ranks-agree
  if (!place.main_rank) return;
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!cfg.dump_params.empty()) train::write_file(cfg.dump_params, bytes);
  // doc:begin save-safetensors
  if (!cfg.save_safetensors.empty())  // what Python's safetensors.torch.load_file reads
    dtrain::save_safetensors(
        whole, cfg.save_safetensors,
        {{"epochs", std::to_string(cfg.epochs)}, {"test_accuracy", std::to_string(last.test_accuracy)}});
  // doc:end save-safetensors
  if (first_disagreeing >= 0)
    std::fprintf(stderr, "train_fashion_mnist: warning: rank %d's final parameters differ from rank 0's\n",
                 first_disagreeing);
  if (powersgd) print_powersgd_summary(*powersgd);
  std::printf("training took %.1f s\n", total_s);
  std::printf("RESULT epochs=%lld test_accuracy=%.4f train_loss=%.4f params_sha256=%s ranks_agree=%d\n",
              static_cast<long long>(cfg.epochs), last.test_accuracy, last.train_loss, sha.c_str(),
              first_disagreeing < 0 ? 1 : 0);
  std::fflush(stdout);
}

// The whole job, top to bottom.
int run(const Config& cfg) {
  const Place place = setup(cfg);
  const at::Device device = place.device;
  Datasets data = load_data(cfg);
  auto& [train, test] = data;
  prepare_checkpoint_dir(cfg, place);

  // doc:begin model
  // Model: the same seed everywhere (DDP broadcasts rank 0's parameters anyway).
  torch::manual_seed(static_cast<uint64_t>(cfg.seed));
  FashionCNN model;
  model->to(device);
  model->checkpoint_every = cfg.activation_checkpoint;
  Parallel par;
  std::optional<dtrain::PowerSGDState> powersgd;
  if (!cfg.fsdp) {
    par.ddp.emplace(model);
    powersgd = register_comm_hook(cfg, *par.ddp);
  } else {
    // doc:begin fsdp
    // --fsdp (dtrain/fsdp.h): the units bottom-up, the root last, as FSDP2's fully_shard. The
    // optimizer is built after, on the shards, and holds state for them only.
    auto options = dtrain::FullyShardOptions().reshard_after_forward(cfg.reshard_after_forward);
    if (!cfg.fsdp_mesh.empty())  // HSDP: shard within groups of S ranks, replicate across R of them
      options.mesh(dtrain::init_device_mesh(cfg.fsdp_mesh, {"replicate", "shard"}));
    dtrain::fully_shard(model->fc1, options);
    par.fsdp.emplace(dtrain::fully_shard(model, options));
    // doc:end fsdp
  }
  const std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(cfg, par.parameters());
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
  const int64_t my_steps =
      place.world > 1 ? steps - static_cast<int64_t>(cfg.uneven * steps * place.rank / (place.world - 1)) : steps;

  // doc:begin resume
  // Fault tolerance (dtrain/checkpoint.h): with --checkpoint_dir every rank resumes from the newest
  // good checkpoint there (after a dtrain-run --max_restarts restart, or a new run), mid-epoch at the
  // sampler's position, with this epoch's running sums, so the run ends bit-identical to one never
  // interrupted (Note [exact resume]).
  dtrain::TrainingState state;
  state.model = model.get();  // the inner model, not the DDP wrapper; a sharded one as it is
  state.optimizer = optimizer.get();
  state.scaler = &scaler;
  state.sampler = &sampler;
  std::optional<dtrain::CheckpointManager> checkpoints;
  if (!cfg.checkpoint_dir.empty()) checkpoints.emplace(cfg.checkpoint_dir);
  const Start start = resume(cfg, place, checkpoints, state);  // epoch 1, step 0 without a checkpoint
  // doc:end resume
  print_configuration(cfg, place, data, steps);

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
  if (par.ddp) monitor.watch(*par.ddp);
  // doc:end monitor

  std::optional<train::SampleLog> sample_log;
  collectively("opening --sample_log", true,
               [&] { sample_log.emplace(cfg.sample_log, place.rank, dtrain::restart_count()); });
  const auto t0 = std::chrono::steady_clock::now();
  const std::unique_ptr<ReplicaMeetings> meetings = replica_meetings(cfg, par, *optimizer);
  std::function<void()> meet;  // null without --local_sgd / --diloco
  if (meetings) meet = [&] { meetings->step(); };
  Training training{cfg,         place.device, place.cuda,  par,      *optimizer,        scaler, sampler, monitor,
                    *sample_log, state,        checkpoints, my_steps, start.global_step, meet};
  EpochResult last;
  for (int64_t epoch = start.epoch; epoch <= cfg.epochs; ++epoch) {
    // doc:begin set-epoch
    sampler.set_epoch(epoch - 1);  // a new shuffle every epoch, the same on every rank
    // doc:end set-epoch
    // Every checkpoint holds its epoch's running sums, even one written where none of the epoch was
    // left (resumed on another world at its end: the sampler's position is 0 there).
    const bool resumed = epoch == start.epoch && start.resumed;
    const EpochSums sums = training.train_epoch(loader, epoch, resumed);
    if (meetings && epoch == cfg.epochs) meetings->finish(par);  // one trained model, evaluated and saved
    last = end_epoch(cfg, place, model, par, test, monitor, epoch, sums);
  }
  // doc:begin monitor-close
  monitor.close();  // every rank: the last metrics window, the merged trace, the plot
  // doc:end monitor-close
  if (checkpoints) checkpoints->wait();  // --async_checkpoint: the last write done, or its error on every rank
  report(cfg, place, par, powersgd, last, t0);
  dtrain::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // doc:begin allocator
  dtrain::reduce_allocator_churn();  // Note [malloc churn] in dtrain/system.h
  // doc:end allocator
  Config cfg;
  if (std::optional<int> exit_code = train::parse_flags(argc, argv, cfg)) return *exit_code;
  try {
    return run(cfg);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "train_fashion_mnist: error: %s\n", one_line(e.what_without_backtrace()).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: error: %s\n", one_line(e.what()).c_str());
  }
  return 1;
}
