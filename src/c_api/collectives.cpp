// The C API's collectives: each checks its tensors where a C caller can get them wrong (NULL, the
// wrong device for the group's backend, mismatched dtypes) and runs dtrain's collective, blocking
// or returning a work handle that keeps the tensors alive until it is freed.
#include <utility>
#include <vector>

#include "c_api/handles.h"
#include "dtrain/process_group.h"

namespace dtrain::capi {
namespace {

struct WorkObject : Object {
  Work work;
  std::vector<at::Tensor> keep;  // the caller may drop its tensors before waiting
};

ReduceOp op_arg(dtrain_c_reduce_op op) {
  switch (op) {
    case DTRAIN_C_SUM:
      return ReduceOp::SUM;
    case DTRAIN_C_AVG:
      return ReduceOp::AVG;
    case DTRAIN_C_MIN:
      return ReduceOp::MIN;
    case DTRAIN_C_MAX:
      return ReduceOp::MAX;
    case DTRAIN_C_PRODUCT:
      return ReduceOp::PRODUCT;
    case DTRAIN_C_REDUCE_OP_MAX_ENUM:
      break;
  }
  throw StatusError(
      DTRAIN_C_INVALID_ARGUMENT,
      dtrain::detail::cat("op is ", static_cast<int>(op), ": pass one of DTRAIN_C_SUM (0) .. DTRAIN_C_PRODUCT (4)"));
}

// A collective's tensor: present, on the device the group's backend takes, contiguous.
at::Tensor& comm_tensor(dtrain_c_tensor* tensor, const char* what, const Group& group) {
  at::Tensor& t = tensor_arg(tensor, what);
  const at::Device device = collective_device(group);
  require_arg(t.device() == device,
              dtrain::detail::cat(what, " is on ", t.device(), " but the group's backend ", group.backend(),
                                  " takes tensors on ", device, ": move it there first"));
  require_arg(t.is_contiguous(), dtrain::detail::cat(what, " is not contiguous: pass .contiguous() of it"));
  return t;
}

// The output and input of a gather or scatter into one tensor: each a collective's tensor, one dtype.
std::pair<at::Tensor, at::Tensor> out_in_tensors(dtrain_c_tensor* output, dtrain_c_tensor* input, const Group& group) {
  at::Tensor& out = comm_tensor(output, "output", group);
  at::Tensor& in = comm_tensor(input, "input", group);
  require_arg(out.scalar_type() == in.scalar_type(),
              dtrain::detail::cat("output is ", out.scalar_type(), " but input is ", in.scalar_type(),
                                  ": pass one dtype for both"));
  return {out, in};
}

// Blocks (work NULL) or hands the caller a work handle.
void finish(Work w, dtrain_c_work** work, std::vector<at::Tensor> keep) {
  if (!work) return;
  auto object = std::make_shared<WorkObject>();
  object->work = std::move(w);
  object->keep = std::move(keep);
  *work = static_cast<dtrain_c_work*>(add_handle(Kind::kWork, std::move(object)));
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

dtrain_c_status dtrain_c_all_reduce(dtrain_c_tensor* tensor, dtrain_c_reduce_op op, dtrain_c_group* group,
                                    dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    const Group g = group_arg(group);
    at::Tensor& t = comm_tensor(tensor, "tensor", g);
    finish(all_reduce(t, op_arg(op), g, work != nullptr), work, {t});
  });
}

dtrain_c_status dtrain_c_broadcast(dtrain_c_tensor* tensor, int src, dtrain_c_group* group, dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    const Group g = group_arg(group);
    at::Tensor& t = comm_tensor(tensor, "tensor", g);
    finish(broadcast(t, src, g, work != nullptr), work, {t});
  });
}

dtrain_c_status dtrain_c_all_gather_into_tensor(dtrain_c_tensor* output, dtrain_c_tensor* input, dtrain_c_group* group,
                                                dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    const Group g = group_arg(group);
    auto [out, in] = out_in_tensors(output, input, g);
    finish(all_gather_into_tensor(out, in, g, work != nullptr), work, {out, in});
  });
}

dtrain_c_status dtrain_c_reduce_scatter_tensor(dtrain_c_tensor* output, dtrain_c_tensor* input, dtrain_c_reduce_op op,
                                               dtrain_c_group* group, dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    const Group g = group_arg(group);
    auto [out, in] = out_in_tensors(output, input, g);
    finish(reduce_scatter_tensor(out, in, op_arg(op), g, work != nullptr), work, {out, in});
  });
}

dtrain_c_status dtrain_c_barrier(dtrain_c_group* group, dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    finish(barrier(group_arg(group), work != nullptr), work, {});
  });
}

dtrain_c_status dtrain_c_send(dtrain_c_tensor* tensor, int dst, dtrain_c_group* group, int tag, dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    const Group g = group_arg(group);
    at::Tensor& t = comm_tensor(tensor, "tensor", g);
    require_arg(dst >= 0 && dst < world_size() && dst != rank(),
                dtrain::detail::cat("dst is ", dst, ": pass another rank's global rank in [0, ", world_size(), ")"));
    if (!work) return send(t, dst, g, tag);
    finish(isend(t, dst, g, tag), work, {t});
  });
}

dtrain_c_status dtrain_c_recv(dtrain_c_tensor* tensor, int src, dtrain_c_group* group, int tag, int* sender,
                              dtrain_c_work** work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    const Group g = group_arg(group);
    at::Tensor& t = comm_tensor(tensor, "tensor", g);
    require_arg(src == -1 || (src >= 0 && src < world_size() && src != rank()),
                dtrain::detail::cat("src is ", src, ": pass another rank's global rank in [0, ", world_size(),
                                    "), or -1 for any (blocking only)"));
    if (!work) {
      const int from = recv(t, src, g, tag);
      if (sender) *sender = from;
      return;
    }
    require_arg(src >= 0,
                "src is -1 with a work handle: an asynchronous recv names its sender (pass work NULL to "
                "receive from any rank)");
    if (sender) *sender = src;
    finish(irecv(t, src, g, tag), work, {t});
  });
}

dtrain_c_status dtrain_c_work_wait(dtrain_c_work* work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { get_handle<WorkObject>(work, Kind::kWork, "work")->work.wait(); });
}

dtrain_c_status dtrain_c_work_is_completed(dtrain_c_work* work, int* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL");
    *out = get_handle<WorkObject>(work, Kind::kWork, "work")->work.is_completed() ? 1 : 0;
  });
}

dtrain_c_status dtrain_c_work_free(dtrain_c_work* work) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { remove_handle(work, Kind::kWork, "work"); });
}

}  // extern "C"
