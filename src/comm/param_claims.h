// Which data-parallel wrapper holds a parameter: DistributedDataParallel and fully_shard each claim
// the parameters they synchronise, and refuse a parameter the other holds (DDP would all-reduce
// shards of different shapes; fully_shard would shard tensors whose gradients DDP's hooks copy into
// buckets). A claim ends with the tensor (held weakly) or when released.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::comm {

// Throws, naming the parameter and the holder, when one of `params` is claimed by someone else;
// otherwise claims them all for `holder` ("DistributedDataParallel", "fully_shard unit 'x'").
void claim_parameters(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                      const std::string& holder, const std::string& remedy);
void release_parameters(const std::vector<at::Tensor>& params, const std::string& holder);
// Who holds `param` ("" if nobody does).
std::string holder_of(const at::Tensor& param);

}  // namespace dtrain::comm
