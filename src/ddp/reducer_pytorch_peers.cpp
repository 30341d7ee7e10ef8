// The reducer's steps that only a job with PyTorch peers takes: Python DDP's local used map, its
// static_graph first backward and the gradient-ready order its bucket rebuild needs
// (Note [DDP with PyTorch peers] in src/ddp/pytorch_peers.h). Called with the reducer's mutex held.
#include <ATen/ATen.h>

#include "ddp/reducer.h"

namespace dtrain::ddp {

// Python marks a parameter locally used on every hook with a defined gradient (no_sync backwards
// too, so a gradient accumulated there is reduced at the next synchronized backward); in
// static_graph's first backward it only counts the hooks and reduces everything at the end.
bool Reducer::python_before_hook(int index) {
  if ((dynamic_graph_find_unused() || static_graph_first_iteration()) && params_[index].grad().defined())
    local_used_.data_ptr<int32_t>()[index] = 1;
  if (!static_graph_first_iteration() || !armed_) return false;
  if (!started_) begin_backward();
  ++hook_counts_[index];
  return true;
}

bool Reducer::python_counted_down(int index) {
  DTRAIN_CHECK(hooks_left_[index] > 0, "rank ", dtrain::rank(), ": DistributedDataParallel(static_graph): parameter '",
               names_[index],
               "' got a gradient it did not get in the first iteration: the graph changed, which static_graph "
               "forbids: drop static_graph or use the same parameters every iteration");
  return --hooks_left_[index] == 0;
}

// Python's delay_all_reduce: the used map's all-reduce first, then every bucket in order.
void Reducer::python_launch_delayed() {
  local_used_dev_.copy_(local_used_);
  used_work_ = all_reduce(local_used_dev_, ReduceOp::SUM, group_, /*async_op=*/true);
  used_in_flight_ = true;
  static_unused_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (hook_counts_[i] == 0) static_unused_.push_back(static_cast<int>(i));
    fill_slot(static_cast<int>(i));
    mark_ready(static_cast<int>(i));
  }
}

// Which parameters some rank used: dynamic find_unused_parameters reduces the map after the last
// bucket, every backward; static_graph keeps its first backward's global map.
std::vector<int64_t> Reducer::python_used_anywhere() {
  if (!track_unused_) return {};
  if (dynamic_graph_find_unused()) {
    local_used_dev_.copy_(local_used_);
    all_reduce(local_used_dev_, ReduceOp::SUM, group_);
    local_used_.zero_();
  } else if (used_in_flight_) {
    used_work_.wait();
    used_in_flight_ = false;
  }
  std::vector<int64_t> out(params_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = local_used_dev_.data_ptr<int32_t>()[i] > 0 ? 1 : 0;
  return out;
}

void Reducer::python_shadow_backward(bool find_unused_parameters) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<at::Tensor> zeros;
  std::vector<Work> works;
  for (const auto& b : buckets_) {
    zeros.push_back(at::zeros_like(b.buffer));
    works.push_back(all_reduce(zeros.back(), ReduceOp::SUM, group_, /*async_op=*/true));
  }
  for (auto& w : works) w.wait();
  // Python sends the map as last all-reduced, and sums into it in place: a joined rank goes on
  // offering the parameters of its last backward as used (and ever more so).
  if (find_unused_parameters) all_reduce(local_used_dev_, ReduceOp::SUM, group_);
}

void Reducer::python_offer_registration_order() {
  std::lock_guard<std::mutex> g(mu_);
  if (!record_order_ || !order_.empty()) return;
  for (size_t i = 0; i < params_.size(); ++i) order_.push_back(static_cast<int>(i));
}

std::vector<int> Reducer::ready_order() const {
  if (!record_order_ || order_.size() != params_.size()) return {};
  return order_;
}

}  // namespace dtrain::ddp
