// The names other programs give LibTorch's dtypes in files: torch's attribute names (DCP's metadata
// pickles dtypes as torch.<name>) and safetensors' codes.
#pragma once

#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

namespace dtrain::ckpt {

// "float32", "bfloat16", "int64", ...: the attribute of the torch module that is the dtype.
std::string torch_dtype_name(c10::ScalarType t);
std::optional<c10::ScalarType> dtype_of_torch_name(const std::string& name);
// safetensors' codes: "F32", "BF16", "I64", "BOOL", ...; nullopt for a dtype safetensors lacks.
std::optional<std::string> safetensors_code(c10::ScalarType t);
std::optional<c10::ScalarType> dtype_of_safetensors_code(const std::string& code);
// Where safetensors' writer puts a dtype's tensors: its Dtype enum's order (widest last); the writer
// lays tensors out by this order, descending, then by name.
int safetensors_order(const std::string& code);
// Every dtype both tables know, for the tests and the documentation's table.
std::string safetensors_codes_text();

}  // namespace dtrain::ckpt
