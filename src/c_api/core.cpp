// The C API's lifetime calls (init, ranks, groups, tensors from other front ends) and the machinery
// of handles.h: the registry of live handles and the wrapper that turns exceptions into statuses.
#include <cinttypes>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include "c_api/handles.h"
#include "dtrain/process_group.h"

namespace dtrain::capi {
namespace {

thread_local std::string capi_last_error;

struct CapiRegistry {
  std::mutex mu;
  uintptr_t next = 0x1000;  // never 0: a NULL handle is never live
  std::unordered_map<uintptr_t, std::pair<Kind, std::shared_ptr<Object>>> live;
  std::unordered_map<const at::Tensor*, bool> tensors;  // made by dtrain_c_tensor_from_impl
};

// Never destroyed: a program that exits with live handles must not run DDP's or a group's
// destructor after dtrain's own statics are gone.
CapiRegistry& capi_registry() {
  static auto* r = new CapiRegistry();
  return *r;
}

struct GroupObject : Object {
  Group group;
};

Group& group_of(dtrain_c_group* group, const char* what) {
  return get_handle<GroupObject>(group, Kind::kGroup, what)->group;
}

}  // namespace

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kGroup:
      return "group";
    case Kind::kWork:
      return "work";
    case Kind::kDdp:
      return "ddp";
    case Kind::kFsdp:
      return "fsdp";
    case Kind::kScaler:
      return "grad scaler";
    case Kind::kMonitor:
      return "monitor";
    case Kind::kZero:
      return "zero";
    case Kind::kCheckpoint:
      return "checkpoint";
  }
  return "?";
}

void* add_handle(Kind kind, std::shared_ptr<Object> object) {
  auto& r = capi_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const uintptr_t id = r.next;
  r.next += 16;
  r.live.emplace(id, std::make_pair(kind, std::move(object)));
  return reinterpret_cast<void*>(id);
}

namespace {
std::string handle_text(const void* handle) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<uintptr_t>(handle));
  return buf;
}
[[noreturn]] void dead_handle(const void* handle, Kind kind, const char* what) {
  if (!handle)
    throw StatusError(DTRAIN_C_INVALID_HANDLE, dtrain::detail::cat(what, " is NULL: pass a ", kind_name(kind),
                                                                   " handle that a dtrain_c_* call returned"));
  throw StatusError(DTRAIN_C_INVALID_HANDLE,
                    dtrain::detail::cat(what, " ", handle_text(handle), " is not a live ", kind_name(kind),
                                        " handle (freed, destroyed with the process group, or never made): keep the "
                                        "handle until its last use and free it once"));
}
}  // namespace

std::shared_ptr<Object> find_handle(const void* handle, Kind kind, const char* what) {
  auto& r = capi_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(reinterpret_cast<uintptr_t>(handle));
  if (it == r.live.end() || it->second.first != kind) dead_handle(handle, kind, what);
  return it->second.second;
}

std::shared_ptr<Object> remove_handle(const void* handle, Kind kind, const char* what) {
  auto& r = capi_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(reinterpret_cast<uintptr_t>(handle));
  if (it == r.live.end() || it->second.first != kind) dead_handle(handle, kind, what);
  auto object = std::move(it->second.second);
  r.live.erase(it);
  return object;
}

void clear_handles() {
  auto& r = capi_registry();
  std::vector<std::shared_ptr<Object>> dying;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    // Checkpoint managers, monitors, DDPs, FSDPs and ZeROs first: their writers, hooks, buckets,
    // windows and shares refer to the groups.
    for (Kind kind : {Kind::kCheckpoint, Kind::kMonitor, Kind::kDdp, Kind::kFsdp, Kind::kZero, Kind::kScaler,
                      Kind::kWork, Kind::kGroup})
      for (auto& [id, entry] : r.live)
        if (entry.first == kind) dying.push_back(entry.second);
    r.live.clear();
  }
  while (!dying.empty()) dying.erase(dying.begin());  // in that order, outside the lock
}

dtrain_c_tensor* new_tensor(at::Tensor tensor) {
  auto* t = new at::Tensor(std::move(tensor));
  auto& r = capi_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.tensors.emplace(t, true);
  return reinterpret_cast<dtrain_c_tensor*>(t);
}

void require_init() {
  if (!is_initialized())
    throw StatusError(DTRAIN_C_NOT_INITIALIZED,
                      "no process group: call dtrain_c_init_process_group first (under dtrain-run or torchrun)");
}

