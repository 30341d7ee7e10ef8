// bench_pipeline: step time of the tutorial's SimpleModel (Linear 128-256, ReLU, Linear 256-256, ReLU,
// Linear 256-10) split over 2 ranks (1 thread per rank), for chunks 1, 2, 4, 8 and every schedule
// (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank, ZB-H1), each beside its theoretical
// step time and idle fraction. The stages talk over shared memory (point-to-point between ranks of a
// host). `--model deep` runs a 9-layer MLP instead (Linear 128-256, 7 x Linear 256-256, Linear
// 256-10, ReLUs between): SimpleModel's 2+3 split by parameters leaves one stage with twice the
// other's work and a step of ~3 ms, in which a schedule's gain is hard to see; the deep one splits
// into near-equal stages with ~10x the compute. `--width` sets the deep MLP's hidden width (256): at
// 8 chunks a 64-sample micro-batch of a 256-wide layer is too small a GEMM to run at the speed the
// 512-sample batch of the theory's S does, so a wider model shows how close the schedules come to
// theory once per-micro-batch costs are small beside the compute.
// `--model balanced` is the model on which the schedules' effect shows, and the goals are judged on it:
// Linear 128-256, 8 x Linear 256-256, Linear 256-10, batch 1536. The deep MLP misses 1.2x theory at 8
// chunks for reasons no schedule changes: its 7 wide layers split 3 + 4 (stage 1 computes 1.2x stage
// 0), and its 64-sample micro-batches run 1.26x slower than the whole batch in one process (small
// GEMMs; 8x the autograd calls and gradient accumulations). The balanced MLP has 8 wide layers, 4 per
// stage (the 128-256 and 256-10 layers are small beside them), and 192-sample micro-batches at 8
// chunks (the unsplit model as 8 micro-batches ~1.06x its one-batch step). Its batch, 1536, keeps a
// 2-chunk boundary tensor under the shared-memory point-to-point ring (DTRAIN_SHM_SLOT_BYTES, 1 MB),
// where the goals were first measured; a larger message once waited for its sender's next
// point-to-point call (docs/benchmarks.md has what it cost at batch 2048) and no longer does
// (Note [Send pusher]).
//
// Theory, from the unsplit model's step time S in one process, p = 2 ranks, m micro-batches, and the
// stages assumed equal and communication free: GPipe and 1F1B S/p * (m + p - 1) / m; interleaved
// 1F1B with v chunks per rank divides the bubble by v: S/p * (m + (p - 1) / v) / m; ZB-H1, with F, B
// and W of equal cost, 1F1B's * (3m + p - 1) / (3(m + p - 1)), which is (3m + 1) / (3(m + 1)) on 2
// stages. Idle theory = 1 - (S/p) / theoretical step.
//
//   ./build/bin/bench_pipeline [--model simple|deep|balanced] [--width 256] [--batch N] [--steps 40] [--warmup 5]
//                              [--reps 3]
//
// How: this binary is the driver and the worker. The driver starts each 2-rank job itself
// (bench/spawn.h: fork/exec of `bench_pipeline --worker ...` with RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT and OMP_NUM_THREADS=1), one job per (schedule, chunks) and repetition, rotating the order
// each repetition. Each rank times its steps; from the pipeline's own per-step counters it takes the
// time inside its stage's forward/loss/backward ("compute"); idle = 1 - compute / step time, averaged
// over the ranks (an all-reduce), so idle includes the pipeline bubble, the communication and any
// imbalance between the two stages. The driver also times the unsplit model in one process on the
// same batch (1 thread) for scale. Adam steps are included in the step time.
// Last line: RESULT chunks1_ms=.. chunks2_ms=.. chunks4_ms=.. chunks8_ms=.. idle1=.. idle8=.. (1F1B)
// single_ms=.. speedup_vs_single_4=.. vs_theory_4=.. zb_vs_1f1b_2=..: at chunks 4, the unsplit model's
// step time over the fastest schedule's, and that schedule's theoretical step time over its measured
// one (1 = as fast as theory); at chunks 2, ZB-H1's step time over 1F1B's (theory 7/9 = 0.78);
// over_theory2/4/8: 1F1B's measured step time over its theory at chunks 2, 4, 8.
// The theory's S is the batch in one piece, but a pipeline runs it as m micro-batches, each a smaller
// GEMM with its own autograd calls; the driver also times the unsplit model in one process on the same
// m micro-batches (gradients accumulated, one Adam step: single_mb<m>_ms) and gives 1F1B's step over
// the theory from that S as over_mb_theory<m>: what the pipeline adds to the same work (stage imbalance,
// bubble, messages). A table splits 1F1B's step per rank into compute, boundary receives (waiting
// included), boundary sends, Adam and the rest (the end-of-step agreement, where the faster stage waits),
// with the boundary messages per tensor sent (1 once the shapes are agreed).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "dtrain/pipeline.h"
#include "dtrain/process_group.h"
#include "dtrain/system.h"
#include "cli_checks.h"
#include "spawn.h"
#include "tutorial_models.h"

