// Collectives over c10d backends with torch.distributed's semantics.
//
// Each front end is one comm::CollectiveCall (comm/collective_call.h): the caller a member, its
// tensors usable, the backend able, every rank's call the same (DETAIL), the flight record, then
// the c10d op wrapped in a dtrain::Work that names the rank and the operation when it fails, waited
// for unless async_op. What differs per collective is here: its options, its composition on Gloo.
//
// Note [AVG on Gloo]: Gloo has no AVG; we all-reduce a SUM and divide in place once the work is
// done (floating-point tensors only, as an integer average would silently truncate).
// Note [reduce_scatter on Gloo]: Gloo 1.13 has no reduce_scatter; we all-reduce the stacked inputs
// and copy this rank's slice (the same result; more traffic; the shared-memory backend does better).
// Note [Tensor collectives on Gloo]: all_gather_into_tensor and reduce_scatter_tensor are c10d's
// _allgather_base and _reduce_scatter_base on NCCL, and over shared memory on one host. On Gloo they
// are composed (1.13 has neither; 2.15's native ones are off, compat/c10d_compat.h says why):
// a broadcast from each rank into its slice of the output (the same bytes received; c10d's Gloo
// all_gather into the slices would gather into a whole output of its own first, allocated on the
// transport's thread, and copy it out: one more output-sized buffer at fully_shard's peak RSS; kept
// where Python ranks share the job, whose all_gather_into_tensor on Gloo runs that all_gather), and,
// as a fallback only, an
// all_reduce of a copy of the input followed by a copy of this rank's slice (n times the traffic
// of a real reduce-scatter; the same values, in the same rank order).
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>

#include "comm/collective_call.h"
#include "comm/scratch_collectives.h"
#include "comm/state.h"
#include "common/util.h"

