// RNG states and per-rank values of a checkpoint (see rank_state.h).
#include "checkpoint/rank_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cstring>
#include <mutex>

#include "dtrain/errors.h"

namespace dtrain::ckpt {

namespace {

void put_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }

void put_bytes(std::string& out, const std::string& bytes) {
  put_u64(out, bytes.size());
  out += bytes;
}

struct Reader {
  const std::string& in;
  size_t pos = 0;
  uint64_t u64() {
    DTRAIN_CHECK(pos + sizeof(uint64_t) <= in.size(), "checkpoint rank state is truncated");
    uint64_t v;
    std::memcpy(&v, in.data() + pos, sizeof v);
    pos += sizeof v;
    return v;
  }
  std::string bytes(uint64_t n) {
    DTRAIN_CHECK(n <= in.size() - pos, "checkpoint rank state is truncated");
    std::string s = in.substr(pos, n);
    pos += n;
    return s;
  }
};

std::string state_bytes(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());  // as torch.get_rng_state()
  at::Tensor s = gen.get_state().contiguous();    // (N,) uint8 on the CPU
  return std::string(static_cast<const char*>(s.data_ptr()), s.numel());
}

void set_state_bytes(at::Generator gen, const std::string& bytes) {
  at::Tensor s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

// The CUDA generator of this process's current device, when this LibTorch and machine have CUDA
// (the hooks answer false in a CPU-only build, so this compiles and runs everywhere).
bool has_cuda() { return at::detail::getCUDAHooks().hasCUDA(); }
at::Generator cuda_generator() {
  // Through the context: the hooks' own accessor was renamed in 2.x (getDefaultCUDAGenerator ->
  // getDefaultGenerator); Context::defaultGenerator(device) exists in both.
  const auto index = static_cast<c10::DeviceIndex>(at::detail::getCUDAHooks().current_device());
  return at::globalContext().defaultGenerator(at::Device(at::kCUDA, index));
}

}  // namespace

std::string pack_rank_state(bool rng, const RankState& state) {
  std::string out;
  put_bytes(out, rng ? state_bytes(at::detail::getDefaultCPUGenerator()) : std::string());
  put_bytes(out, rng && has_cuda() ? state_bytes(cuda_generator()) : std::string());
  put_u64(out, state.values.size());
  for (const auto& [key, value] : state.values) {
    put_bytes(out, key);
    out.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  put_u64(out, static_cast<uint64_t>(state.sampler_rank));
  put_u64(out, static_cast<uint64_t>(state.sampler_position));
  return out;
}

namespace {

struct Parsed {
  std::string cpu, cuda;
  RankState state;
};

Parsed parse_pack(const std::string& pack) {
  Reader r{pack};
  Parsed p;
  p.cpu = r.bytes(r.u64());
  p.cuda = r.bytes(r.u64());
  for (uint64_t n = r.u64(); n > 0; --n) {
    std::string key = r.bytes(r.u64());
    const std::string v = r.bytes(sizeof(double));
    double value;
    std::memcpy(&value, v.data(), sizeof value);
    p.state.values[key] = value;
  }
  if (r.pos < pack.size()) {  // written since resharding
    p.state.sampler_rank = static_cast<int64_t>(r.u64());
    p.state.sampler_position = static_cast<int64_t>(r.u64());
  }
  return p;
}

}  // namespace

RankState read_rank_state(const std::string& pack) { return parse_pack(pack).state; }

void restore_rng(const std::string& pack) {
  const Parsed p = parse_pack(pack);
  if (!p.cpu.empty()) set_state_bytes(at::detail::getDefaultCPUGenerator(), p.cpu);
  if (!p.cuda.empty() && has_cuda()) set_state_bytes(cuda_generator(), p.cuda);
}

void derive_rng(const std::string& pack, int64_t rank) {
  const Parsed p = parse_pack(pack);
  if (p.cpu.empty()) return;  // saved without RNG states: nothing to derive from
  at::Generator source = at::make_generator<at::CPUGeneratorImpl>();
  set_state_bytes(source, p.cpu);
  uint64_t seed = source.get<at::CPUGeneratorImpl>()->random64();
  // splitmix64's finalizer over seed + rank: neighbouring ranks get unrelated seeds.
  seed += 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(rank + 1);
  seed = (seed ^ (seed >> 30)) * 0xBF58476D1CE4E5B9ULL;
  seed = (seed ^ (seed >> 27)) * 0x94D049BB133111EBULL;
  seed ^= seed >> 31;
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_current_seed(seed);
  }
  if (has_cuda()) {
    at::Generator cuda = cuda_generator();
    std::lock_guard<std::mutex> lock(cuda.mutex());
    cuda.set_current_seed(seed);
  }
}

}  // namespace dtrain::ckpt