at::Tensor& tensor_arg(dtrain_c_tensor* tensor, const char* what) {
  if (!tensor)
    throw StatusError(DTRAIN_C_INVALID_ARGUMENT,
                      dtrain::detail::cat(what, " is NULL: pass an at::Tensor* (see dtrain_c.h)"));
  auto* t = reinterpret_cast<at::Tensor*>(tensor);
  if (!t->defined())
    throw StatusError(DTRAIN_C_INVALID_ARGUMENT,
                      dtrain::detail::cat(what, " is an undefined tensor: pass one with storage"));
  return *t;
}

void require_arg(bool ok, const std::string& msg) {
  if (!ok) throw StatusError(DTRAIN_C_INVALID_ARGUMENT, msg);
}

namespace {
dtrain_c_status capi_fail(const char* fn, dtrain_c_status status, const std::string& msg) {
  std::string where = fn;
  try {
    if (is_initialized()) where += dtrain::detail::cat(" on rank ", rank());
  } catch (...) {  // the message matters more than the rank
  }
  capi_last_error = where + ": " + msg;
  return status;
}
}  // namespace

dtrain_c_status run_entry(const char* fn, dtrain_c_status dtrain_status, void (*body)(void*), void* ctx) {
  try {
    body(ctx);
    capi_last_error.clear();
    return DTRAIN_C_OK;
  } catch (const StatusError& e) {
    return capi_fail(fn, e.status(), e.what());
  } catch (const Error& e) {
    return capi_fail(fn, dtrain_status, e.what());
  } catch (const c10::Error& e) {
    return capi_fail(fn, DTRAIN_C_INTERNAL_ERROR, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return capi_fail(fn, DTRAIN_C_INTERNAL_ERROR, e.what());
  } catch (...) {
    return capi_fail(fn, DTRAIN_C_INTERNAL_ERROR, "an unknown exception");
  }
}

}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

int dtrain_c_abi_version(void) { return DTRAIN_C_ABI_VERSION; }

const char* dtrain_c_last_error(void) { return capi_last_error.c_str(); }

dtrain_c_status dtrain_c_tensor_from_impl(void* impl, dtrain_c_tensor** out) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    require_arg(impl, "impl is NULL: pass a live c10::TensorImpl* (Python: tensor._cdata)");
    require_arg(out, "out is NULL: pass where to store the new tensor");
    auto ptr = c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::unsafe_reclaim_from_nonowning(
        static_cast<c10::TensorImpl*>(impl));
    *out = new_tensor(at::Tensor(std::move(ptr)));
  });
}

dtrain_c_status dtrain_c_tensor_free(dtrain_c_tensor* tensor) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto* t = reinterpret_cast<at::Tensor*>(tensor);
    auto& r = capi_registry();
    {
      std::lock_guard<std::mutex> lock(r.mu);
      if (!r.tensors.erase(t))
        throw StatusError(
            DTRAIN_C_INVALID_HANDLE,
            dtrain::detail::cat("tensor ", handle_text(t),
                                " was not made by dtrain_c_tensor_from_impl (or dtrain_c_grad_scaler_scale) or is "
                                "already freed: free only those, once (your binding frees its own "
                                "tensors)"));
    }
    delete t;
  });
}

dtrain_c_status dtrain_c_init_process_group(const char* backend, const char* init_method, int rank, int world_size,
                                            int64_t timeout_ms) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(timeout_ms >= 0, dtrain::detail::cat("timeout_ms is ", timeout_ms, ": pass 0 for the default, or > 0"));
    InitOptions options;
    if (backend) options.backend(backend);
    if (init_method) options.init_method(init_method);
    options.rank(rank).world_size(world_size);
    if (timeout_ms > 0) options.timeout(std::chrono::milliseconds(timeout_ms));
    init_process_group(options);
  });
}

int dtrain_c_is_initialized(void) {
  try {
    return is_initialized() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

dtrain_c_status dtrain_c_destroy_process_group(void) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_init();
    clear_handles();
    destroy_process_group();
  });
}

dtrain_c_status dtrain_c_rank(int* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL");
    require_init();
    *out = dtrain::rank();
  });
}

dtrain_c_status dtrain_c_world_size(int* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL");
    require_init();
    *out = dtrain::world_size();
  });
}

