// Fuzz target: the store's field reader (src/store/protocol.h's Reader), as the server and client
// decode a frame's payload from the network. The first input byte says how many of the next bytes
// choose the reads (str, blob, i64, taken in turn, again and again); the rest is the payload: head(),
// then those reads until one throws. std::runtime_error is the expected answer to a malformed
// payload; a crash or undefined behaviour is a finding. Every field read must also be what Writer
// encodes back into the bytes read so far.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "store/protocol.h"

using dtrain::store::detail::Reader;
using dtrain::store::detail::Writer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t nchoices = std::min<size_t>(data[0] % 16 + 1, size - 1);
  const uint8_t* choices = data + 1;
  const uint8_t* payload = data + 1 + nchoices;
  const size_t n = size - 1 - nchoices;
  Reader r(payload, n);
  try {
    Writer w(r.head());
    size_t consumed = 1;
    for (size_t i = 0; nchoices > 0; ++i) {  // ends: each read takes 4 bytes or throws
      switch (choices[i % nchoices] % 3) {
        case 0: {
          const std::string s = r.str();
          w.str(s);
          consumed += 4 + s.size();
          break;
        }
        case 1: {
          const std::vector<uint8_t> b = r.blob();
          w.blob(b);
          consumed += 4 + b.size();
          break;
        }
        default:
          w.i64(r.i64());
          consumed += 12;
      }
      const std::vector<uint8_t> again = w.frame();  // 4 bytes of length, then the payload
      if (consumed > n || again.size() != 4 + consumed || std::memcmp(again.data() + 4, payload, consumed) != 0)
        __builtin_trap();
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
