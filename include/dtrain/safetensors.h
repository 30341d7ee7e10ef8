// The safetensors format (Hugging Face's, read by Python's `safetensors` and `transformers`): a
// little-endian u64 header length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian bytes. No pickle: reading one runs no code.
//
//   dtrain::save_safetensors(*model, "model.safetensors", {{"epoch", "5"}});
//   dtrain::load_safetensors(*model, "model.safetensors");   // by name; shapes must match
// and in Python:
//   from safetensors.torch import load_file
//   model.load_state_dict(load_file("model.safetensors"))
//
// Every dtype LibTorch has a safetensors code for (the table in docs/api.md): bool, uint8, int8,
// int16, int32, int64, float16, bfloat16, float32, float64, complex64, and on LibTorch 2.x float8
// (e4m3fn, e5m2 and their fnuz forms), uint16, uint32 and uint64. A tensor of another dtype is an
// error naming it. Files are written atomically (a temporary file, fsync, rename), header padded to
// 8 bytes as Python's writer does. A file that is not valid (its length, its JSON, a dtype, a shape
// or a byte range that does not fit) is refused with one line naming the file and the byte offset.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace torch::nn {
class Module;
}

namespace dtrain {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes the tensors (any device, any layout: copied to the CPU, contiguous) under their names, with
// `metadata` as the header's "__metadata__" (string to string, as the format allows).
void save_safetensors(const NamedTensors& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});
// A module's parameters and buffers, named as named_parameters() and named_buffers() give them.
void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  NamedTensors tensors;  // in the order of their bytes in the file, on the CPU
  std::map<std::string, std::string> metadata;
};
SafetensorsFile load_safetensors(const std::string& path);
// Loads into the module's parameters and buffers by name, as load_state_dict(strict=True): a name
// missing from the file or the module, or a shape that differs, is an error listing them, and then
// nothing of the module has changed. Values are copied (converted to each tensor's dtype and device).
void load_safetensors(torch::nn::Module& module, const std::string& path);

// Every member's named tensors on the global rank dst, in group-rank order (each member's in its
// own order); an empty list on the other members. Collective over `group`. For one file of a model
// whose parts live on different ranks (pipeline stages, each put together within its stage first):
//   dtrain::NamedTensors stage = dtrain::full_state_dict(*stage_module);
//   dtrain::NamedTensors whole = dtrain::gather_named_tensors(stage, 0, pp_group);
//   if (dtrain::rank() == 0) dtrain::save_safetensors(whole, "model.safetensors");
// Names, dtypes and shapes travel first, then each tensor point to point (contiguous, as it is; the
// received ones are allocated on the device of dst's first tensor, or the CPU).
NamedTensors gather_named_tensors(const NamedTensors& mine, int dst, const Group& group = Group());

}  // namespace dtrain
