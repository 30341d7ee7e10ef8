// dtrain's training Monitor for the C API: the step clock, the phases a binding times around its own
// forward, backward and optimizer step, the per-window aggregation over the ranks and its files
// (metrics.jsonl, trace.json, plot.svg), and the last step's metrics read back as a plain struct.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "c_api/handles.h"
#include "dtrain/monitor.h"

namespace dtrain::capi {
namespace {

struct MonitorObject : Object {
  std::unique_ptr<Monitor> monitor;
  std::unique_ptr<Monitor::PhaseScope> phase;  // the phase open now
  int phase_kind = -1;
  ~MonitorObject() override { phase.reset(); }  // before the monitor it times
};

std::shared_ptr<MonitorObject> monitor_of(dtrain_c_monitor* monitor) {
  return get_handle<MonitorObject>(monitor, Kind::kMonitor, "monitor");
}

Phase phase_arg(dtrain_c_phase phase) {
  switch (phase) {
    case DTRAIN_C_PHASE_FORWARD:
      return Phase::kForward;
    case DTRAIN_C_PHASE_BACKWARD:
      return Phase::kBackward;
    case DTRAIN_C_PHASE_OPTIMIZER:
      return Phase::kOptimizer;
    case DTRAIN_C_PHASE_MAX_ENUM:
      break;
  }
  throw StatusError(DTRAIN_C_INVALID_ARGUMENT,
                    dtrain::detail::cat("phase is ", static_cast<int>(phase),
                                        ": pass DTRAIN_C_PHASE_FORWARD (0), _BACKWARD (1) or _OPTIMIZER (2)"));
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

dtrain_c_status dtrain_c_monitor_new(const char* output_dir, int64_t log_every, int progress, dtrain_c_group* group,
                                     dtrain_c_monitor** out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the monitor handle");
    require_arg(log_every >= 0,
                dtrain::detail::cat("log_every is ", log_every, ": pass 0 for the default (10), or > 0"));
    require_init();
    MonitorOptions options;
    options.process_group(group_arg(group)).progress(progress != 0);
    if (output_dir) options.output_dir(output_dir);
    if (log_every > 0) options.log_every(log_every);
    auto object = std::make_shared<MonitorObject>();
    object->monitor = std::make_unique<Monitor>(options);
    *out = static_cast<dtrain_c_monitor*>(add_handle(Kind::kMonitor, std::move(object)));
  });
}

dtrain_c_status dtrain_c_monitor_watch_parameters(dtrain_c_monitor* monitor, dtrain_c_tensor* const* params, size_t n,
                                                  const char* const* names) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = monitor_of(monitor);
    require_arg(params && n > 0, dtrain::detail::cat("params is NULL or n is ", n, ": pass the model's parameters"));
    std::vector<at::Tensor> tensors;
    for (size_t i = 0; i < n; ++i)
      tensors.push_back(tensor_arg(params[i], dtrain::detail::cat("params[", i, "]").c_str()));
    object->monitor->watch_parameters(std::move(tensors), names ? param_names(names, n) : std::vector<std::string>{});
  });
}

dtrain_c_status dtrain_c_monitor_begin_step(dtrain_c_monitor* monitor) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] { monitor_of(monitor)->monitor->begin_step(); });
}

dtrain_c_status dtrain_c_monitor_phase_begin(dtrain_c_monitor* monitor, dtrain_c_phase phase) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = monitor_of(monitor);
    const Phase p = phase_arg(phase);
    require_arg(!object->phase, dtrain::detail::cat("phase ", object->phase_kind,
                                                    " is still open: end it with dtrain_c_monitor_phase_end first"));
    object->phase = std::make_unique<Monitor::PhaseScope>(object->monitor->phase(p));
    object->phase_kind = static_cast<int>(phase);
  });
}

dtrain_c_status dtrain_c_monitor_phase_end(dtrain_c_monitor* monitor, dtrain_c_phase phase) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = monitor_of(monitor);
    phase_arg(phase);
    require_arg(object->phase && object->phase_kind == static_cast<int>(phase),
                dtrain::detail::cat("phase ", static_cast<int>(phase), " is not open (open: ", object->phase_kind,
                                    "): begin it with dtrain_c_monitor_phase_begin"));
    object->phase.reset();  // the scope's end records the phase's time
    object->phase_kind = -1;
  });
}

dtrain_c_status dtrain_c_monitor_end_step(dtrain_c_monitor* monitor, double loss, int64_t samples, double lr) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = monitor_of(monitor);
    require_arg(!object->phase,
                dtrain::detail::cat("phase ", object->phase_kind, " is still open: end it before the step"));
    require_arg(samples >= 0,
                dtrain::detail::cat("samples is ", samples, ": pass the samples of the step (0: unknown)"));
    object->monitor->end_step(StepInfo().loss(loss).samples(samples).lr(lr));
  });
}

dtrain_c_status dtrain_c_monitor_last_step(dtrain_c_monitor* monitor, dtrain_c_step_metrics* out) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = monitor_of(monitor);
    require_arg(out, "out is NULL: pass a dtrain_c_step_metrics with struct_size set");
    require_arg(out->struct_size >= sizeof(dtrain_c_step_metrics),
                dtrain::detail::cat("out->struct_size is ", out->struct_size,
                                    ": set it to sizeof(dtrain_c_step_metrics) first"));
    const StepMetrics& m = object->monitor->last_step();
    out->step = m.step;
    out->step_ms = m.step_ms;
    out->forward_ms = m.forward_ms;
    out->backward_ms = m.backward_ms;
    out->optimizer_ms = m.optimizer_ms;
    out->comm_ms = m.comm_ms;
    out->comm_wait_ms = m.comm_wait_ms;
    out->loss = m.loss;
    out->lr = m.lr;
    out->grad_norm = m.grad_norm;
    out->samples = m.samples;
    out->samples_per_s = m.samples_per_s;
    out->rss_mb = m.rss_mb;
  });
}

dtrain_c_status dtrain_c_monitor_close(dtrain_c_monitor* monitor) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { monitor_of(monitor)->monitor->close(); });
}

dtrain_c_status dtrain_c_monitor_free(dtrain_c_monitor* monitor) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] { remove_handle(monitor, Kind::kMonitor, "monitor"); });
}

}  // extern "C"
