// Monitoring: where did the time go, which rank is slow — per-step metrics, a progress display, JSON
// lines, a Chrome-trace timeline and an SVG plot, all written by the program itself.
//
//   dtrain::Monitor mon(dtrain::MonitorOptions().output_dir("runs/1").log_every(10));
//   mon.watch(ddp);                                   // per-bucket all-reduce times from DDP's events
//   for (int epoch = 1; epoch <= epochs; ++epoch) {
//     mon.begin_epoch(epoch, epochs, steps_per_epoch);  // progress label and ETA
//     for (auto& batch : loader) {
//       at::Tensor loss;
//       { auto p = mon.phase(dtrain::Phase::kForward);   loss = loss_fn(ddp(batch.data), batch.target); }
//       { auto p = mon.phase(dtrain::Phase::kBackward);  opt.zero_grad(); loss.backward(); }
//       { auto p = mon.phase(dtrain::Phase::kOptimizer); opt.step(); }
//       mon.end_step(dtrain::StepInfo().loss(loss.item<double>()).samples(batch.target.size(0)).lr(lr));
//     }
//   }
//     mon.end_epoch();
//     mon.log_epoch(epoch, dtrain::EpochInfo().train_loss(l).test_accuracy(evaluate(...)));
//   mon.close();                                      // every rank: last aggregation, merged trace, plot
//
// What each rank measures per step (end_step to end_step): step time split into data/other,
// forward, backward, optimizer (the phase scopes) and communication (from DDP's bucket all-reduce work
// handles: comm = time any bucket's all-reduce was in flight; comm_wait = the part backward() spent
// after autograd finished, i.e. communication NOT hidden behind backward), samples/s, loss, accuracy,
// learning rate, gradient norm (when the loop does not pass one: computed from the watched parameters
// on the last step of each window, so it costs one reduction per window, not per step), process RSS
// (and CUDA allocated/reserved in CUDA builds). Window values of loss, accuracy, lr and grad_norm are
// means over the steps that had one.
//
// Every log_every steps all ranks all-gather their window means (one small collective; every rank
// must call end_step equally often, as with DDP anyway) and rank 0 keeps min / mean / max over ranks
// and the slowest rank. Files in output_dir (created; rank 0 unless noted):
//   metrics.jsonl          one JSON object per window (fields: see WindowMetrics / metrics_json)
//   metrics_rank<R>.jsonl  every rank, one line per step (per_rank_metrics)
//   trace.json             Chrome trace / Perfetto timeline of the first trace_steps steps of every rank
//                          (pid = rank; tid 0 compute phases, tid 1 bucket all-reduces), merged at close
//   plot.svg               per window: loss, accuracy, throughput and the step's split (compute /
//                          communication hidden / communication waited); per epoch (log_epoch):
//                          train and test loss and accuracy
//   events.out.tfevents.*  with tensorboard(true): TensorBoard's event files (dtrain/summary_writer.h),
//                          the runs <name>_min / <name>_max beside them (min / max over ranks)
// The timeline is fed from a queue: the training thread appends fixed-size records, a writer thread
// formats them into trace_rank<R>.part (removed after the merge).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

// --- the tutorial's monitor_training() ------------------------------------------------------------

struct DeviceMemory {
  std::string device;     // "cuda:0"
  int64_t allocated = 0;  // bytes held by tensors
  int64_t reserved = 0;   // bytes held by the caching allocator
};
struct MemoryInfo {
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;
  std::vector<DeviceMemory> devices;  // CUDA builds only
};
MemoryInfo memory_info();

// The tutorial's monitor_training() lines: rank / world size / local rank, backend, device and threads,
// memory (process RSS and per-device allocated/reserved). Works before init_process_group too.
std::string training_status();
// Prints training_status() to `out`.
void monitor_training(std::FILE* out = stdout);

// --- progress -------------------------------------------------------------------------------------

using FilePtr = std::FILE*;  // (DTRAIN_ARG's `const T&` must mean FILE* const&)

struct ProgressOptions {
  DTRAIN_ARG(std::string, label, "")        // printed first, e.g. "epoch 2/5"
  DTRAIN_ARG(int64_t, total, 0)             // steps (> 0)
  DTRAIN_ARG(int64_t, samples_per_step, 0)  // global batch, for samples/s
  DTRAIN_ARG(FilePtr, out, stdout)
  // Draw a bar redrawn in place (at most 5 times a second). Default: whether `out` is a terminal, or
  // (out = stdout under dtrain-run, rank 0) whether the launcher's stdout is one; otherwise plain
  // lines, one each time another 1/lines of the total is done.
  DTRAIN_ARG(std::optional<bool>, terminal, std::nullopt)
  DTRAIN_ARG(int, lines, 10)
  // Off: nothing where no bar is drawn, for a program whose own periodic lines are its log.
  DTRAIN_ARG(bool, plain_lines, true)
};

