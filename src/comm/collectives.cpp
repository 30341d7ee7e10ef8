// Collectives over c10d backends with torch.distributed's semantics.
//
// Each call: resolve the group, check that the caller is a member and that src/dst are members,
// translate global ranks to group ranks, start the c10d op, wrap it in a dtrain::Work that names
// the rank and the operation when it fails, and wait unless async_op.
//
// Note [AVG on Gloo]: Gloo has no AVG; we all-reduce a SUM and divide in place once the work is
// done (floating-point tensors only, as an integer average would silently truncate).
// Note [reduce_scatter on Gloo]: Gloo 1.13 has no reduce_scatter; we all-reduce the stacked inputs
// and copy this rank's slice (the same result; more traffic; the shared-memory backend does better).
// Note [Tensor collectives on Gloo]: all_gather_into_tensor and reduce_scatter_tensor are c10d's
// _allgather_base and _reduce_scatter_base on NCCL, and over shared memory on one host. On Gloo they
// are composed (1.13 has neither; 2.15's native ones are off, compat/c10d_compat.h says why):
// all_gather into views of the output's slices (the same traffic), and, as a fallback only, an
// all_reduce of a copy of the input followed by a copy of this rank's slice (n times the traffic
// of a real reduce-scatter; the same values, in the same rank order).
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>

#include "comm/debug_check.h"
#include "comm/capabilities.h"
#include "comm/flight_recorder.h"
#include "comm/state.h"
#include "common/util.h"

namespace dtrain {
namespace {

using comm::FlightCall;
using comm::FlightRecord;
using comm::resolve;

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
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

const detail::GroupImpl& member_group(const Group& group, const char* op) {
  const auto& g = resolve(group);
  DTRAIN_CHECK(g.rank >= 0, "rank ", comm::world_state().rank, ": ", op, " on group '", g.name,
               "', which this rank is not a member of: call it only on the group's ranks");
  return g;
}

int group_rank(const detail::GroupImpl& g, int global, const char* role, const char* op) {
  auto it = g.group_rank_of.find(global);
  DTRAIN_CHECK(it != g.group_rank_of.end(), op, ": ", role, "=", global, " is not a member of group '", g.name, "' (",
               g.ranks.size(), " ranks): use a global rank that belongs to the group");
  return it->second;
}

// "rank 1: all_reduce on group 'default' (gloo, ranks [0, 1], timeout 5 s)": a failure or a timeout
// names the operation, the ranks that had to take part and the timeout (Note [collective timeouts]).
std::string what(const detail::GroupImpl& g, const char* op) {
  std::string ranks = "[";
  for (size_t i = 0; i < g.ranks.size(); ++i) {
    if (g.ranks.size() > 8 && i == 6) {
      ranks += "..., ";
      i = g.ranks.size() - 1;
    }
    ranks += std::to_string(g.ranks[i]) + (i + 1 < g.ranks.size() ? ", " : "]");
  }
  return detail::cat("rank ", comm::world_state().rank, ": ", op, " on group '", g.name, "' (", g.backend, ", ranks ",
                     ranks, g.ranks.size() > 8 ? detail::cat(" (", g.ranks.size(), " ranks)") : "", ", timeout ",
                     g.timeout.count() / 1000.0, " s)");
}

// Note [AVG on Gloo]: the division is in place, which an integer tensor cannot hold.
void check_avg(ReduceOp op, const at::Tensor& t, const char* name) {
  if (op != ReduceOp::AVG) return;
  DTRAIN_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), name,
               ": ReduceOp::AVG needs a floating-point tensor, got ", t.scalar_type(),
               ": use SUM and divide, or convert the tensor");
}