namespace dtrain {
namespace {

using comm::CollectiveCall;
using comm::FlightCall;
using comm::to_c10d;

std::string list_desc(const std::vector<at::Tensor>& list) {
  return list.empty() ? "[]" : detail::cat(list.size(), " x ", comm::describe(list.front()));
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
  CollectiveCall call(group, "all_reduce");
  call.tensor(tensor).average(op, tensor).supported(c10d::OpType::ALLREDUCE, tensor, op);
  // Described only when DETAIL compares calls: formatting the description (an ostringstream) cost
  // more than a 4 KB all_reduce over shared memory moves.
  if (comm::detail_checks_on()) call.same_call(comm::describe(tensor), "op=" + to_string(op));
  call.record(FlightCall("all_reduce", "all_reduce").in_out(tensor));
  const auto& g = call.group();
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
    if (call.run_inline([&] { return g.caps->all_reduce_here(tensor, opts.reduceOp); })) {
      if (done) done();
      return Work();
    }
  }
  std::vector<at::Tensor> ts{tensor};
  return call.launch([&] { return g.pg->allreduce(ts, opts); }, async_op, std::move(done));
}

void all_reduce_divided(std::vector<at::Tensor>& tensors, int64_t divisor, const Group& group,
                        const at::Tensor& scratch) {
  CollectiveCall call(group, "all_reduce_divided");
  const auto& g = call.group();
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
  call.record(FlightCall("all_reduce", "all_reduce").flat(total, like.scalar_type()));
  // DTRAIN_DEBUG=DETAIL compares every rank's call by its flat tensor, which the way below has.
  if (!comm::detail_checks_on() && call.run_inline([&] { return g.caps->all_reduce_divided_here(tensors, divisor); }))
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
  call.run_parts([&] {
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
  CollectiveCall call(group, "broadcast");
  call.tensor(tensor).supported(c10d::OpType::BROADCAST, tensor);
  call.same_call(comm::describe(tensor), detail::cat("src=", src));
  const auto& g = call.group();
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = call.group_rank(src, "src");
  opts.timeout = g.timeout;
  FlightCall record("broadcast", "broadcast");
  record.in(tensor).out(tensor).root = opts.rootRank;
  call.record(std::move(record));
  return call.launch([&] { return g.pg->broadcast(ts, opts); }, async_op);
}

Work reduce(at::Tensor& tensor, int dst, ReduceOp op, const Group& group, bool async_op) {
  CollectiveCall call(group, "reduce");
  // AVG checked on every rank, though only the destination divides.
  call.tensor(tensor).average(op, tensor).supported(c10d::OpType::REDUCE, tensor, op);
  call.same_call(comm::describe(tensor), detail::cat("dst=", dst), "op=" + to_string(op));
  const auto& g = call.group();
  std::vector<at::Tensor> ts{tensor};
  c10d::ReduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.rootRank = call.group_rank(dst, "dst");
  opts.timeout = g.timeout;
  std::function<void()> done;
  if (op == ReduceOp::AVG && g.rank == opts.rootRank) {
    int64_t n = static_cast<int64_t>(g.ranks.size());
    done = [tensor, n]() mutable { tensor.div_(n); };
  }
  FlightCall record("reduce", "reduce");
  record.in(tensor).out(tensor).root = opts.rootRank;
  call.record(std::move(record));
  return call.launch([&] { return g.pg->reduce(ts, opts); }, async_op, std::move(done));
}

Work all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, const Group& group, bool async_op) {
  CollectiveCall call(group, "all_gather");
  call.tensor(input).list(outputs, input, "outputs").supported(c10d::OpType::ALLGATHER, input);
  call.same_call("outputs=" + list_desc(outputs), "input=" + comm::describe(input));
  call.record(FlightCall("all_gather", "all_gather").in(input).out(outputs));
  std::vector<std::vector<at::Tensor>> out{outputs};
  std::vector<at::Tensor> in{input};
  c10d::AllgatherOptions opts;
  opts.timeout = call.group().timeout;
  return call.launch([&] { return call.group().pg->allgather(out, in, opts); }, async_op);
}

Work reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op, const Group& group,
                    bool async_op) {
  CollectiveCall call(group, "reduce_scatter");
  call.tensor(output).list(inputs, output, "inputs").average(op, output);
  call.supported(c10d::OpType::ALLREDUCE, output, op);  // Note [reduce_scatter on Gloo]
  call.same_call("output=" + comm::describe(output), "inputs=" + list_desc(inputs), "op=" + to_string(op));
  call.record(FlightCall("reduce_scatter", "reduce_scatter").in(inputs).out(output));
  // Note [reduce_scatter on Gloo].
  at::Tensor stacked = at::stack(inputs);
  Work w = [&] {
    comm::FlightPartsScope part;
    return all_reduce(stacked, op, group, /*async_op=*/true);
  }();
  int me = call.group().rank;
  return call.composed(
      [w, stacked, output, me]() mutable {
        w.wait();
        output.copy_(stacked[me]);
      },
      [w]() mutable { return w.is_completed(); }, async_op);
}

namespace {

// `big` holds group-size times `small`: concatenated along dim 0 ([n*d0, d1, ...]) or stacked
// ([n, d0, d1, ...]), of one dtype and device, as torch.distributed accepts both.
void check_gathered(CollectiveCall& call, const at::Tensor& big, const at::Tensor& small, int64_t n,
                    const char* big_name, const char* small_name) {
  const char* op = call.op();
  call.tensor(big).tensor(small);
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
  CollectiveCall call(group, "all_gather_into_tensor");
  const auto& g = call.group();
  const auto n = static_cast<int64_t>(g.ranks.size());
  check_gathered(call, output, input, n, "output", "input");
  call.supported(c10d::OpType::ALLGATHER, input);
  call.same_call("output=" + comm::describe(output), "input=" + comm::describe(input));
  call.record(FlightCall("all_gather_into_tensor", "_all_gather_base").in(input).out(output));
  c10d::AllgatherOptions opts;
  opts.timeout = g.timeout;
  if (g.caps->takes_base_collective(c10d::OpType::_ALLGATHER_BASE, input, c10d::ReduceOp::SUM)) {
    at::Tensor in = input;
    return call.launch([&] { return g.pg->_allgather_base(output, in, opts); }, async_op);
  }
  // Note [Tensor collectives on Gloo]: a broadcast from each rank into its slice of the output;
  // with Python ranks in the job, Gloo's all_gather, which their all_gather_into_tensor runs.
  std::vector<int64_t> stacked{n};
  for (int64_t d : input.sizes()) stacked.push_back(d);
  std::vector<at::Tensor> slices = output.view(stacked).unbind(0);
  if (comm::world_state().pytorch_peers) {
    std::vector<std::vector<at::Tensor>> out{slices};
    std::vector<at::Tensor> in{input};
    return call.launch([&] { return g.pg->allgather(out, in, opts); }, async_op);
  }
  slices[static_cast<size_t>(g.rank)].copy_(input);  // a no-op where the input is that slice already
  std::vector<Work> works;
  {
    comm::FlightPartsScope part;
    for (size_t r = 0; r < slices.size(); ++r) works.push_back(broadcast(slices[r], group.ranks()[r], group, true));
  }
  return call.composed(
      [works]() mutable {
        for (Work& w : works) w.wait();
      },
      [works]() mutable {
        for (Work& w : works)
          if (!w.is_completed()) return false;
        return true;
      },
      async_op);
}

namespace {

// reduce_scatter_tensor; `scratch`: the caller drops `input` afterwards, so the fallback on Gloo
// all-reduces it in place instead of a copy (a whole unit's gradients under fully_shard: the copy
// was one more buffer of n parts at the peak, and fresh pages each step).
Work reduce_scatter_tensor_impl(at::Tensor& output, const at::Tensor& input, ReduceOp op, const Group& group,
                                bool async_op, bool scratch) {
  CollectiveCall call(group, "reduce_scatter_tensor");
  const auto& g = call.group();
  const auto n = static_cast<int64_t>(g.ranks.size());
  check_gathered(call, input, output, n, "input", "output");
  call.average(op, output);
  call.supported(c10d::OpType::ALLREDUCE, input, op);  // Note [Tensor collectives on Gloo]
  call.same_call("output=" + comm::describe(output), "input=" + comm::describe(input), "op=" + to_string(op));
  call.record(FlightCall("reduce_scatter_tensor", "_reduce_scatter_base").in(input).out(output));
  if (g.caps->takes_base_collective(c10d::OpType::_REDUCE_SCATTER_BASE, input, to_c10d(op))) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(op);
    opts.timeout = g.timeout;
    std::function<void()> done;
    if (op == ReduceOp::AVG) done = [output, n]() mutable { output.div_(n); };  // Note [AVG on Gloo]
    at::Tensor in = input;
    return call.launch([&] { return g.pg->_reduce_scatter_base(output, in, opts); }, async_op, std::move(done));
  }
  // Note [Tensor collectives on Gloo]: the fallback, an all_reduce of a copy and this rank's slice.
  at::Tensor whole = scratch ? input : input.clone();
  Work w = [&] {
    comm::FlightPartsScope part;
    return all_reduce(whole, op, group, /*async_op=*/true);
  }();
  const int me = g.rank;
  return call.composed(
      [w, whole, output, me, n]() mutable {
        w.wait();
        output.copy_(whole.view({n, output.numel()})[me].view_as(output));
      },
      [w]() mutable { return w.is_completed(); }, async_op);
}

}  // namespace

Work reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op, const Group& group,
                           bool async_op) {
  return reduce_scatter_tensor_impl(output, input, op, group, async_op, /*scratch=*/false);
}