// A progress bar with ETA and throughput; when output is not a terminal, periodic plain lines:
//   epoch 1/5  40% 375/938 loss 0.5123 | 3281 samples/s | elapsed 0:11 ETA 0:17
class Progress {
 public:
  explicit Progress(ProgressOptions options);
  // After step `step` (1-based); loss: the running value to show; samples_done: samples so far for
  // the throughput (< 0: step x samples_per_step).
  void update(int64_t step, double loss, double samples_done = -1);
  // Ends the bar's line (terminal only).
  void finish();

 private:
  std::string status(int64_t step, double loss, double samples_done) const;
  ProgressOptions o_;
  bool tty_;
  bool launcher_ = false;  // stdout is dtrain-run's pipe to a terminal (DTRAIN_PROGRESS_TTY=1)
  bool drawn_ = false;     // a bar line is shown and finish() must end it
  int next_line_ = 1;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// --- plots ----------------------------------------------------------------------------------------

struct PlotSeries {
  std::string title;       // "loss": the panel's title (svg_plot of series) or the legend's name (PlotPanel)
  std::vector<double> x;   // steps
  std::vector<double> y;   // NaN values are skipped
  std::string color = "";  // "#1f77b4"; empty: the next colour of the palette
  bool hollow = false;     // rings and a dashed line: a second kind of point (per epoch) over the first
};
// One frame of the plot: lines with markers, or (stacked) areas piled up in order, e.g. the parts
// of a step's time.
struct PlotPanel {
  std::string title;
  std::vector<PlotSeries> series;
  bool stacked = false;
};
// A standalone SVG document (no script): panels stacked vertically, each with a light grid, tick
// labels on both axes and a legend when it has several series; the x axis spans [x_min, x_max]
// (NaN: the data's range). Points get markers while a series has at most 60, so a single point
// shows. A panel without finite points gets its frame and a "no data" note.
std::string svg_plot(const std::vector<PlotPanel>& panels, const std::string& title, double x_min, double x_max);
// One panel per series, the x axis spanning the data.
std::string svg_plot(const std::vector<PlotSeries>& series, const std::string& title);

// --- metrics --------------------------------------------------------------------------------------

enum class Phase { kForward = 0, kBackward = 1, kOptimizer = 2 };

// What the training loop knows about a step. NaN / 0: not known.
struct StepInfo {
  DTRAIN_ARG(double, loss, std::numeric_limits<double>::quiet_NaN())
  DTRAIN_ARG(int64_t, samples, 0)                                         // samples this rank processed in the step
  DTRAIN_ARG(double, accuracy, std::numeric_limits<double>::quiet_NaN())  // fraction right, this step
  DTRAIN_ARG(double, lr, std::numeric_limits<double>::quiet_NaN())
  DTRAIN_ARG(double, grad_norm, std::numeric_limits<double>::quiet_NaN())  // else computed (watch)
};

// One rank's step (milliseconds; NaN where not known).
struct StepMetrics {
  int64_t step = 0;  // 1-based over the run
  double step_ms = 0, other_ms = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0;
  double comm_ms = 0, comm_wait_ms = 0;
  double loss = 0, accuracy = 0, lr = 0, grad_norm = 0;
  int64_t samples = 0;
  double samples_per_s = 0;
  double rss_mb = 0;
};

// min / mean / max over ranks and the rank with the max.
struct RankStat {
  double min = 0, mean = 0, max = 0;
  int max_rank = 0;
};

// Rank 0's aggregate of one window of log_every steps over all ranks.
struct WindowMetrics {
  int64_t step = 0;   // last step of the window
  int64_t steps = 0;  // steps in the window
  double time_s = 0;  // seconds since the monitor started
  int epoch = 0;
  double loss = 0, accuracy = 0, lr = 0, grad_norm = 0;  // mean over ranks of the window means
  double samples_per_s = 0;  // global: every rank's samples / the slowest rank's window time
  RankStat step_ms, other_ms, forward_ms, backward_ms, optimizer_ms, comm_ms, comm_wait_ms, rss_mb;
  int slowest_rank = 0;  // the rank with the largest compute time (step - comm_wait): the one
                         // the others wait for
};
// What the loop measured over a whole epoch, already over all ranks (e.g. after all_reduce): what
// PyTorch scripts print per epoch. NaN: not measured.
struct EpochInfo {
  DTRAIN_ARG(double, train_loss, std::numeric_limits<double>::quiet_NaN())
  DTRAIN_ARG(double, train_accuracy, std::numeric_limits<double>::quiet_NaN())
  DTRAIN_ARG(double, test_loss, std::numeric_limits<double>::quiet_NaN())
  DTRAIN_ARG(double, test_accuracy, std::numeric_limits<double>::quiet_NaN())
};
// Rank 0's record of one log_epoch call.
struct EpochMetrics {
  int64_t epoch = 0;
  int64_t step = 0;  // the monitor's step count when the epoch was logged (its x in plot.svg)
  double train_loss = 0, train_accuracy = 0, test_loss = 0, test_accuracy = 0;
};

// One JSON object (one line, no newline) of a window; NaN values become null.
std::string metrics_json(const WindowMetrics& w);
std::string metrics_json(const StepMetrics& m, int rank);

struct MonitorOptions {
  // Where metrics.jsonl, trace.json and plot.svg go (created). Empty: no files (progress only).
  DTRAIN_ARG(std::string, output_dir, "")
  // Steps per window: all ranks aggregate (one small all_gather) and rank 0 writes a line.
  DTRAIN_ARG(int64_t, log_every, 10)
  // Every rank also writes metrics_rank<R>.jsonl, one line per step.
  DTRAIN_ARG(bool, per_rank_metrics, false)
  // Steps recorded in the timeline (0: no trace; -1: every step; large traces load slowly).
  DTRAIN_ARG(int64_t, trace_steps, 100)
  DTRAIN_ARG(bool, plot, true)
  // Progress on rank 0 (needs begin_epoch or total_steps for the total).
  DTRAIN_ARG(bool, progress, true)
  DTRAIN_ARG(FilePtr, progress_out, stdout)
  DTRAIN_ARG(std::optional<bool>, progress_terminal, std::nullopt)
  // Steps of the whole run, for progress without begin_epoch (0: unknown).
  DTRAIN_ARG(int64_t, total_steps, 0)
  // The ranks that aggregate together (default: the world). Ignored without a process group.
  DTRAIN_ARG(Group, process_group, Group())
  // Rank 0 also writes TensorBoard event files into output_dir (needs output_dir): per window the
  // means over ranks (train/*, time_ms/*), min and max over ranks of each time (add_scalars
  // "ranks/<time>"), the slowest rank; per log_epoch the epoch's values (epoch/*); histograms of the
  // watched parameters and gradients. Open with `tensorboard --logdir <output_dir>`.
  DTRAIN_ARG(bool, tensorboard, false)
  // Histograms of parameters and gradients in windows 1, 1 + N, 1 + 2N, ... (0: none).
  DTRAIN_ARG(int64_t, histogram_every, 10)
};

class Monitor {
 public:
  // Collective when a process group exists (a barrier aligns the ranks' clocks for the timeline).
  explicit Monitor(MonitorOptions options = MonitorOptions());
  // Flushes this rank's files; does no collective (call close() on every rank for the merged files).
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Sees a DistributedDataParallel's bucket all-reduces and uses its parameters for the gradient norm.
  // The hook outlives neither object's destruction: it holds a reference the monitor clears.
  template <typename DDP>
  void watch(DDP& ddp) {
    ddp.set_event_hook([self = self_](const auto& e) {
      if (Monitor* m = self->load()) m->on_ddp_event(static_cast<int>(e.kind), e.index, e.time_ns);
    });
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (const auto& item : ddp.named_parameters()) params.push_back(item.value()), names.push_back(item.key());
    watch_parameters(std::move(params), std::move(names));
  }
  // The parameters for the gradient norm and the histograms (named by `names`, else by position).
  void watch_parameters(std::vector<at::Tensor> params, std::vector<std::string> names = {});

