// Fuzz target: Slurm's host lists and task counts (src/common/slurm.h), as SLURM_STEP_NODELIST and
// SLURM_STEP_TASKS_PER_NODE hold them ("node[01-04,07],gpu5", "2(x3),1"). A clean dtrain::Error is
// the expected answer to a malformed list; a crash, a leak or undefined behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/slurm.h"
#include "dtrain/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string list(reinterpret_cast<const char*>(data), size);
  try {
    for (const std::string& host : dtrain::slurm::expand_hosts(list, "SLURM_STEP_NODELIST", "fuzz"))
      if (host.empty()) __builtin_trap();  // an empty host name is refused, never returned
  } catch (const dtrain::Error&) {
  }
  try {
    (void)dtrain::slurm::expand_counts(list, "SLURM_STEP_TASKS_PER_NODE", "fuzz");
  } catch (const dtrain::Error&) {
  }
  return 0;
}