namespace {

using namespace bench;
constexpr int kWorld = 2;
constexpr int kBatches = 4;  // distinct pre-made batches, cycled
constexpr int kVirtual = 2;  // model chunks per rank of the interleaved schedule
constexpr int kParts = 5;    // per rank: compute, recv, send, Adam, rest (worker_main)

struct ScheduleSpec {
  const char* flag;
  dtrain::Schedule schedule;
  int virtual_stages;
};
const std::vector<ScheduleSpec> kSchedules = {{"gpipe", dtrain::Schedule::kGPipe, 1},
                                              {"1f1b", dtrain::Schedule::k1F1B, 1},
                                              {"interleaved", dtrain::Schedule::kInterleaved1F1B, kVirtual},
                                              {"zb", dtrain::Schedule::kZeroBubbleH1, 1}};

const ScheduleSpec& spec_of(const std::string& flag) {
  for (const auto& s : kSchedules)
    if (flag == s.flag) return s;
  throw std::runtime_error("bench_pipeline: unknown schedule " + flag);
}

bool runs(const ScheduleSpec& s, int64_t chunks) {
  return s.schedule != dtrain::Schedule::kInterleaved1F1B || chunks % kWorld == 0;
}

// The theoretical step time (module comment) for `single_ms` in one process.
double theory_ms(const ScheduleSpec& s, int64_t chunks, double single_ms) {
  const double p = kWorld, m = static_cast<double>(chunks), per_rank = single_ms / p;
  switch (s.schedule) {
    case dtrain::Schedule::kInterleaved1F1B:
      return per_rank * (m + (p - 1) / s.virtual_stages) / m;
    case dtrain::Schedule::kZeroBubbleH1:
      return per_rank * (3 * m + p - 1) / (3 * m);
    default:
      return per_rank * (m + p - 1) / m;
  }
}

// The model to split: the tutorial's SimpleModel, or the deep or balanced MLP of the module comment.
// A batch of 0 takes the model's default: 1536 for the balanced MLP (module comment), 512 for the others.
int64_t batch_of(const std::string& model, int64_t batch) {
  return batch > 0 ? batch : model == "balanced" ? 1536 : 512;
}
torch::nn::Sequential make_net(const std::string& model, int64_t width) {
  if (model == "simple") return tutorial::SimpleModel()->net;
  if (model != "deep" && model != "balanced")
    throw std::runtime_error("bench_pipeline: --model must be simple, deep or balanced, got '" + model + "'");
  const int hidden = model == "balanced" ? 8 : 7;  // layers width x width: 8 split 4 + 4 on the 2 stages
  torch::nn::Sequential net(torch::nn::Linear(128, width), torch::nn::ReLU());
  for (int i = 0; i < hidden; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::ReLU());
  }
  net->push_back(torch::nn::Linear(width, 10));
  return net;
}

at::Tensor loss_fn(const at::Tensor& out, const at::Tensor& t) { return torch::nn::functional::cross_entropy(out, t); }