Work comm::reduce_scatter_tensor_of_scratch(at::Tensor& output, at::Tensor& input, ReduceOp op, const Group& group,
                                            bool async_op) {
  return reduce_scatter_tensor_impl(output, input, op, group, async_op, /*scratch=*/true);
}

namespace {

// The rows of `t` (along dim 0) that each of n ranks gets: `given` checked (n sizes, none negative,
// summing to t.size(0)), or equal parts when it is empty (dim 0 divisible by n), as torch.distributed.
std::vector<int64_t> exchange_splits(const char* op, const char* splits_name, const char* tensor_name,
                                     std::vector<int64_t> given, const at::Tensor& t, int64_t n) {
  const int64_t rows = t.size(0);
  if (given.empty()) {
    DTRAIN_CHECK(rows % n == 0, op, ": ", tensor_name, " has ", rows, " rows along dim 0, which do not divide by the ",
                 n, " ranks: pass ", splits_name, " (one size per rank, summing to ", rows, ")");
    return std::vector<int64_t>(static_cast<size_t>(n), rows / n);
  }
  const at::IntArrayRef sizes(given);
  DTRAIN_CHECK(static_cast<int64_t>(given.size()) == n, op, ": ", splits_name, " ", sizes, " has ", given.size(),
               " sizes but the group has ", n, " ranks: pass one size per rank");
  int64_t sum = 0;
  for (int64_t v : given) {
    DTRAIN_CHECK(v >= 0, op, ": ", splits_name, " ", sizes, " holds the negative size ", v,
                 ": pass row counts of 0 or more");
    sum += v;
  }
  DTRAIN_CHECK(sum == rows, op, ": ", splits_name, " ", sizes, " sums to ", sum, " but ", tensor_name, " has ", rows,
               " rows along dim 0: make the sizes add up to it");
  return given;
}

// all_to_all_single's tensors: usable, of one dtype and device, at least one dimension, the same
// sizes past dim 0 (a row is the unit the split sizes count).
void check_exchanged(CollectiveCall& call, const at::Tensor& output, const at::Tensor& input) {
  const char* op = call.op();
  call.tensor(output).tensor(input);
  DTRAIN_CHECK(output.scalar_type() == input.scalar_type() && output.device() == input.device(), op, ": output is ",
               output.scalar_type(), " on ", output.device(), " but input is ", input.scalar_type(), " on ",
               input.device(), ": pass tensors of one dtype on one device");
  DTRAIN_CHECK(output.dim() >= 1 && input.dim() >= 1, op, ": output has shape ", output.sizes(), " and input ",
               input.sizes(), ": both need a dim 0 to split (reshape a scalar to [1])");
  DTRAIN_CHECK(output.sizes().slice(1) == input.sizes().slice(1), op, ": output has shape ", output.sizes(),
               " but input ", input.sizes(), ": they may differ in dim 0 only");
}

}  // namespace

