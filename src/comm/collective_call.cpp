#include "comm/collective_call.h"

#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain::comm {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:  // Note [AVG on Gloo]: a SUM, divided once the work is done
      return c10d::ReduceOp::SUM;
    case ReduceOp::MIN:
      return c10d::ReduceOp::MIN;
    case ReduceOp::MAX:
      return c10d::ReduceOp::MAX;
    case ReduceOp::PRODUCT:
      return c10d::ReduceOp::PRODUCT;
  }
  DTRAIN_ASSERT(false, "unknown ReduceOp");
  return c10d::ReduceOp::SUM;
}

CollectiveCall::CollectiveCall(const Group& group, const char* op) : g_(resolve(group)), op_(op) {
  DTRAIN_CHECK(g_.rank >= 0, "rank ", world_state().rank, ": ", op, " on group '", g_.name,
               "', which this rank is not a member of: call it only on the group's ranks");
}

std::string CollectiveCall::what() const {
  std::string ranks = "[";
  for (size_t i = 0; i < g_.ranks.size(); ++i) {
    if (g_.ranks.size() > 8 && i == 6) {
      ranks += "..., ";
      i = g_.ranks.size() - 1;
    }
    ranks += std::to_string(g_.ranks[i]) + (i + 1 < g_.ranks.size() ? ", " : "]");
  }
  return detail::cat("rank ", world_state().rank, ": ", op_, " on group '", g_.name, "' (", g_.backend, ", ranks ",
                     ranks, g_.ranks.size() > 8 ? detail::cat(" (", g_.ranks.size(), " ranks)") : "", ", timeout ",
                     g_.timeout.count() / 1000.0, " s)");
}

int CollectiveCall::group_rank(int global, const char* role) const {
  auto it = g_.group_rank_of.find(global);
  DTRAIN_CHECK(it != g_.group_rank_of.end(), op_, ": ", role, "=", global, " is not a member of group '", g_.name,
               "' (", g_.ranks.size(), " ranks): use a global rank that belongs to the group");
  return it->second;
}

CollectiveCall& CollectiveCall::tensor(const at::Tensor& t) {
  DTRAIN_CHECK(t.defined(), op_, ": the tensor is undefined: pass an allocated tensor");
  DTRAIN_CHECK(t.is_contiguous(), op_, ": the tensor (shape ", t.sizes(),
               ") is not contiguous: call .contiguous() first");
  return *this;
}

CollectiveCall& CollectiveCall::list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* name) {
  DTRAIN_CHECK(list.size() == g_.ranks.size(), op_, ": ", name, " has ", list.size(), " tensors but the group has ",
               g_.ranks.size(), " ranks: pass one tensor per rank");
  for (const auto& t : list) {
    tensor(t);
    DTRAIN_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), op_, ": ", name,
                 " holds a tensor of shape ", t.sizes(), " ", t.scalar_type(), ", expected ", like.sizes(), " ",
                 like.scalar_type());
  }
  return *this;
}

CollectiveCall& CollectiveCall::average(ReduceOp op, const at::Tensor& t) {
  if (op != ReduceOp::AVG) return *this;
  DTRAIN_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), op_,
               ": ReduceOp::AVG needs a floating-point tensor, got ", t.scalar_type(),
               ": use SUM and divide, or convert the tensor");
  return *this;
}

// The answer depends only on the arguments every rank passes alike, so every rank refuses and the
// group stays usable (Note [Broken groups] in comm/shm/shm_process_group.cpp for what happens to a
// call that fails later).
CollectiveCall& CollectiveCall::supported(c10d::OpType type, const at::Tensor& t, ReduceOp rop) {
  const std::string why = g_.caps->unsupported(type, t, to_c10d(rop));
  if (!why.empty()) throw Error(what() + " cannot run: " + why);
  return *this;
}

CollectiveCall& CollectiveCall::record(FlightCall call) {
  rec_ = record_call(g_, std::move(call));
  return *this;
}

Work CollectiveCall::wrap(c10::intrusive_ptr<c10d::Work> w, std::function<void()> done,
                          std::function<bool()> parts_done) {
  rec_.started(w);
  Work out(std::move(w), what(), std::move(done), std::move(parts_done));
  attach_flight_record(out, std::move(rec_));
  return out;
}

Work CollectiveCall::finish(Work w, bool async_op) {
  if (!async_op) w.wait();
  return w;
}

Work CollectiveCall::composed(std::function<void()> done, std::function<bool()> parts_done, bool async_op) {
  return finish(wrap(c10::intrusive_ptr<c10d::Work>(), std::move(done), std::move(parts_done)), async_op);
}

bool CollectiveCall::run_inline(c10::function_ref<bool()> here) {
  rec_.started();
  bool ran = false;
  try {
    ran = here();
  } catch (const Error& e) {
    rec_.failed(e.what());
    throw;
  } catch (const std::exception& e) {
    Error err = collective_failure(what(), e);
    rec_.failed(err.what());
    throw err;
  }
  if (ran) rec_.completed();
  return ran;
}

}  // namespace dtrain::comm
