// dcp::save's plan (dtrain/dcp.h, steps 2-3): each rank's items as text for the all-gather, and the
// choice of one writer for every item that several ranks hold. Pure functions of the gathered
// plans, so that every rank computes the same answer.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "dtrain/dcp.h"

namespace dtrain::dcp::detail {

struct PlanItem {
  std::string fqn;
  bool is_tensor = false;
  std::string dtype;     // tensors
  Shape global;          // tensors: the whole's shape
  Shape offsets, sizes;  // tensors: this chunk's
  int64_t bytes = 0;
  Path path;
  int entry = -1;        // the index of its entry in the rank's own state dict (not sent)
  bool dropped = false;  // a replica's chunk that another cut of the same rows stands for (not sent)

  // What identifies a stored item: the key and, for a tensor, the chunk's offsets.
  std::pair<std::string, std::optional<Shape>> id() const {
    return {fqn, is_tensor ? std::optional<Shape>(offsets) : std::nullopt};
  }
};

std::vector<PlanItem> plan_of(const StateDict& sd);
std::string encode_plan(const std::vector<PlanItem>& plan);
std::vector<PlanItem> decode_plan(const std::string& text);

// Marks `dropped` the chunks that overlap other chunks of the same key without being equal to them
// (Note [Replicas cut unlike]), keeping a set of chunks that covers each whole tensor once. Throws
// dtrain::Error naming the key when no such set exists.
void drop_overlapping_chunks(std::vector<std::vector<PlanItem>>& plans);

// For every rank, the indices into its plan of the items it writes: each item once, by the holder
// with the fewest bytes so far (ties: the lowest rank), in the order items first appear. Throws
// dtrain::Error naming the key and two ranks when ranks disagree on a key's kind, dtype or whole
// shape, or on a chunk's sizes.
std::vector<std::vector<size_t>> assign_writers(const std::vector<std::vector<PlanItem>>& plans);

// The metadata of a save: every key's whole shape and chunks from the plans, every written item's
// storage from `written` (per rank: the plan index of each item and where it went).
Metadata metadata_of(const std::vector<std::vector<PlanItem>>& plans,
                     const std::vector<std::vector<std::pair<size_t, StorageInfo>>>& written);

}  // namespace dtrain::dcp::detail