dtrain_c_status dtrain_c_local_rank(int* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL");
    require_init();
    *out = dtrain::local_rank();
  });
}

dtrain_c_status dtrain_c_new_group(const int* ranks, size_t n, dtrain_c_group** out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the group handle");
    require_arg(ranks || n == 0,
                dtrain::detail::cat("ranks is NULL with n = ", n, ": pass n ranks, or n = 0 for the world"));
    require_init();
    auto object = std::make_shared<GroupObject>();
    object->group = new_group(std::vector<int>(ranks, ranks + n));
    *out = static_cast<dtrain_c_group*>(add_handle(Kind::kGroup, std::move(object)));
  });
}

dtrain_c_status dtrain_c_group_rank(dtrain_c_group* group, int* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL");
    require_init();
    *out = group ? group_of(group, "group").rank() : dtrain::rank();
  });
}

dtrain_c_status dtrain_c_group_size(dtrain_c_group* group, int* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL");
    require_init();
    *out = group ? group_of(group, "group").size() : dtrain::world_size();
  });
}

dtrain_c_status dtrain_c_group_free(dtrain_c_group* group) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { remove_handle(group, Kind::kGroup, "group"); });
}

}  // extern "C"

namespace dtrain::capi {
// The group a call names: NULL is the world (torch.distributed's group=None).
Group group_arg(dtrain_c_group* group) { return group ? group_of(group, "group") : Group(); }

std::vector<at::Tensor> param_args(dtrain_c_tensor* const* params, size_t n, const Group& group,
                                   const char* floating_why) {
  require_arg(params && n > 0, dtrain::detail::cat("params is NULL or n is ", n, ": pass the model's parameters"));
  const at::Device device = collective_device(group);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < n; ++i) {
    const std::string what = dtrain::detail::cat("params[", i, "]");
    at::Tensor& t = tensor_arg(params[i], what.c_str());
    require_arg(at::isFloatingType(t.scalar_type()),
                dtrain::detail::cat(what, " is ", t.scalar_type(), ": ", floating_why));
    require_arg(t.device() == device,
                dtrain::detail::cat(what, " is on ", t.device(), " but the group's backend ", group.backend(),
                                    " takes ", device, ": move the model there"));
    require_arg(t.is_leaf() && t.requires_grad(),
                dtrain::detail::cat(what, " is not a leaf tensor with requires_grad: pass the model's parameters"));
    out.push_back(t);
  }
  return out;
}

std::vector<std::string> param_names(const char* const* names, size_t n) {
  std::vector<std::string> out;
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < n; ++i) {
    std::string name = names ? std::string(names[i] ? names[i] : "") : "param_" + std::to_string(i);
    require_arg(!name.empty(), dtrain::detail::cat("names[", i, "] is NULL or empty: name every parameter"));
    require_arg(name.find('.') == std::string::npos,
                dtrain::detail::cat("names[", i, "] is '", name, "': a parameter name has no '.' (use '_')"));
    const auto [first, fresh] = seen.emplace(name, i);
    require_arg(fresh, dtrain::detail::cat("names[", i, "] '", name, "' repeats names[", first->second, "]"));
    out.push_back(std::move(name));
  }
  return out;
}

std::vector<at::Tensor> output_args(dtrain_c_tensor* const* outputs, size_t n) {
  require_arg(outputs || n == 0, dtrain::detail::cat("outputs is NULL with n = ", n));
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < n; ++i)
    tensors.push_back(tensor_arg(outputs[i], dtrain::detail::cat("outputs[", i, "]").c_str()));
  return tensors;
}

std::vector<std::pair<std::string, at::Tensor>> named_args(const char* const* names, dtrain_c_tensor* const* tensors,
                                                           size_t n) {
  require_arg((names && tensors) || n == 0, dtrain::detail::cat("names or tensors is NULL with n = ", n));
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < n; ++i) {
    require_arg(names[i] && names[i][0], dtrain::detail::cat("names[", i, "] is NULL or empty: name every tensor"));
    const auto [first, fresh] = seen.emplace(names[i], i);
    require_arg(fresh, dtrain::detail::cat("names[", i, "] '", names[i], "' repeats names[", first->second,
                                           "]: names are unique"));
    out.emplace_back(names[i], tensor_arg(tensors[i], dtrain::detail::cat("tensors[", i, "]").c_str()));
  }
  return out;
}
}  // namespace dtrain::capi
