// The claims of data-parallel wrappers on parameters (see param_claims.h).
#include "comm/param_claims.h"

#include <mutex>
#include <unordered_map>

#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

struct Claim {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  std::string holder;
};

std::mutex mu;
std::unordered_map<const c10::TensorImpl*, Claim>& claims() {
  static std::unordered_map<const c10::TensorImpl*, Claim> c;
  return c;
}

}  // namespace

void claim_parameters(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                      const std::string& holder, const std::string& remedy) {
  std::lock_guard<std::mutex> lock(mu);
  auto& c = claims();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = c.find(params[i].unsafeGetTensorImpl());
    if (it == c.end() || it->second.tensor.expired()) continue;
    const bool same_kind = it->second.holder.rfind(holder.substr(0, holder.find(' ')), 0) == 0;
    DTRAIN_CHECK(same_kind, holder, ": parameter '", names[i], "' is already held by ", it->second.holder, ": ",
                 remedy);
  }
  for (const at::Tensor& p : params)
    c.insert_or_assign(p.unsafeGetTensorImpl(),
                       Claim{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), holder});
}

void release_parameters(const std::vector<at::Tensor>& params, const std::string& holder) {
  std::lock_guard<std::mutex> lock(mu);
  auto& c = claims();
  for (const at::Tensor& p : params) {
    auto it = c.find(p.unsafeGetTensorImpl());
    if (it != c.end() && it->second.holder == holder) c.erase(it);
  }
}

std::string holder_of(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(mu);
  auto& c = claims();
  auto it = c.find(param.unsafeGetTensorImpl());
  return it == c.end() || it->second.tensor.expired() ? std::string() : it->second.holder;
}

}  // namespace dtrain::comm