// A call the group's backend cannot run (dtype, reduce op, device) is rejected here, before the
// DETAIL check and before anything is sent: the answer depends only on the arguments every rank
// passes alike, so every rank rejects it and the group stays usable (Note [Broken groups] in
// comm/shm/shm_process_group.cpp for what happens to a call that fails later).
void check_supported(const detail::GroupImpl& g, const char* op, c10d::OpType type, const at::Tensor& t,
                     ReduceOp rop = ReduceOp::SUM) {
  const std::string why = g.caps->unsupported(type, t, to_c10d(rop));
  if (!why.empty()) throw Error(what(g, op) + " cannot run: " + why);
}

// DTRAIN_DEBUG=DETAIL: every member describes its call and the descriptions must agree
// (src/comm/debug_check.h). `parts` are the arguments every rank passes alike.
template <typename... Parts>
void check_call(const detail::GroupImpl& g, const char* op, const Parts&... parts) {
  if (!comm::detail_checks_on()) return;
  std::string desc = op;
  desc += "(";
  bool first = true;
  [[maybe_unused]] auto add = [&](const std::string& p) {  // unused when there are no parts (barrier)
    desc += (first ? "" : ", ") + p;
    first = false;
  };
  (add(parts), ...);
  desc += ")";
  comm::check_same_call(g, desc);
}

std::string list_desc(const std::vector<at::Tensor>& list) {
  return list.empty() ? "[]" : detail::cat(list.size(), " x ", comm::describe(list.front()));
}

Work finish(Work w, bool async_op) {
  if (!async_op) w.wait();
  return w;
}

// Hands the call to the backend (`start` returns its c10d::Work) and wraps it in a Work that
// carries the call's flight record: started once the backend has it, completed or failed by wait().
template <typename Start>
Work launch(FlightRecord rec, Start&& start, std::string what, std::function<void()> done = {},
            std::function<bool()> parts_done = {}) {
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = start();
  } catch (const std::exception& e) {
    rec.failed(brief(e));
    throw;
  }
  rec.started(w);
  Work out(std::move(w), std::move(what), std::move(done), std::move(parts_done));
  comm::attach_flight_record(out, std::move(rec));
  return out;
}

// A call made of others (composed on Gloo): `rec` covers the whole, its parts are not recorded.
Work composed(FlightRecord rec, std::string what, std::function<void()> done, std::function<bool()> parts_done) {
  return launch(
      std::move(rec), [] { return c10::intrusive_ptr<c10d::Work>(); }, std::move(what), std::move(done),
      std::move(parts_done));
}

// Runs parts of a call that finish before it returns under `rec` (the call's own record).
template <typename Run>
void run_recorded(FlightRecord& rec, Run&& run) {
  rec.started();
  try {
    run();
  } catch (const std::exception& e) {
    rec.failed(brief(e));
    throw;
  }
  rec.completed();
}

// A backend's inline all_reduce (Note [Inline blocking collectives]) under `rec`: true and completed
// if it ran; a failure is marked and rethrown as dtrain::Error; false leaves the general path to run.
template <typename Here>
bool run_inline(FlightRecord& rec, const detail::GroupImpl& g, Here&& here) {
  rec.started();
  bool ran = false;
  try {
    ran = here();
  } catch (const Error& e) {
    rec.failed(e.what());
    throw;
  } catch (const std::exception& e) {
    Error err = comm::collective_failure(what(g, "all_reduce"), e);
    rec.failed(err.what());
    throw err;
  }
  if (ran) rec.completed();
  return ran;
}

void check_tensor(const at::Tensor& t, const char* op) {
  DTRAIN_CHECK(t.defined(), op, ": the tensor is undefined: pass an allocated tensor");
  DTRAIN_CHECK(t.is_contiguous(), op, ": the tensor (shape ", t.sizes(),
               ") is not contiguous: call .contiguous() first");
}

void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, size_t n, const char* op,
                const char* name) {
  DTRAIN_CHECK(list.size() == n, op, ": ", name, " has ", list.size(), " tensors but the group has ", n,
               " ranks: pass one tensor per rank");
  for (const auto& t : list) {
    check_tensor(t, op);
    DTRAIN_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), op, ": ", name,
                 " holds a tensor of shape ", t.sizes(), " ", t.scalar_type(), ", expected ", like.sizes(), " ",
                 like.scalar_type());
  }
}

}  // namespace

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
      return "SUM";
    case ReduceOp::AVG:
      return "AVG";
    case ReduceOp::MIN:
      return "MIN";
    case ReduceOp::MAX:
      return "MAX";
    case ReduceOp::PRODUCT:
      return "PRODUCT";
  }
  return "?";
}

