// plot.svg of a run: the panels Monitor::close() draws from rank 0's windows and epochs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/monitor.h"

namespace dtrain::monitor {

// Loss and accuracy (per window, and per epoch where log_epoch gave them), throughput, and the
// step's split as a stacked area; the x axis spans steps 0..steps.
std::string run_plot_svg(const std::vector<WindowMetrics>& windows, const std::vector<EpochMetrics>& epochs,
                         int64_t steps, int ranks);

}  // namespace dtrain::monitor