Work all_to_all_single(at::Tensor& output, const at::Tensor& input, std::vector<int64_t> output_split_sizes,
                       std::vector<int64_t> input_split_sizes, const Group& group, bool async_op) {
  CollectiveCall call(group, "all_to_all_single");
  const auto& g = call.group();
  const auto n = static_cast<int64_t>(g.ranks.size());
  check_exchanged(call, output, input);
  std::vector<int64_t> os =
      exchange_splits(call.op(), "output_split_sizes", "output", std::move(output_split_sizes), output, n);
  std::vector<int64_t> is =
      exchange_splits(call.op(), "input_split_sizes", "input", std::move(input_split_sizes), input, n);
  call.supported(c10d::OpType::ALLTOALL_BASE, input);
  // The ranks pass different row counts by design: what they pass alike is the dtype and the row.
  call.same_call(detail::cat("dtype=", input.scalar_type()), detail::cat("row=", input.sizes().slice(1)));
  call.record(FlightCall("all_to_all_single", "all_to_all").in(input).out(output));
  c10d::AllToAllOptions opts;
  opts.timeout = g.timeout;
  at::Tensor in = input;
  return call.launch([&] { return g.pg->alltoall_base(output, in, os, is, opts); }, async_op);
}

Work all_to_all(std::vector<at::Tensor>& output_tensor_list, const std::vector<at::Tensor>& input_tensor_list,
                const Group& group, bool async_op) {
  CollectiveCall call(group, "all_to_all");
  const auto& g = call.group();
  const size_t n = g.ranks.size();
  for (const bool inputs : {true, false}) {
    const size_t size = inputs ? input_tensor_list.size() : output_tensor_list.size();
    DTRAIN_CHECK(size == n, "all_to_all: ", inputs ? "input_tensor_list" : "output_tensor_list", " has ", size,
                 " tensors but the group has ", n, " ranks: pass one tensor per rank");
  }
  const at::Tensor& like = input_tensor_list[0];
  std::vector<int64_t> os, is;
  for (size_t i = 0; i < 2 * n; ++i) {
    const at::Tensor& t = i < n ? input_tensor_list[i] : output_tensor_list[i - n];
    call.tensor(t);
    DTRAIN_CHECK(t.scalar_type() == like.scalar_type() && t.device() == like.device(),
                 "all_to_all: ", i < n ? "input_tensor_list[" : "output_tensor_list[", i % n, "] is ", t.scalar_type(),
                 " on ", t.device(), " but input_tensor_list[0] is ", like.scalar_type(), " on ", like.device(),
                 ": pass tensors of one dtype on one device");
    (i < n ? is : os).push_back(t.numel());
  }
  call.supported(c10d::OpType::ALLTOALL, like);
  call.same_call(detail::cat("dtype=", like.scalar_type()));
  call.record(FlightCall("all_to_all", "all_to_all").in(input_tensor_list).out(output_tensor_list));
  // One exchange of flat buffers: element counts are the split sizes.
  std::vector<at::Tensor> flat_in;
  for (const auto& t : input_tensor_list) flat_in.push_back(t.reshape({-1}));
  at::Tensor in = at::cat(flat_in);
  int64_t total = 0;
  for (int64_t c : os) total += c;
  at::Tensor out = at::empty({total}, like.options());
  c10d::AllToAllOptions opts;
  opts.timeout = g.timeout;
  std::vector<at::Tensor> outputs = output_tensor_list;
  auto done = [outputs, out]() mutable {
    int64_t offset = 0;
    for (auto& t : outputs) {
      t.copy_(out.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  };
  return call.launch([&] { return g.pg->alltoall_base(out, in, os, is, opts); }, async_op, std::move(done));
}

namespace {

// gather's and scatter's list: one tensor per rank on the root (in c10d's nested form), empty
// elsewhere. role, root_name, root: "destination", "dst" and its value (or source/src) for the error.
std::vector<std::vector<at::Tensor>> root_only_list(CollectiveCall& call, int root_in_group,
                                                    std::vector<at::Tensor>& list, const at::Tensor& like,
                                                    const char* list_name, const char* role, const char* root_name,
                                                    int root) {
  const char* op = call.op();
  std::vector<std::vector<at::Tensor>> nested;
  if (call.group().rank == root_in_group) {
    call.list(list, like, list_name);
    nested.push_back(list);
  } else {
    DTRAIN_CHECK(list.empty(), op, ": ", list_name, " must be empty on non-", role, " rank ", comm::world_state().rank,
                 " (", root_name, "=", root, "): pass ", list_name, " only on the ", role, " rank");
  }
  return nested;
}

}  // namespace

Work gather(const at::Tensor& input, std::vector<at::Tensor>& gather_list, int dst, const Group& group, bool async_op) {
  CollectiveCall call(group, "gather");
  call.tensor(input).supported(c10d::OpType::GATHER, input);
  call.same_call("input=" + comm::describe(input), detail::cat("dst=", dst));
  c10d::GatherOptions opts;
  opts.rootRank = call.group_rank(dst, "dst");
  opts.timeout = call.group().timeout;
  auto out = root_only_list(call, opts.rootRank, gather_list, input, "gather_list", "destination", "dst", dst);
  std::vector<at::Tensor> in{input};
  FlightCall record("gather", "gather");  // what every rank passes alike: the input
  record.in(input).root = opts.rootRank;
  call.record(std::move(record));
  return call.launch([&] { return call.group().pg->gather(out, in, opts); }, async_op);
}

Work scatter(at::Tensor& output, std::vector<at::Tensor>& scatter_list, int src, const Group& group, bool async_op) {
  CollectiveCall call(group, "scatter");
  call.tensor(output).supported(c10d::OpType::SCATTER, output);
  call.same_call("output=" + comm::describe(output), detail::cat("src=", src));
  c10d::ScatterOptions opts;
  opts.rootRank = call.group_rank(src, "src");
  opts.timeout = call.group().timeout;
  auto in = root_only_list(call, opts.rootRank, scatter_list, output, "scatter_list", "source", "src", src);
  std::vector<at::Tensor> out{output};
  FlightCall record("scatter", "scatter");  // what every rank passes alike: the output
  record.in(output).root = opts.rootRank;
  call.record(std::move(record));
  return call.launch([&] { return call.group().pg->scatter(out, in, opts); }, async_op);
}

Work barrier(const Group& group, bool async_op) {
  CollectiveCall call(group, "barrier");
  call.same_call();
  call.record(FlightCall("barrier", "barrier"));
  c10d::BarrierOptions opts;
  opts.timeout = call.group().timeout;
  return call.launch([&] { return call.group().pg->barrier(opts); }, async_op);
}

void monitored_barrier(const Group& group, std::optional<std::chrono::milliseconds> timeout, bool wait_all_ranks) {
  CollectiveCall call(group, "monitored_barrier");
  const auto& g = call.group();
  DTRAIN_CHECK(g.backend == "gloo", "monitored_barrier needs the gloo backend, the group uses '", g.backend,
               "': create a gloo subgroup for it");
  // No DETAIL check here: monitored_barrier exists to report absent ranks within its own timeout.
  c10d::BarrierOptions opts;
  opts.timeout = util::capped(timeout.value_or(g.timeout));
  call.record(FlightCall("monitored_barrier", "barrier"));
  call.run_parts([&] {
    try {
      g.pg->monitoredBarrier(opts, wait_all_ranks);
    } catch (const std::exception& e) {
      std::string msg = e.what();
      auto nl = msg.find("\nException raised from");
      throw Error(call.what() + " failed: " + msg.substr(0, nl));
    }
  });
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
  CollectiveCall call(group, "recv");
  call.tensor(tensor);
  const auto& g = call.group();
  std::vector<at::Tensor> ts{tensor};
  if (src >= 0) {
    const int from = call.group_rank(src, "src");
    call.record(p2p_call("recv", tensor, from, tag));
    call.begin([&] { return g.pg->recv(ts, from, tag); }).wait();
    return src;
  }
  c10::intrusive_ptr<c10d::Work> work;
  call.record(p2p_call("recv", tensor, -1, tag));
  call.begin([&] { return work = g.pg->recvAnysource(ts, tag); }).wait();
  return g.ranks.at(work->sourceRank());
}

Work isend(const at::Tensor& tensor, int dst, const Group& group, int tag) {
  CollectiveCall call(group, "send");
  call.tensor(tensor);
  std::vector<at::Tensor> ts{tensor};
  const int to = call.group_rank(dst, "dst");
  call.record(p2p_call("send", tensor, to, tag));
  return call.begin([&] { return call.group().pg->send(ts, to, tag); });
}

Work irecv(at::Tensor& tensor, int src, const Group& group, int tag) {
  CollectiveCall call(group, "recv");
  call.tensor(tensor);
  DTRAIN_CHECK(src >= 0, "irecv: src must be a rank (>= 0), got ", src, ": use recv() for any source");
  std::vector<at::Tensor> ts{tensor};
  const int from = call.group_rank(src, "src");
  call.record(p2p_call("recv", tensor, from, tag));
  return call.begin([&] { return call.group().pg->recv(ts, from, tag); });
}

}  // namespace dtrain