std::vector<std::pair<at::Tensor, at::Tensor>> make_batches(int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (int i = 0; i < kBatches; ++i) out.emplace_back(at::randn({batch, 128}, gen), at::randint(0, 10, {batch}, gen));
  return out;
}

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_pipeline worker"};
  std::string schedule, model = "simple";
  int64_t chunks = 1, batch = 512, width = 256;
  int steps = 40, warmup = 5;
  app.add_option("--schedule", schedule)->required();
  app.add_option("--model", model);
  app.add_option("--width", width);
  app.add_option("--chunks", chunks)->required();
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::reduce_allocator_churn();
    at::set_num_threads(1);
    dtrain::init_process_group();
    torch::manual_seed(0);
    torch::nn::Sequential net = make_net(model, width);
    const ScheduleSpec& spec = spec_of(schedule);
    dtrain::Pipeline pipe(
        net, dtrain::PipelineOptions().chunks(chunks).schedule(spec.schedule).virtual_stages(spec.virtual_stages));
    torch::optim::Adam opt(pipe.parameters(), torch::optim::AdamOptions(1e-3));
    const auto batches = make_batches(batch);
    double step_s = 0, compute_s = 0, recv_s = 0, send_s = 0, adam_s = 0;
    int64_t messages = 0, tensors = 0;
    for (int i = 0; i < warmup + steps; ++i) {
      if (i == warmup) dtrain::barrier();
      const auto& [x, y] = batches[i % kBatches];
      const auto t0 = Clock::now();
      opt.zero_grad();
      pipe.step(x, y, loss_fn);
      const auto t_adam = Clock::now();
      opt.step();
      if (i >= warmup) {
        step_s += secs_since(t0);
        adam_s += secs_since(t_adam);
        const dtrain::PipelineStepStats& st = pipe.last_step_stats();
        compute_s += st.compute_s;
        recv_s += st.recv_s;
        send_s += st.send_s;
        messages += st.boundary_messages;
        tensors += st.boundary_tensors;
      }
    }
    // [step time, idle fraction] averaged over the ranks, then per rank (ms per step): compute, boundary
    // receives, boundary sends, Adam, the rest of the step; last, boundary messages per tensor.
    at::Tensor r = at::zeros({3 + kWorld * kParts}, at::kDouble);
    r[0] = step_s / steps / kWorld;
    r[1] = (1.0 - compute_s / step_s) / kWorld;
    r[2] = static_cast<double>(messages) / static_cast<double>(std::max<int64_t>(tensors, 1)) / kWorld;
    const double per_step = 1e3 / steps;
    const double parts[kParts] = {compute_s, recv_s, send_s, adam_s, step_s - compute_s - recv_s - send_s - adam_s};
    for (int j = 0; j < kParts; ++j) r[3 + dtrain::rank() * kParts + j] = parts[j] * per_step;
    dtrain::all_reduce(r, dtrain::ReduceOp::SUM);
    std::string balance;
    for (int64_t b : pipe.balance()) balance += (balance.empty() ? "" : "+") + std::to_string(b);
    if (dtrain::rank() == 0) {
      std::printf("balance=%s step_ms=%.4f idle=%.4f messages_per_tensor=%.4f", balance.c_str(),
                  r[0].item<double>() * 1e3, r[1].item<double>(), r[2].item<double>());
      for (int k = 0; k < kWorld * kParts; ++k) std::printf(" part%d=%.4f", k, r[3 + k].item<double>());
      std::printf("\n");
    }
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline worker: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// The unsplit model in this process, the same batches: ms per step. With chunks > 1, each batch runs as
// `chunks` micro-batches whose gradients accumulate (each loss weighted by its share of the batch), as the
// pipeline runs them: the same work without the stages, the messages and the bubble.
double single_process_ms(const std::string& model_name, int64_t width, int64_t batch, int steps, int warmup,
                         int64_t chunks = 1) {
  at::set_num_threads(1);
  torch::manual_seed(0);
  torch::nn::Sequential model = make_net(model_name, width);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  const auto batches = make_batches(batch);
  Clock::time_point t0;
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) t0 = Clock::now();
    const auto& [x, y] = batches[i % kBatches];
    opt.zero_grad();
    if (chunks == 1) {
      loss_fn(model->forward(x), y).backward();
    } else {
      const auto xs = x.chunk(chunks), ys = y.chunk(chunks);
      for (size_t j = 0; j < xs.size(); ++j)
        (loss_fn(model->forward(xs[j]), ys[j]) * (static_cast<double>(xs[j].size(0)) / batch)).backward();
    }
    opt.step();
  }
  return secs_since(t0) / steps * 1e3;
}

