// JSON-lines records of the monitor (nlohmann::json; NaN becomes null).
#include <cmath>

#include <nlohmann/json.hpp>

#include "dtrain/monitor.h"

namespace dtrain {
namespace {

nlohmann::json value(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

nlohmann::json stat(const RankStat& s) {
  return {{"min", value(s.min)}, {"mean", value(s.mean)}, {"max", value(s.max)}, {"max_rank", s.max_rank}};
}

}  // namespace

std::string metrics_json(const WindowMetrics& w) {
  nlohmann::json j;
  j["step"] = w.step;
  j["steps"] = w.steps;
  j["time_s"] = value(w.time_s);
  j["epoch"] = w.epoch;
  j["loss"] = value(w.loss);
  j["accuracy"] = value(w.accuracy);
  j["lr"] = value(w.lr);
  j["grad_norm"] = value(w.grad_norm);
  j["samples_per_s"] = value(w.samples_per_s);
  j["step_ms"] = stat(w.step_ms);
  j["other_ms"] = stat(w.other_ms);
  j["forward_ms"] = stat(w.forward_ms);
  j["backward_ms"] = stat(w.backward_ms);
  j["optimizer_ms"] = stat(w.optimizer_ms);
  j["comm_ms"] = stat(w.comm_ms);
  j["comm_wait_ms"] = stat(w.comm_wait_ms);
  j["rss_mb"] = stat(w.rss_mb);
  j["slowest_rank"] = w.slowest_rank;
  return j.dump();
}

std::string metrics_json(const StepMetrics& m, int rank) {
  nlohmann::json j;
  j["rank"] = rank;
  j["step"] = m.step;
  j["step_ms"] = value(m.step_ms);
  j["other_ms"] = value(m.other_ms);
  j["forward_ms"] = value(m.forward_ms);
  j["backward_ms"] = value(m.backward_ms);
  j["optimizer_ms"] = value(m.optimizer_ms);
  j["comm_ms"] = value(m.comm_ms);
  j["comm_wait_ms"] = value(m.comm_wait_ms);
  j["loss"] = value(m.loss);
  j["accuracy"] = value(m.accuracy);
  j["lr"] = value(m.lr);
  j["grad_norm"] = value(m.grad_norm);
  j["samples"] = m.samples;
  j["samples_per_s"] = value(m.samples_per_s);
  j["rss_mb"] = value(m.rss_mb);
  return j.dump();
}

}  // namespace dtrain
