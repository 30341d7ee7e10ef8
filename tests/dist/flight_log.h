// A dist test's own flight record, read back in process: which collectives it made, on which group,
// of how many elements.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/flight_pickle.h"
#include "dtrain/process_group.h"

// This rank's flight record, read back in process: the calls made since the last look, each as its
// group's ranks ("[0, 1]"), its dtrain operation, its input's elements and their bytes (by the
// recorded dtypes).
struct FlightCall {
  std::string ranks, op;
  int64_t numel = 0, bytes = 0;
};

// The element size of a recorded dtype (c10's name for it); 0 for one this header does not know.
inline int64_t flight_dtype_size(const std::string& dtype) {
  if (dtype == "Double" || dtype == "Long" || dtype == "ComplexFloat") return 8;
  if (dtype == "Float" || dtype == "Int") return 4;
  if (dtype == "Half" || dtype == "BFloat16" || dtype == "Short") return 2;
  if (dtype == "Byte" || dtype == "Char" || dtype == "Bool") return 1;
  return 0;
}
class FlightLog {
 public:
  explicit FlightLog(std::string reason = "test") : reason_(std::move(reason)) { take(); }
  std::vector<FlightCall> take() {
    const std::string path = dtrain::dump_flight_record(reason_);
    EXPECT_FALSE(path.empty()) << "the flight recorder is off";
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    const nlohmann::json dump = dtrain::flight::pickle::loads(bytes.str());
    std::vector<FlightCall> out;
    int64_t last = last_;
    for (const auto& e : dump.at("entries")) {
      const int64_t id = e.at("record_id").get<int64_t>();
      if (id <= last_) continue;
      last = std::max(last, id);
      FlightCall c;
      c.ranks = dump.at("pg_config").at(e.at("process_group")[0].get<std::string>()).at("ranks").get<std::string>();
      c.op = e.at("dtrain_op").get<std::string>();
      const auto& dtypes = e.at("input_dtypes");
      size_t i = 0;
      for (const auto& sizes : e.at("input_sizes")) {
        int64_t n = 1;
        for (const auto& d : sizes) n *= d.get<int64_t>();
        c.numel += n;
        const int64_t size = i < dtypes.size() ? flight_dtype_size(dtypes[i].get<std::string>()) : 0;
        EXPECT_GT(size, 0) << "a dtype the flight log does not know: " << dtypes.dump();
        c.bytes += n * size;
        ++i;
      }
      out.push_back(c);
    }
    last_ = last;
    return out;
  }

 private:
  std::string reason_;
  int64_t last_ = 0;
};

inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// The flight records a program reads back: a folder of this process's own (removed at exit) unless
// dtrain-run gave one (the default one is shared by every job of this user, whose ranks share the
// file names). Construct it first in main(), before the process group.
class OwnFlightDir {
 public:
  explicit OwnFlightDir(const std::string& prefix) : own_("/tmp/" + prefix + "_" + std::to_string(::getpid())) {
    set_here_ = ::setenv("DTRAIN_FLIGHT_DIR", own_.c_str(), /*overwrite=*/0) == 0 &&
                std::string(std::getenv("DTRAIN_FLIGHT_DIR")) == own_;
  }
  ~OwnFlightDir() {
    if (set_here_) std::filesystem::remove_all(own_);
  }

 private:
  std::string own_;
  bool set_here_ = false;
};
