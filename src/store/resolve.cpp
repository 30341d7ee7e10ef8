// Resolving the store's host name, waiting for a name that does not resolve yet (see store.h).
//
// Note [Names that resolve late]: a Kubernetes pod's DNS name (the headless service's record of the
// rank-0 pod) appears only seconds after the pods start, so a launcher or a rank that asks at once is
// told the name does not exist. EAI_NONAME, EAI_NODATA and EAI_AGAIN are therefore retried until the
// caller's timeout, with one line the first time saying what is awaited; any other failure, and a
// name still unknown at the timeout, is one error naming it. A numeric address never waits.
#include "store/protocol.h"
#include "store/store.h"

#include <netdb.h>

#include <algorithm>
#include <thread>

namespace dtrain::store {

namespace {

constexpr Millis kResolveRetry{250};

bool may_appear_later(int rc) {
#ifdef EAI_NODATA
  if (rc == EAI_NODATA) return true;
#endif
  return rc == EAI_NONAME || rc == EAI_AGAIN;
}

std::string seconds_of(Millis ms) {
  if (ms.count() >= (int64_t{1} << 39)) return "forever";
  char buf[32];
  snprintf(buf, sizeof(buf), ms.count() % 1000 == 0 ? "%.0fs" : "%.1fs", ms.count() / 1000.0);
  return buf;
}

}  // namespace

void AddrInfoDeleter::operator()(addrinfo* a) const {
  if (a) freeaddrinfo(a);
}

AddrInfoPtr resolve_waiting(const std::string& host, uint16_t port, Millis timeout, const std::string& source,
                            const std::function<void(const std::string&)>& waiting) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::min(timeout, Millis(int64_t{1} << 40));
  bool said = false;
  for (;;) {
    addrinfo* res = nullptr;
    const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc == 0) return AddrInfoPtr(res);
    if (!may_appear_later(rc))
      throw std::runtime_error("cannot resolve the rendezvous host '" + host + "': " + gai_strerror(rc) + " (check " +
                               source + ")");
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      throw std::runtime_error("the rendezvous host name '" + host + "' did not resolve within " + seconds_of(timeout) +
                               ": " + gai_strerror(rc) + " (check " + source + ", and that the host is up)");
    if (!said && waiting) {
      waiting("waiting for the rendezvous host name '" + host + "' (" + source + ") to resolve: " + gai_strerror(rc) +
              "; trying for up to " + seconds_of(timeout));
      said = true;
    }
    std::this_thread::sleep_for(std::min(kResolveRetry, std::chrono::ceil<Millis>(deadline - now)));
  }
}

}  // namespace dtrain::store
