// Errors in a program that runs on every rank (train_fashion_mnist, train_llm): one failing rank
// stops all of them with its message on one line, instead of leaving the others to hang in the next
// collective.
#pragma once

#include <string>

#include <c10/util/Exception.h>

#include "dtrain/errors.h"
#include "dtrain/process_group.h"

namespace train {

// Error text on one line (c10::Error messages may span several).
inline std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

// True on every rank iff `ok` on every rank.
inline bool all_ranks_ok(bool ok) {
  return dtrain::all_reduce_values(std::vector<int64_t>{ok ? 1 : 0}, dtrain::ReduceOp::MIN)[0] == 1;
}

// Runs `fn` on every rank (or on the ranks where this_rank_runs) and rethrows its failure on every rank.
template <typename Fn>
void collectively(const std::string& what, bool this_rank_runs, Fn&& fn) {
  std::string error;
  if (this_rank_runs) {
    try {
      fn();
    } catch (const c10::Error& e) {
      error = one_line(e.what_without_backtrace());
    } catch (const std::exception& e) {
      error = one_line(e.what());
    }
  }
  if (!all_ranks_ok(error.empty()))
    throw dtrain::Error(error.empty() ? what + " failed on another rank (see its error)" : error);
}

}  // namespace train
