// The C API's own bookkeeping: the live handles, the thread's last error, and the one wrapper every
// entry point runs its body in, so that no C++ exception crosses into a C caller.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain_c.h"

namespace dtrain::capi {

// An error whose status the entry point decided (a bad argument, a dead handle, no process group).
class StatusError : public std::runtime_error {
 public:
  StatusError(dtrain_c_status status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  dtrain_c_status status() const { return status_; }

 private:
  dtrain_c_status status_;
};

// Kinds of handle: a handle of one kind passed where another is expected is refused as unknown.
enum class Kind { kGroup, kWork, kDdp, kFsdp, kScaler, kMonitor, kZero, kCheckpoint };
const char* kind_name(Kind kind);

struct Object {
  virtual ~Object() = default;
};

// Handles are numbers, never addresses, and never reused: a freed handle stays unknown forever, so
// a use after free is always caught (an address could be handed out again).
void* add_handle(Kind kind, std::shared_ptr<Object> object);
// The live object behind `handle`, or StatusError(DTRAIN_C_INVALID_HANDLE) naming `fn`.
std::shared_ptr<Object> find_handle(const void* handle, Kind kind, const char* what);
template <typename T>
std::shared_ptr<T> get_handle(const void* handle, Kind kind, const char* what) {
  return std::static_pointer_cast<T>(find_handle(handle, kind, what));
}
// Removes the handle; its object dies when the last call using it returns.
std::shared_ptr<Object> remove_handle(const void* handle, Kind kind, const char* what);
// Every handle of every kind (the process group they belong to is going away).
void clear_handles();

// StatusError(DTRAIN_C_NOT_INITIALIZED) unless a process group is up.
void require_init();
// The caller's tensor: non-null and defined, else StatusError(DTRAIN_C_INVALID_ARGUMENT) naming `what`.
at::Tensor& tensor_arg(dtrain_c_tensor* tensor, const char* what);
void require_arg(bool ok, const std::string& msg);
// A new at::Tensor* the caller frees with dtrain_c_tensor_free.
dtrain_c_tensor* new_tensor(at::Tensor tensor);

// Runs body; returns DTRAIN_C_OK, or the failure's status with the thread's last error set to
// "<fn> on rank R: <message>" (the rank once a process group is up). `dtrain_status` is the status of
// a dtrain::Error (a failed collective, a refused file), which says whose the mistake was in words.
dtrain_c_status run_entry(const char* fn, dtrain_c_status dtrain_status, void (*body)(void*), void* ctx);
template <typename F>
dtrain_c_status entry(const char* fn, dtrain_c_status dtrain_status, F&& body) {
  return run_entry(
      fn, dtrain_status, [](void* ctx) { (*static_cast<std::remove_reference_t<F>*>(ctx))(); },
      static_cast<void*>(&body));
}

}  // namespace dtrain::capi

namespace dtrain {
class Group;
namespace capi {
// The group a call names: NULL is the world (torch.distributed's group=None); a dead handle throws.
Group group_arg(dtrain_c_group* group);
// A model's parameters as DDP and fully_shard take them: n > 0 tensors, floating point (else the
// error says `floating_why`), on the device of the group's backend, leaves with requires_grad.
std::vector<at::Tensor> param_args(dtrain_c_tensor* const* params, size_t n, const Group& group,
                                   const char* floating_why);
// The parameters' names: NULL gives "param_0", ...; else n unique names without '.'.
std::vector<std::string> param_names(const char* const* names, size_t n);
// A forward's outputs (n tensors, or none).
std::vector<at::Tensor> output_args(dtrain_c_tensor* const* outputs, size_t n);
// Named tensors of a checkpoint: every name non-empty and unique, every tensor defined.
std::vector<std::pair<std::string, at::Tensor>> named_args(const char* const* names, dtrain_c_tensor* const* tensors,
                                                           size_t n);
}  // namespace capi
}  // namespace dtrain
