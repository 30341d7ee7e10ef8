// The one translation unit that includes LibTorch's ProcessGroupGloo.hpp. It compiles against the
// opaque gloo headers in src/compat/gloo_opaque (see the README there): LibTorch downloads ship no gloo
// headers, and a system's gloo may differ from the one inside LibTorch, so nothing compiled here may
// depend on gloo's definitions. The process group is created by LibTorch's own (out-of-line)
// constructor; this file only fills the Options and allocates the object.
#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <ATen/ATen.h>

#include <array>

#include "comm/gloo_backend.h"
#include "common/env.h"
#include "dtrain/errors.h"

#if DTRAIN_PYTORCH_PEERS_SUPPORTED
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>
#include <torch/csrc/distributed/c10d/debug.h>
#endif

namespace dtrain::comm {

// gloo::Context and gloo::rendezvous::Store are opaque classes of at least kPoisonBytes; a c10d
// object that held one by value would be at least that large. These two sizes are what this file
// allocates, so they must come from c10d's own members alone (ctest gloo_opaque_check covers the
// code side: no gloo symbol is defined or referenced here).
static_assert(sizeof(c10d::ProcessGroupGloo) < gloo::opaque::kPoisonBytes,
              "ProcessGroupGloo holds a gloo object by value: its size depends on gloo's headers");
static_assert(sizeof(c10d::ProcessGroupGloo::Options) < gloo::opaque::kPoisonBytes,
              "ProcessGroupGloo::Options holds a gloo object by value");

compat::BackendPtr make_gloo_backend(const BackendConfig& c) {
  auto opts = c10d::ProcessGroupGloo::Options::create(c.timeout);
  for (const std::string& iface : env::list("GLOO_SOCKET_IFNAME"))
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
  if (opts->devices.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(c.bind_address));
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, c.rank, c.size, opts);
}

compat::BackendPtr make_pytorch_gloo_backend(const BackendConfig& c) {
#if DTRAIN_PYTORCH_PEERS_SUPPORTED
  // Python's ProcessGroupGloo binding: the default options (devices from GLOO_SOCKET_IFNAME or the
  // host's address, TORCH_GLOO_LAZY_INIT, two threads per device), then its group name. Every rank
  // must have the same number of devices: each is a context Gloo connects through the store.
  auto opts = c10d::ProcessGroupGloo::Options::create_default(c.timeout);
  opts->group_name = c.python_group;
  c10::intrusive_ptr<c10d::Backend> pg = c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, c.rank, c.size, opts);
  // Note [PyTorch peers' DETAIL checks]: with TORCH_DISTRIBUTED_DEBUG=DETAIL Python wraps each group's
  // backend in c10d's ProcessGroupWrapper, whose helper Gloo group (under "pg_wrapper:<name>" on the
  // same store) runs a monitored barrier and compares every collective's fingerprint before it runs.
  // The Python ranks then wait for those checks on every rank, so a dtrain rank wraps its group in the
  // same LibTorch class: the checks match by construction, and a mismatch is reported on every rank.
  static const bool detail = [] {
    c10d::setDebugLevelFromEnvironment();  // what Python does on import
    return c10d::debug_level() == c10d::DebugLevel::Detail;
  }();
  if (!detail) return pg;
  auto helper_store = c10::make_intrusive<c10d::PrefixStore>("pg_wrapper:" + c.python_group, c.store);
  auto helper = c10::make_intrusive<c10d::ProcessGroupGloo>(helper_store, c.rank, c.size,
                                                            c10d::ProcessGroupGloo::Options::create_default(c.timeout));
  return c10::make_intrusive<c10d::ProcessGroupWrapper>(pg, helper);
#else
  (void)c;
  throw Error("joining Python ranks needs dtrain built against LibTorch 2.x");
#endif
}

namespace {

// Note [Gloo's dtypes]: which dtypes LibTorch's Gloo takes depends on the release (1.13 has no
// BFloat16 and no Bool; 2.15 has both), and the list sits where dtrain cannot compile it (a switch
// in 1.13's ProcessGroupGloo.cpp; in 2.x a header that needs gloo's own headers). An unsupported
// dtype fails only once the collective runs, on Gloo's thread ("Invalid scalar type"), after the
// shared-memory group's guard already exchanged the call. So dtrain asks the library it runs with,
// before a call is started: once per process, a one-rank Gloo group on loopback all-reduces one
// element of each candidate dtype. Every Gloo collective dispatches on the dtype through that same
// switch, so the all-reduce's answer holds for each kind (the collectives' differential test runs
// each kind on each dtype Gloo is said to take, and checks the answer for BFloat16 per release).
struct GlooDtypes {
  std::array<bool, static_cast<size_t>(c10::ScalarType::NumOptions)> takes{};
  bool probed = false;
};

GlooDtypes probe_gloo_dtypes() {
  GlooDtypes d;
  try {
    auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    opts->threads = 1;
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::HashStore>(), 0, 1, opts);
    for (c10::ScalarType t : {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong, at::kHalf, at::kFloat, at::kDouble,
                              at::kComplexFloat, at::kComplexDouble, at::kBool, at::kBFloat16}) {
      std::vector<at::Tensor> v{at::zeros({1}, at::TensorOptions().dtype(t))};
      try {
        pg->allreduce(v)->wait();
        d.takes[static_cast<size_t>(t)] = true;
      } catch (const std::exception&) {
      }
    }
    d.probed = true;
  } catch (const std::exception& e) {
    warn_once("gloo-dtype-probe", std::string("could not ask Gloo which dtypes it takes (a one-rank group on "
                                              "127.0.0.1 failed: ") +
                                      e.what() + "); a dtype it lacks will fail the collective when it runs");
  }
  return d;
}

}  // namespace

std::string gloo_unsupported(const at::Tensor& t) {
  if (!t.device().is_cpu() && !t.device().is_cuda())
    return detail::cat("Gloo takes CPU tensors (and CUDA tensors in a CUDA build), not ", t.device(),
                       ": move the tensor to the CPU");
  static const GlooDtypes dtypes = probe_gloo_dtypes();
  if (!dtypes.probed || dtypes.takes.at(static_cast<size_t>(t.scalar_type()))) return "";
  return detail::cat(
      "Gloo in LibTorch ", TORCH_VERSION, " has no ", t.scalar_type(), " collectives: convert the tensor",
      at::isComplexType(t.scalar_type()) ? " (at::view_as_real for SUM)" : " (e.g. to float32)", " before the call");
}

namespace {

class GlooCapabilities final : public Capabilities {
 public:
  std::string unsupported(c10d::OpType, const at::Tensor& t, const c10d::ReduceOp&) const override {
    return gloo_unsupported(t);
  }
  bool takes_base_collective(c10d::OpType, const at::Tensor&, const c10d::ReduceOp&) const override {
    return DTRAIN_GLOO_HAS_TENSOR_COLLECTIVES;
  }
  // Over Gloo's TCP a small sum costs latency, not bytes, and Gloo's all-reduce pays most of it in
  // hand-offs: a 4 KB all-reduce takes many times as long as a 4 KB send to the other rank
  // (bench_allreduce, bench_p2p). Each rank of an exchange sends (n - 1) copies where the ring
  // all-reduce sends 2 (n - 1) / n, hence a bound on the copies.
  int64_t exchange_sum_bytes() const override { return 256 * 1024; }
};

}  // namespace

Capabilities& gloo_capabilities() {
  static GlooCapabilities caps;
  return caps;
}

}  // namespace dtrain::comm
