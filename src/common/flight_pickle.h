// Flight-record dumps as pickles of JSON values. Torch-free: libdtrain writes dumps with it and
// dtrain-run reads them back, over the one pickle reader and writer (common/pickle.h).
//
// PyTorch's flight recorder writes its dumps as a pickled dict, and its analyzer
// (`python -m torch.distributed.flight_recorder.fr_trace DIR`) reads them with pickle.load. dtrain
// writes the same dict (docs/troubleshooting.md, "My job hangs"), so both tools read both.
//
//   nlohmann::json d = {{"version", "2.10"}, {"entries", nlohmann::json::array()}};
//   std::string bytes = dtrain::flight::pickle::dumps(d);   // protocol 2
//   nlohmann::json back = dtrain::flight::pickle::loads(bytes);
//
// dumps writes None, bool, int (64-bit), float, str, list and dict (string keys): what JSON holds.
// loads reads protocols 2 to 5 as Python's pickle.dumps writes these types, tuples as lists, and
// memo references; anything else (a global or object, bytes, a set, non-text keys) throws
// std::runtime_error ("pickle: ..." naming what it found, or the byte offset).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace dtrain::flight::pickle {

std::string dumps(const nlohmann::json& value);
// Throws std::runtime_error ("pickle: ...") on data outside the subset or cut short.
nlohmann::json loads(const std::string& bytes);

}  // namespace dtrain::flight::pickle
