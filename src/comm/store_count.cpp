#include "comm/store_count.h"

#include <algorithm>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dtrain/errors.h"

namespace dtrain::comm {

void wait_for_count(c10d::Store& store, const std::string& key, int64_t n, std::chrono::milliseconds timeout,
                    const std::string& context, const std::string& remedy) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Polled with add(0): every store has it (c10d's wait takes keys, not values). Quick at first, since
  // members usually arrive together, then at most every 10 ms so a long wait does not load the store.
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    const int64_t got = store.add(key, 0);
    if (got >= n) return;
    DTRAIN_CHECK(std::chrono::steady_clock::now() < deadline, context, ": only ", got, " of ", n,
                 " members reached store key '", key, "' within ", timeout.count(), " ms (", n - got,
                 " missing): ", remedy);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(10));
  }
}

}  // namespace dtrain::comm