Work all_reduce(at::Tensor& tensor, ReduceOp op, const Group& group, bool async_op) {
  const auto& g = member_group(group, "all_reduce");
  check_tensor(tensor, "all_reduce");
  check_avg(op, tensor, "all_reduce");
  check_supported(g, "all_reduce", c10d::OpType::ALLREDUCE, tensor, op);
  check_call(g, "all_reduce", comm::describe(tensor), "op=" + to_string(op));
  FlightRecord rec = comm::record_call(g, FlightCall("all_reduce", "all_reduce").in(tensor).out(tensor));
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.timeout = g.timeout;
  std::function<void()> done;
  if (op == ReduceOp::AVG) {
    int64_t n = static_cast<int64_t>(g.ranks.size());
    done = [tensor, n]() mutable { tensor.div_(n); };
  }
  if (!async_op) {
    // Note [Inline blocking collectives]: no Work at all where the backend runs it here.
    if (run_inline(rec, g, [&] { return g.caps->all_reduce_here(tensor, opts.reduceOp); })) {
      if (done) done();
      return Work();
    }
  }
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->allreduce(ts, opts); }, what(g, "all_reduce"), std::move(done)),
                async_op);
}

void all_reduce_divided(std::vector<at::Tensor>& tensors, int64_t divisor, const Group& group,
                        const at::Tensor& scratch) {
  const auto& g = member_group(group, "all_reduce_divided");
  DTRAIN_CHECK(divisor > 0, "all_reduce_divided: divisor=", divisor,
               " is not positive: pass the number of ranks to average over");
  DTRAIN_CHECK(!tensors.empty(), "all_reduce_divided: no tensors: pass at least one");
  const at::Tensor& like = tensors[0];
  for (const auto& t : tensors) {
    DTRAIN_CHECK(t.defined(), "all_reduce_divided: a tensor is undefined: pass allocated tensors");
    DTRAIN_CHECK(t.is_floating_point() && t.scalar_type() == like.scalar_type() && t.device() == like.device(),
                 "all_reduce_divided: a tensor of ", t.scalar_type(), " on ", t.device(), " beside one of ",
                 like.scalar_type(), " on ", like.device(), ": pass tensors of one floating-point dtype on one device");
  }
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  // Recorded as the all_reduce of the flat tensor it is on every path (the DETAIL check's too).
  FlightRecord rec = comm::record_call(g, FlightCall("all_reduce", "all_reduce").flat(total, like.scalar_type()));
  // DTRAIN_DEBUG=DETAIL compares every rank's call by its flat tensor, which the way below has.
  if (!comm::detail_checks_on() &&
      run_inline(rec, g, [&] { return g.caps->all_reduce_divided_here(tensors, divisor); }))
    return;
  at::NoGradGuard no_grad;
  const bool fits = scratch.defined() && scratch.is_contiguous() && scratch.numel() >= total &&
                    scratch.scalar_type() == like.scalar_type() && scratch.device() == like.device();
  at::Tensor flat = fits ? scratch.view({-1}).narrow(0, 0, total) : at::empty({total}, like.options());
  // A wrapped number, as div_(Scalar) makes it: the bits of dividing by the integer.
  const at::Tensor d = at::native::wrapped_scalar_tensor(at::Scalar(divisor));
  int64_t offset = 0;
  for (const auto& t : tensors) {
    at::Tensor slot = flat.narrow(0, offset, t.numel()).view(t.sizes());
    at::div_out(slot, t, d);
    offset += t.numel();
  }
  run_recorded(rec, [&] {
    comm::FlightPartsScope part;
    all_reduce(flat, ReduceOp::SUM, group);
  });
  offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

Work broadcast(at::Tensor& tensor, int src, const Group& group, bool async_op) {
  const auto& g = member_group(group, "broadcast");
  check_tensor(tensor, "broadcast");
  check_supported(g, "broadcast", c10d::OpType::BROADCAST, tensor);
  check_call(g, "broadcast", comm::describe(tensor), detail::cat("src=", src));
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = group_rank(g, src, "src", "broadcast");
  opts.timeout = g.timeout;
  FlightCall call("broadcast", "broadcast");
  call.in(tensor).out(tensor).root = opts.rootRank;
  FlightRecord rec = comm::record_call(g, std::move(call));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->broadcast(ts, opts); }, what(g, "broadcast")),
                async_op);
}

