// plot.svg of a run (see run_plot.h).
//
// Note [Step split]: per window, from the means over ranks, the step's time is cut into three parts
// that add up to it: communication waited (comm_wait: backward() waiting for the all-reduces after
// autograd finished), communication hidden (the rest of the all-reduce time, which ran behind
// backward's computation) and compute (what remains: forward, backward, optimizer, data). Stacked,
// the top of the area is the step time; a growing red band is communication that overlap did not hide.
#include "monitor/run_plot.h"

#include <algorithm>
#include <cmath>

#include "dtrain/errors.h"

namespace dtrain::monitor {
namespace {

bool any_finite(const PlotSeries& s) {
  return std::any_of(s.y.begin(), s.y.end(), [](double v) { return std::isfinite(v); });
}

// The panel's series that have data (a run without evaluation has no test points; keep the legend
// honest).
PlotPanel panel(std::string title, std::vector<PlotSeries> series, bool stacked = false) {
  PlotPanel p{std::move(title), {}, stacked};
  for (auto& s : series)
    if (any_finite(s) || series.size() == 1) p.series.push_back(std::move(s));
  if (p.series.empty()) p.series.push_back(std::move(series.front()));
  return p;
}

}  // namespace

std::string run_plot_svg(const std::vector<WindowMetrics>& windows, const std::vector<EpochMetrics>& epochs,
                         int64_t steps, int ranks) {
  PlotSeries loss{"train (window)", {}, {}, "#1f77b4"}, acc{"train (window)", {}, {}, "#2ca02c"},
      rate{"samples/s", {}, {}, "#9467bd"};
  PlotSeries compute{"compute", {}, {}, "#17becf"}, hidden{"communication hidden", {}, {}, "#ff7f0e"},
      waited{"communication waited", {}, {}, "#d62728"};
  for (const auto& w : windows) {
    const double x = static_cast<double>(w.step);
    loss.x.push_back(x), loss.y.push_back(w.loss);
    acc.x.push_back(x), acc.y.push_back(w.accuracy);
    rate.x.push_back(x), rate.y.push_back(w.samples_per_s);
    // Note [Step split].
    const double wait = std::max(0.0, w.comm_wait_ms.mean), hid = std::max(0.0, w.comm_ms.mean - wait);
    compute.x.push_back(x), compute.y.push_back(std::max(0.0, w.step_ms.mean - wait - hid));
    hidden.x.push_back(x), hidden.y.push_back(hid);
    waited.x.push_back(x), waited.y.push_back(wait);
  }
  PlotSeries e_loss{"train (epoch)", {}, {}, "#1f77b4", true}, t_loss{"test (epoch)", {}, {}, "#ff7f0e", true},
      e_acc{"train (epoch)", {}, {}, "#2ca02c", true}, t_acc{"test (epoch)", {}, {}, "#d62728", true};
  for (const auto& e : epochs) {
    const double x = static_cast<double>(e.step);
    e_loss.x.push_back(x), e_loss.y.push_back(e.train_loss);
    t_loss.x.push_back(x), t_loss.y.push_back(e.test_loss);
    e_acc.x.push_back(x), e_acc.y.push_back(e.train_accuracy);
    t_acc.x.push_back(x), t_acc.y.push_back(e.test_accuracy);
  }
  std::vector<PlotPanel> panels{
      panel("loss", {loss, e_loss, t_loss}),
      panel("accuracy", {acc, e_acc, t_acc}),
      panel(detail::cat("throughput (samples/s, all ", ranks, " rank(s))"), {rate}),
      panel("step time (ms, mean over ranks)", {compute, hidden, waited}, /*stacked=*/true),
  };
  return svg_plot(panels, detail::cat("training: ", steps, " steps on ", ranks, " rank(s)"), 0.0,
                  static_cast<double>(std::max<int64_t>(steps, 1)));
}

}  // namespace dtrain::monitor
