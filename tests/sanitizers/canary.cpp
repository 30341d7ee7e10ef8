// Proof that the sanitizers are on in a DTRAIN_SANITIZE tree: scripts/sanitize.sh runs each mode
// and requires the matching report and a failing exit status before it trusts a clean test run.
// heap, ub and leak are for the ON tree (AddressSanitizer + UBSan), race for the thread tree.
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {
int g_shared = 0;  // written by two threads without a lock: the race canary's data race
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  volatile int n = argc > 2 ? std::atoi(argv[2]) : 8;
  if (std::strcmp(mode, "heap") == 0) {  // AddressSanitizer: heap-buffer-overflow
    char* p = static_cast<char*>(std::malloc(n));
    p[n] = 1;
    std::free(p);
  } else if (std::strcmp(mode, "ub") == 0) {  // UndefinedBehaviorSanitizer: signed integer overflow
    volatile int big = INT_MAX;
    std::printf("%d\n", big + n);
  } else if (std::strcmp(mode, "leak") == 0) {  // LeakSanitizer
    void* volatile p = std::malloc(1000 + n);
    p = nullptr;
    (void)p;
  } else if (std::strcmp(mode, "race") == 0) {  // ThreadSanitizer: data race
    std::thread t([&] { g_shared += n; });
    g_shared += n;
    t.join();
    std::printf("%d\n", g_shared);
  } else {
    std::fprintf(stderr, "sanitizer_canary: mode must be heap, ub, leak or race, got '%s'\n", mode);
    return 2;
  }
  return 0;
}