int driver_main(int argc, char** argv) {
  CLI::App app{"Pipeline step time and idle fraction of every schedule, a model split over 2 ranks"};
  int64_t batch = 0, width = 256;
  int steps = 40, warmup = 5, reps = 3;
  double timeout_s = 300;
  std::string model = "simple";
  app.add_option("--model", model,
                 "simple (the tutorial's SimpleModel), deep (7 hidden layers) or balanced (8 hidden layers, equal "
                 "stages, batch 1536)")
      ->check(CLI::IsMember({"simple", "deep", "balanced"}));
  app.add_option("--width", width, "hidden width of the deep and balanced MLPs")->check(dtrain_cli::positive());
  app.add_option("--batch", batch, "samples per step, split into chunks micro-batches (0: 1536 balanced, else 512)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps, "timed steps per job");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--reps", reps, "repetitions (the median is reported)");
  app.add_option("--timeout", timeout_s, "seconds per job");
  CLI11_PARSE(app, argc, argv);
  batch = batch_of(model, batch);
  dtrain::reduce_allocator_churn();

  const std::vector<int64_t> chunk_list = {1, 2, 4, 8};
  std::map<std::string, std::vector<double>> ms, idle, per_tensor;
  std::map<std::string, std::vector<std::vector<double>>> parts;  // per job, per rep: the workers' part0..
  std::map<std::string, std::string> balance;
  std::vector<double> single;
  std::map<int64_t, std::vector<double>> single_mb;  // the unsplit model in micro-batches, per chunks
  std::printf(
      "bench_pipeline: %s over %d ranks (point-to-point over shared memory), batch %lld, %d timed "
      "steps, %d reps, load %s\n",
      model == "simple" ? "SimpleModel" : ("the " + model + " MLP, hidden width " + std::to_string(width)).c_str(),
      kWorld, static_cast<long long>(batch), steps, reps, load_average().c_str());
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<std::pair<std::string, int64_t>> jobs;
    for (const auto& s : kSchedules)
      for (int64_t c : chunk_list)
        if (runs(s, c)) jobs.emplace_back(s.flag, c);
    std::rotate(jobs.begin(), jobs.begin() + rep % jobs.size(), jobs.end());
    for (const auto& [s, c] : jobs) {
      const std::string out = run_job({self_exe(), "--worker", "--model", model, "--width", std::to_string(width),
                                       "--schedule", s, "--chunks", std::to_string(c), "--batch", std::to_string(batch),
                                       "--steps", std::to_string(steps), "--warmup", std::to_string(warmup)},
                                      kWorld, timeout_s, "bench_pipeline");
      const std::string key = s + "/" + std::to_string(c);
      ms[key].push_back(parse_value(out, "step_ms"));
      idle[key].push_back(parse_value(out, "idle"));
      per_tensor[key].push_back(parse_value(out, "messages_per_tensor"));
      std::vector<double> p;
      for (int k = 0; k < kWorld * kParts; ++k) p.push_back(parse_value(out, "part" + std::to_string(k)));
      parts[key].push_back(p);
      const std::string line = parse_line(out, "balance=");  // "balance=2+3 step_ms=..."
      balance[s] = line.substr(8, line.find(' ') - 8);
    }
    single.push_back(single_process_ms(model, width, batch, steps, warmup));
    for (int64_t c : chunk_list)
      if (c > 1) single_mb[c].push_back(single_process_ms(model, width, batch, steps, warmup, c));
  }
  const double single_ms = median(single);
  std::printf(
      "stages (layers per stage, balanced by parameter count): 1F1B %s, interleaved %s (rank r holds "
      "stages r and r + %d); unsplit model, 1 process: %.3f ms/step\n\n",
      balance["1f1b"].c_str(), balance["interleaved"].c_str(), kWorld, single_ms);
  std::printf(
      "| schedule | chunks | micro-batch | step ms (median) | theory ms | all runs | idle measured | idle theory "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const auto& s : kSchedules)
    for (int64_t c : chunk_list) {
      const std::string name = dtrain::to_string(s.schedule);
      if (!runs(s, c)) {
        std::printf("| %s | %lld | - | needs chunks a multiple of %d | | | | |\n", name.c_str(),
                    static_cast<long long>(c), kWorld);
        continue;
      }
      const std::string key = std::string(s.flag) + "/" + std::to_string(c);
      std::string all;
      for (double v : ms[key]) all += (all.empty() ? "" : " ") + std::to_string(v).substr(0, 6);
      const double theory = theory_ms(s, c, single_ms);
      std::printf("| %s | %lld | %lld | %.3f | %.3f | %s | %.3f | %.3f |\n", name.c_str(), static_cast<long long>(c),
                  static_cast<long long>(batch / c), median(ms[key]), theory, all.c_str(), median(idle[key]),
                  1.0 - single_ms / kWorld / theory);
    }
  auto m = [&](const std::string& s, int64_t c) { return median(ms[s + "/" + std::to_string(c)]); };
  auto i = [&](int64_t c) { return median(idle["1f1b/" + std::to_string(c)]); };
  auto over_theory = [&](int64_t c) { return m("1f1b", c) / theory_ms(spec_of("1f1b"), c, single_ms); };
  const ScheduleSpec* fastest = &kSchedules[0];
  for (const auto& s : kSchedules)
    if (m(s.flag, 4) < m(fastest->flag, 4)) fastest = &s;
  std::printf("\nfastest at chunks 4: %s\n", dtrain::to_string(fastest->schedule).c_str());

  // Where 1F1B's step goes, per rank (medians over the reps of each part, so the parts need not add
  // up exactly to the step's median), beside the unsplit model run in the same micro-batches.
  auto part = [&](const std::string& key, int k) {
    std::vector<double> v;
    for (const auto& rep_parts : parts[key]) v.push_back(rep_parts[k]);
    return median(v);
  };
  auto mb_ms = [&](int64_t c) { return c == 1 ? single_ms : median(single_mb[c]); };
  std::printf(
      "\n1F1B per rank, ms per step: compute (forward, loss, backward), recv (waiting for and copying "
      "boundary tensors), send (posting them), Adam, rest (agreement, bookkeeping); unsplit = the model in one "
      "process in the same micro-batches\n\n");
  std::printf(
      "| chunks | step | rank | compute | recv | send | Adam | rest | unsplit, micro-batched | messages per tensor "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t c : chunk_list) {
    const std::string key = "1f1b/" + std::to_string(c);
    for (int r = 0; r < kWorld; ++r)
      std::printf("| %lld | %.3f | %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", static_cast<long long>(c),
                  median(ms[key]), r, part(key, r * kParts), part(key, r * kParts + 1), part(key, r * kParts + 2),
                  part(key, r * kParts + 3), part(key, r * kParts + 4), mb_ms(c), median(per_tensor[key]));
  }
  // The same ratio with the theory's S measured in micro-batches: what the pipeline adds to the work.
  auto over_mb = [&](int64_t c) { return m("1f1b", c) / theory_ms(spec_of("1f1b"), c, mb_ms(c)); };
  std::printf(
      "\nRESULT chunks1_ms=%.3f chunks2_ms=%.3f chunks4_ms=%.3f chunks8_ms=%.3f idle1=%.3f idle2=%.3f "
      "idle4=%.3f idle8=%.3f single_ms=%.3f speedup_vs_single_4=%.3f vs_theory_4=%.3f zb_vs_1f1b_2=%.3f "
      "over_theory2=%.3f over_theory4=%.3f over_theory8=%.3f single_mb2_ms=%.3f single_mb4_ms=%.3f "
      "single_mb8_ms=%.3f over_mb_theory2=%.3f over_mb_theory4=%.3f over_mb_theory8=%.3f "
      "messages_per_tensor8=%.3f\n",
      m("1f1b", 1), m("1f1b", 2), m("1f1b", 4), m("1f1b", 8), i(1), i(2), i(4), i(8), single_ms,
      single_ms / m(fastest->flag, 4), theory_ms(*fastest, 4, single_ms) / m(fastest->flag, 4),
      m("zb", 2) / m("1f1b", 2), over_theory(2), over_theory(4), over_theory(8), mb_ms(2), mb_ms(4), mb_ms(8),
      over_mb(2), over_mb(4), over_mb(8), median(per_tensor["1f1b/8"]));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_pipeline", argc, argv, worker_main, driver_main); }
