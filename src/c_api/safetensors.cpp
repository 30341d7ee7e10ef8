// Checkpoints of named tensors for the C API: dtrain's safetensors writer and reader, matched by name
// into the caller's tensors with load_state_dict(strict=True)'s rules, all checked before any copy.
#include <map>
#include <string>
#include <vector>

#include <ATen/core/grad_mode.h>

#include "c_api/handles.h"
#include "dtrain/safetensors.h"

namespace dtrain::capi {
namespace {

NamedTensors capi_named(const char* path, const char* const* names, dtrain_c_tensor* const* tensors, size_t n) {
  require_arg(path && path[0], "path is NULL or empty: pass the file's path");
  return named_args(names, tensors, n);
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

dtrain_c_status dtrain_c_save_safetensors(const char* path, const char* const* names, dtrain_c_tensor* const* tensors,
                                          size_t n) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    NamedTensors named = capi_named(path, names, tensors, n);
    at::NoGradGuard no_grad;
    for (auto& kv : named) kv.second = kv.second.detach();
    save_safetensors(named, path);
  });
}

dtrain_c_status dtrain_c_load_safetensors(const char* path, const char* const* names, dtrain_c_tensor* const* tensors,
                                          size_t n) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    NamedTensors into = capi_named(path, names, tensors, n);
    SafetensorsFile file = load_safetensors(path);
    std::map<std::string, at::Tensor> by_name(file.tensors.begin(), file.tensors.end());
    std::string problems;
    for (const auto& [name, t] : into) {
      auto it = by_name.find(name);
      if (it == by_name.end())
        problems += dtrain::detail::cat(" missing from the file: '", name, "';");
      else if (it->second.sizes() != t.sizes())
        problems +=
            dtrain::detail::cat(" '", name, "' is ", it->second.sizes(), " in the file but ", t.sizes(), " here;");
    }
    for (const auto& kv : by_name) {
      bool wanted = false;
      for (const auto& e : into) wanted = wanted || e.first == kv.first;
      if (!wanted) problems += dtrain::detail::cat(" unexpected in the file: '", kv.first, "';");
    }
    require_arg(problems.empty(), dtrain::detail::cat(path, ": nothing loaded:", problems,
                                                      " pass the names and shapes the file was saved with"));
    at::NoGradGuard no_grad;
    for (auto& [name, t] : into) t.copy_(by_name.at(name));
  });
}

}  // extern "C"
