// dcp::save in three phases (steps in dtrain/dcp.h), so that CheckpointManager::save_async writes a
// sharded model's items on a thread of its own while training goes on: the constructor is a
// collective (the folder prepared, the plans gathered, the writers chosen), write() writes this
// rank's file alone (no collective: any thread), finish() is a collective again (every rank's
// outcome and where its items went; rank 0 writes `.metadata` last). dcp::save is the three in a row.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_plan.h"
#include "dtrain/dcp.h"

namespace dtrain::dcp::detail {

class SaveInProgress {
 public:
  // Collective over `group`. Throws alike on every member.
  SaveInProgress(StateDict state_dict, std::string dir, Group group);
  // This rank's file; a failure is kept, and thrown on every member by finish(). Never throws.
  void write() noexcept;
  // Collective over `group`. Throws alike on every member when any failed.
  void finish();
  const std::string& dir() const { return dir_; }

 private:
  StateDict sd_;
  std::string dir_;
  Group group_;
  std::vector<PlanItem> plan_;
  std::vector<std::vector<PlanItem>> plans_;
  std::vector<size_t> mine_;
  std::vector<std::pair<size_t, StorageInfo>> written_;
  std::string error_;
};

}  // namespace dtrain::dcp::detail