Work reduce(at::Tensor& tensor, int dst, ReduceOp op, const Group& group, bool async_op) {
  const auto& g = member_group(group, "reduce");
  check_tensor(tensor, "reduce");
  check_avg(op, tensor, "reduce");  // on every rank, though only the destination divides
  check_supported(g, "reduce", c10d::OpType::REDUCE, tensor, op);
  check_call(g, "reduce", comm::describe(tensor), detail::cat("dst=", dst), "op=" + to_string(op));
  std::vector<at::Tensor> ts{tensor};
  c10d::ReduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.rootRank = group_rank(g, dst, "dst", "reduce");
  opts.timeout = g.timeout;
  std::function<void()> done;
  if (op == ReduceOp::AVG && g.rank == opts.rootRank) {
    int64_t n = static_cast<int64_t>(g.ranks.size());
    done = [tensor, n]() mutable { tensor.div_(n); };
  }
  FlightCall call("reduce", "reduce");
  call.in(tensor).out(tensor).root = opts.rootRank;
  FlightRecord rec = comm::record_call(g, std::move(call));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->reduce(ts, opts); }, what(g, "reduce"), std::move(done)),
                async_op);
}

Work all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, const Group& group, bool async_op) {
  const auto& g = member_group(group, "all_gather");
  check_tensor(input, "all_gather");
  check_list(outputs, input, g.ranks.size(), "all_gather", "outputs");
  check_supported(g, "all_gather", c10d::OpType::ALLGATHER, input);
  check_call(g, "all_gather", "outputs=" + list_desc(outputs), "input=" + comm::describe(input));
  std::vector<std::vector<at::Tensor>> out{outputs};
  std::vector<at::Tensor> in{input};
  c10d::AllgatherOptions opts;
  opts.timeout = g.timeout;
  FlightRecord rec = comm::record_call(g, FlightCall("all_gather", "all_gather").in(input).out(outputs));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->allgather(out, in, opts); }, what(g, "all_gather")),
                async_op);
}

Work reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op, const Group& group,
                    bool async_op) {
  const auto& g = member_group(group, "reduce_scatter");
  check_tensor(output, "reduce_scatter");
  check_list(inputs, output, g.ranks.size(), "reduce_scatter", "inputs");
  check_avg(op, output, "reduce_scatter");
  check_supported(g, "reduce_scatter", c10d::OpType::ALLREDUCE, output, op);  // Note [reduce_scatter on Gloo]
  check_call(g, "reduce_scatter", "output=" + comm::describe(output), "inputs=" + list_desc(inputs),
             "op=" + to_string(op));
  FlightRecord rec = comm::record_call(g, FlightCall("reduce_scatter", "reduce_scatter").in(inputs).out(output));
  // Note [reduce_scatter on Gloo].
  at::Tensor stacked = at::stack(inputs);
  Work w = [&] {
    comm::FlightPartsScope part;
    return all_reduce(stacked, op, group, /*async_op=*/true);
  }();
  int me = g.rank;
  return finish(composed(
                    std::move(rec), what(g, "reduce_scatter"),
                    [w, stacked, output, me]() mutable {
                      w.wait();
                      output.copy_(stacked[me]);
                    },
                    [w]() mutable { return w.is_completed(); }),
                async_op);
}