  // Starts an epoch: resets the progress (label "epoch E/N", total `steps`, `done` of them already
  // done, e.g. after a resume) and the step clock (time between epochs, e.g. evaluation, is not counted).
  void begin_epoch(int64_t epoch, int64_t epochs, int64_t steps, int64_t done = 0);
  // Ends the epoch's progress display (the bar's line on a terminal) before the epoch's summary line.
  void end_epoch();
  // The epoch's results after evaluation. No collective: pass values that are already global
  // (every rank may call it; rank 0 keeps them): the per-epoch points of plot.svg's loss and accuracy
  // panels, and with tensorboard(true) the epoch/* curves at step = epoch. NaN: not known, not logged.
  void log_epoch(int64_t epoch, const EpochInfo& info);
  // Restarts the step clock (optional: a step otherwise starts where the previous one ended).
  void begin_step();

  class PhaseScope {
   public:
    PhaseScope(Monitor* m, Phase p);
    ~PhaseScope();
    PhaseScope(PhaseScope&& o) noexcept : m_(o.m_), p_(o.p_), t0_(o.t0_) { o.m_ = nullptr; }
    PhaseScope(const PhaseScope&) = delete;
    PhaseScope& operator=(const PhaseScope&) = delete;
    PhaseScope& operator=(PhaseScope&&) = delete;

   private:
    Monitor* m_;
    Phase p_;
    int64_t t0_;
  };
  // Times the enclosing block as phase p (forward, backward or optimizer) of the current step.
  [[nodiscard]] PhaseScope phase(Phase p) { return PhaseScope(this, p); }

  // Ends the step: records its metrics, advances the progress, and every log_every steps aggregates.
  void end_step(const StepInfo& info = StepInfo());

  // Every rank: aggregates the last partial window, merges the trace into trace.json and writes
  // plot.svg (rank 0). Idempotent.
  void close();

  int64_t step() const;
  // This rank's last step.
  const StepMetrics& last_step() const;
  // Rank 0: every window so far (empty on other ranks).
  const std::vector<WindowMetrics>& windows() const;
  // Rank 0: every log_epoch so far (empty on other ranks).
  const std::vector<EpochMetrics>& epochs() const;

  struct Impl;

 private:
  void on_ddp_event(int kind, int index, int64_t time_ns);
  void phase_done(Phase p, int64_t t0, int64_t t1);
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<std::atomic<Monitor*>> self_;
};

}  // namespace dtrain
