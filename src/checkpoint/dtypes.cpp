// One table of LibTorch's dtypes with torch's and safetensors' names for each.
#include "checkpoint/dtypes.h"

#include <array>

#include <torch/csrc/api/include/torch/version.h>

namespace dtrain::ckpt {

namespace {

struct Row {
  c10::ScalarType type;
  const char* torch_name;
  const char* safetensors;  // null: safetensors has no code for it
};

// safetensors' codes are those safetensors.torch maps to torch dtypes (0.8: its _TYPES); float8 and
// the unsigned wide integers exist in LibTorch 2.x only. Every floating and integer dtype LibTorch
// has is here; complex128 and complex32 have no safetensors code.
const std::array kRows {
  Row{c10::ScalarType::Bool, "bool", "BOOL"}, Row{c10::ScalarType::Byte, "uint8", "U8"},
      Row{c10::ScalarType::Char, "int8", "I8"}, Row{c10::ScalarType::Short, "int16", "I16"},
      Row{c10::ScalarType::Int, "int32", "I32"}, Row{c10::ScalarType::Long, "int64", "I64"},
      Row{c10::ScalarType::Half, "float16", "F16"}, Row{c10::ScalarType::BFloat16, "bfloat16", "BF16"},
      Row{c10::ScalarType::Float, "float32", "F32"}, Row{c10::ScalarType::Double, "float64", "F64"},
      Row{c10::ScalarType::ComplexFloat, "complex64", "C64"},
      Row{c10::ScalarType::ComplexDouble, "complex128", nullptr},
      Row{c10::ScalarType::ComplexHalf, "complex32", nullptr},
#if TORCH_VERSION_MAJOR >= 2
      Row{c10::ScalarType::Float8_e4m3fn, "float8_e4m3fn", "F8_E4M3"},
      Row{c10::ScalarType::Float8_e5m2, "float8_e5m2", "F8_E5M2"},
      Row{c10::ScalarType::Float8_e4m3fnuz, "float8_e4m3fnuz", "F8_E4M3FNUZ"},
      Row{c10::ScalarType::Float8_e5m2fnuz, "float8_e5m2fnuz", "F8_E5M2FNUZ"},
      Row{c10::ScalarType::UInt16, "uint16", "U16"}, Row{c10::ScalarType::UInt32, "uint32", "U32"},
      Row{c10::ScalarType::UInt64, "uint64", "U64"},
#endif
};

}  // namespace

std::string torch_dtype_name(c10::ScalarType t) {
  for (const Row& r : kRows)
    if (r.type == t) return r.torch_name;
  return c10::toString(t);
}

std::optional<c10::ScalarType> dtype_of_torch_name(const std::string& name) {
  for (const Row& r : kRows)
    if (name == r.torch_name) return r.type;
  return std::nullopt;
}

std::optional<std::string> safetensors_code(c10::ScalarType t) {
  for (const Row& r : kRows)
    if (r.type == t && r.safetensors) return std::string(r.safetensors);
  return std::nullopt;
}

std::optional<c10::ScalarType> dtype_of_safetensors_code(const std::string& code) {
  for (const Row& r : kRows)
    if (r.safetensors && code == r.safetensors) return r.type;
  return std::nullopt;
}

int safetensors_order(const std::string& code) {
  // safetensors' Dtype enum (0.8), which its writer sorts by.
  static const char* const kEnum[] = {"BOOL",    "F4",      "F6_E2M3", "F6_E3M2", "U8",  "I8",   "F8_E5M2",
                                      "F8_E4M3", "F8_E8M0", "I16",     "U16",     "F16", "BF16", "I32",
                                      "U32",     "F32",     "C64",     "F64",     "I64", "U64"};
  int k = 0;
  for (const char* c : kEnum) {
    if (code == c) return k;
    ++k;
  }
  if (code.rfind("F8_", 0) == 0) return 7;  // the fnuz forms, beside the other float8s
  return k;
}

std::string safetensors_codes_text() {
  std::string s;
  for (const Row& r : kRows)
    if (r.safetensors) s += (s.empty() ? "" : ", ") + std::string(r.safetensors) + " (" + r.torch_name + ")";
  return s;
}

}  // namespace dtrain::ckpt