namespace {

// `big` holds group-size times `small`: concatenated along dim 0 ([n*d0, d1, ...]) or stacked
// ([n, d0, d1, ...]), of one dtype and device, as torch.distributed accepts both.
void check_gathered(const at::Tensor& big, const at::Tensor& small, int64_t n, const char* op, const char* big_name,
                    const char* small_name) {
  check_tensor(big, op);
  check_tensor(small, op);
  DTRAIN_CHECK(big.scalar_type() == small.scalar_type() && big.device() == small.device(), op, ": ", big_name, " is ",
               big.scalar_type(), " on ", big.device(), " but ", small_name, " is ", small.scalar_type(), " on ",
               small.device(), ": pass tensors of one dtype on one device");
  DTRAIN_CHECK(big.numel() == n * small.numel(), op, ": ", big_name, " has ", big.numel(),
               " elements, expected world_size (", n, ") x ", small_name, " (", small.numel(),
               ") = ", n * small.numel());
  std::vector<int64_t> stacked{n}, concatenated = small.sizes().vec();
  stacked.insert(stacked.end(), concatenated.begin(), concatenated.end());
  if (!concatenated.empty()) concatenated[0] *= n;
  const bool ok =
      big.sizes() == at::IntArrayRef(stacked) || (small.dim() > 0 && big.sizes() == at::IntArrayRef(concatenated));
  DTRAIN_CHECK(ok, op, ": ", big_name, " has shape ", big.sizes(), ", expected ", at::IntArrayRef(stacked),
               small.dim() > 0 ? detail::cat(" or ", at::IntArrayRef(concatenated)) : std::string(), " for ",
               small_name, " of shape ", small.sizes(), ": concatenate or stack world_size parts along dim 0");
}

}  // namespace

Work all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const Group& group, bool async_op) {
  const char* op = "all_gather_into_tensor";
  const auto& g = member_group(group, op);
  const auto n = static_cast<int64_t>(g.ranks.size());
  check_gathered(output, input, n, op, "output", "input");
  check_supported(g, op, c10d::OpType::ALLGATHER, input);
  check_call(g, op, "output=" + comm::describe(output), "input=" + comm::describe(input));
  c10d::AllgatherOptions opts;
  opts.timeout = g.timeout;
  FlightRecord rec = comm::record_call(g, FlightCall(op, "_all_gather_base").in(input).out(output));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  if (g.caps->takes_base_collective(c10d::OpType::_ALLGATHER_BASE, input, c10d::ReduceOp::SUM)) {
    at::Tensor in = input;
    return finish(launch(
                      std::move(rec), [&] { return g.pg->_allgather_base(output, in, opts); }, what(g, op)),
                  async_op);
  }
  // Note [Tensor collectives on Gloo]: one all_gather into the output's slices.
  std::vector<int64_t> stacked{n};
  for (int64_t d : input.sizes()) stacked.push_back(d);
  std::vector<std::vector<at::Tensor>> out{output.view(stacked).unbind(0)};
  std::vector<at::Tensor> in{input};
  return finish(launch(
                    std::move(rec), [&] { return g.pg->allgather(out, in, opts); }, what(g, op)),
                async_op);
}

