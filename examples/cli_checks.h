// A CLI11 check for the examples' and benchmarks' numeric flags. CLI11's own PositiveNumber rejects
// 0 with "Value 0 not in range 0.000000 to 1797693134862315708145274237317043567981..." (DBL_MAX in
// full, 310 digits); this one says it in words: "--steps: must be a positive number, got '0'".
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace dtrain_cli {

inline CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double d = std::stod(value, &used);
          if (used == value.size() && d > 0) return "";
        } catch (const std::exception&) {
        }
        return "must be a positive number, got '" + value + "'";
      },
      "POSITIVE");
}

}  // namespace dtrain_cli
