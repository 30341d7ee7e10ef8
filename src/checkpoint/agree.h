// Failures that every rank must hear of. A checkpoint step runs collectives between its parts: a
// rank whose part fails must still reach the next collective the others wait in, and every rank must
// then end with the same error. So each part runs under failure_of (its error becomes a line), and
// throw_first_failure tells every member's line to all.
//
//   ckpt::throw_first_failure(ckpt::failure_of([&] { write_my_items(); }), group, "dcp::save: ");
#pragma once

#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include "dtrain/process_group.h"
#include "common/util.h"

namespace dtrain::ckpt {

// Runs f; its failure as one line (no backtrace) instead of an exception, "" when it succeeded.
template <class F>
std::string failure_of(F&& f) {
  try {
    f();
    return "";
  } catch (const c10::Error& e) {
    return util::one_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return util::one_line(e.what());
  }
}

// Collective over `group` (local when no process group is initialized): the first member's non-empty
// line is thrown on every member alike, as dtrain::Error "<what>rank R: <line>" (R its global rank)
// when the group has several members, "<what><line>" when it has one.
void throw_first_failure(const std::string& mine, const Group& group = Group(), const std::string& what = "");

}  // namespace dtrain::ckpt