Work reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op, const Group& group,
                           bool async_op) {
  const char* name = "reduce_scatter_tensor";
  const auto& g = member_group(group, name);
  const auto n = static_cast<int64_t>(g.ranks.size());
  check_gathered(input, output, n, name, "input", "output");
  check_avg(op, output, name);
  check_supported(g, name, c10d::OpType::ALLREDUCE, input, op);  // Note [Tensor collectives on Gloo]
  check_call(g, name, "output=" + comm::describe(output), "input=" + comm::describe(input), "op=" + to_string(op));
  FlightRecord rec = comm::record_call(g, FlightCall(name, "_reduce_scatter_base").in(input).out(output));
  if (g.caps->takes_base_collective(c10d::OpType::_REDUCE_SCATTER_BASE, input, to_c10d(op))) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(op);
    opts.timeout = g.timeout;
    std::function<void()> done;
    if (op == ReduceOp::AVG) done = [output, n]() mutable { output.div_(n); };  // Note [AVG on Gloo]
    at::Tensor in = input;
    comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
    return finish(launch(
                      std::move(rec), [&] { return g.pg->_reduce_scatter_base(output, in, opts); }, what(g, name),
                      std::move(done)),
                  async_op);
  }
  // Note [Tensor collectives on Gloo]: the fallback, an all_reduce of a copy and this rank's slice.
  at::Tensor whole = input.clone();
  Work w = [&] {
    comm::FlightPartsScope part;
    return all_reduce(whole, op, group, /*async_op=*/true);
  }();
  const int me = g.rank;
  return finish(composed(
                    std::move(rec), what(g, name),
                    [w, whole, output, me, n]() mutable {
                      w.wait();
                      output.copy_(whole.view({n, output.numel()})[me].view_as(output));
                    },
                    [w]() mutable { return w.is_completed(); }),
                async_op);
}

namespace {

// gather's and scatter's list: one tensor per rank on the root (in c10d's nested form), empty
// elsewhere. role, root_name, root: "destination", "dst" and its value (or source/src) for the error.
std::vector<std::vector<at::Tensor>> root_only_list(const detail::GroupImpl& g, int root_in_group,
                                                    std::vector<at::Tensor>& list, const at::Tensor& like,
                                                    const char* op, const char* list_name, const char* role,
                                                    const char* root_name, int root) {
  std::vector<std::vector<at::Tensor>> nested;
  if (g.rank == root_in_group) {
    check_list(list, like, g.ranks.size(), op, list_name);
    nested.push_back(list);
  } else {
    DTRAIN_CHECK(list.empty(), op, ": ", list_name, " must be empty on non-", role, " rank ", comm::world_state().rank,
                 " (", root_name, "=", root, "): pass ", list_name, " only on the ", role, " rank");
  }
  return nested;
}

}  // namespace

Work gather(const at::Tensor& input, std::vector<at::Tensor>& gather_list, int dst, const Group& group, bool async_op) {
  const auto& g = member_group(group, "gather");
  check_tensor(input, "gather");
  check_supported(g, "gather", c10d::OpType::GATHER, input);
  check_call(g, "gather", "input=" + comm::describe(input), detail::cat("dst=", dst));
  c10d::GatherOptions opts;
  opts.rootRank = group_rank(g, dst, "dst", "gather");
  opts.timeout = g.timeout;
  auto out = root_only_list(g, opts.rootRank, gather_list, input, "gather", "gather_list", "destination", "dst", dst);
  std::vector<at::Tensor> in{input};
  FlightCall call("gather", "gather");  // what every rank passes alike: the input
  call.in(input).root = opts.rootRank;
  FlightRecord rec = comm::record_call(g, std::move(call));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->gather(out, in, opts); }, what(g, "gather")),
                async_op);
}

Work scatter(at::Tensor& output, std::vector<at::Tensor>& scatter_list, int src, const Group& group, bool async_op) {
  const auto& g = member_group(group, "scatter");
  check_tensor(output, "scatter");
  check_supported(g, "scatter", c10d::OpType::SCATTER, output);
  check_call(g, "scatter", "output=" + comm::describe(output), detail::cat("src=", src));
  c10d::ScatterOptions opts;
  opts.rootRank = group_rank(g, src, "src", "scatter");
  opts.timeout = g.timeout;
  auto in = root_only_list(g, opts.rootRank, scatter_list, output, "scatter", "scatter_list", "source", "src", src);
  std::vector<at::Tensor> out{output};
  FlightCall call("scatter", "scatter");  // what every rank passes alike: the output
  call.in(output).root = opts.rootRank;
  FlightRecord rec = comm::record_call(g, std::move(call));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->scatter(out, in, opts); }, what(g, "scatter")),
                async_op);
}

Work barrier(const Group& group, bool async_op) {
  const auto& g = member_group(group, "barrier");
  check_call(g, "barrier");
  c10d::BarrierOptions opts;
  opts.timeout = g.timeout;
  FlightRecord rec = comm::record_call(g, FlightCall("barrier", "barrier"));
  comm::BlockingCallScope blocking(!async_op);  // Note [Inline blocking collectives]
  return finish(launch(
                    std::move(rec), [&] { return g.pg->barrier(opts); }, what(g, "barrier")),
                async_op);
}

void monitored_barrier(const Group& group, std::optional<std::chrono::milliseconds> timeout, bool wait_all_ranks) {
  const auto& g = member_group(group, "monitored_barrier");
  DTRAIN_CHECK(g.backend == "gloo", "monitored_barrier needs the gloo backend, the group uses '", g.backend,
               "': create a gloo subgroup for it");
  // No DETAIL check here: monitored_barrier exists to report absent ranks within its own timeout.
  c10d::BarrierOptions opts;
  opts.timeout = util::capped(timeout.value_or(g.timeout));
  FlightRecord rec = comm::record_call(g, FlightCall("monitored_barrier", "barrier"));
  rec.started();
  try {
    g.pg->monitoredBarrier(opts, wait_all_ranks);
    rec.completed();
  } catch (const std::exception& e) {
    std::string msg = e.what();
    auto nl = msg.find("\nException raised from");
    Error err(what(g, "monitored_barrier") + " failed: " + msg.substr(0, nl));
    rec.failed(err.what());
    throw err;
  }
}

namespace {

// send's or recv's record: peer is the group rank of the other end (-1: any source).
FlightCall p2p_call(const char* op, const at::Tensor& t, int peer, int tag) {
  FlightCall c(op, op);
  c.in(t);
  c.peer = peer;
  c.tag = tag;
  (op[0] == 's' ? c.is_send : c.is_recv) = true;
  return c;
}

}  // namespace

void send(const at::Tensor& tensor, int dst, const Group& group, int tag) { isend(tensor, dst, group, tag).wait(); }

int recv(at::Tensor& tensor, int src, const Group& group, int tag) {
  const auto& g = member_group(group, "recv");
  check_tensor(tensor, "recv");
  std::vector<at::Tensor> ts{tensor};
  if (src >= 0) {
    const int from = group_rank(g, src, "src", "recv");
    launch(
        comm::record_call(g, p2p_call("recv", tensor, from, tag)), [&] { return g.pg->recv(ts, from, tag); },
        what(g, "recv"))
        .wait();
    return src;
  }
  c10::intrusive_ptr<c10d::Work> work;
  launch(
      comm::record_call(g, p2p_call("recv", tensor, -1, tag)), [&] { return work = g.pg->recvAnysource(ts, tag); },
      what(g, "recv"))
      .wait();
  return g.ranks.at(work->sourceRank());
}

Work isend(const at::Tensor& tensor, int dst, const Group& group, int tag) {
  const auto& g = member_group(group, "send");
  check_tensor(tensor, "send");
  std::vector<at::Tensor> ts{tensor};
  const int to = group_rank(g, dst, "dst", "send");
  return launch(
      comm::record_call(g, p2p_call("send", tensor, to, tag)), [&] { return g.pg->send(ts, to, tag); },
      what(g, "send"));
}

Work irecv(at::Tensor& tensor, int src, const Group& group, int tag) {
  const auto& g = member_group(group, "recv");
  check_tensor(tensor, "recv");
  DTRAIN_CHECK(src >= 0, "irecv: src must be a rank (>= 0), got ", src, ": use recv() for any source");
  std::vector<at::Tensor> ts{tensor};
  const int from = group_rank(g, src, "src", "recv");
  return launch(
      comm::record_call(g, p2p_call("recv", tensor, from, tag)), [&] { return g.pg->recv(ts, from, tag); },
      what(g, "recv"));
}

}  // namespace dtrain
