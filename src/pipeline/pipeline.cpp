// dtrain::Pipeline: stages on ranks, micro-batches through a schedule, the failure protocol and the
// optional DDP inside each stage group (the contract: include/dtrain/pipeline.h).
//
// Protocol of one step (every rank of the pipeline calls step()):
//   1. The first stage splits the batch into `chunks` micro-batches along dim 0 (at::chunk); the last
//      stage splits the target the same way.
//   2. Each rank runs its schedule, a list of F(i) / B(i) / W(i) actions, each for one of its stages
//      (src/pipeline/schedule.cpp gives the orders as numbered steps):
//        GPipe: F(0..m-1), then B(m-1..0): every micro-batch's activations are stored at once (m).
//        1F1B:  min(p-s-1, m) warm-up forwards, then alternate one forward / one backward, then the
//               remaining backwards: stage s stores at most min(p-s, m) <= p micro-batches.
//        Interleaved 1F1B (Megatron): the same over v chunks per rank, p micro-batches per chunk in
//               turn; m must be a multiple of p. The bubble shrinks v-fold; rank r stores at most
//               min((v-1)p + 2(p-r-1) + 1, mv) chunk-micro-batches.
//        ZB-H1: 1F1B whose backward is split into B (the input gradient, which stage s-1 waits for)
//               and W (the weight gradients), stage s holding back s W's to run in the cool-down's
//               bubble. B and W of one micro-batch share its autograd graph (src/pipeline/split_backward.h).
//      F(i) receives the activation from stage s-1 (or takes input chunk i), runs the stage, and sends
//      the output to stage s+1 (or computes loss_fn(out_i, target_i) * n_i / N on the last stage, so
//      the summed gradient equals the whole batch's mean-loss gradient). B(i) receives the output's
//      gradient from stage s+1 (or backpropagates the loss), runs backward, and sends the input's
//      gradient to stage s-1 (under ZB-H1, B sends it and a later W adds the weight gradients).
//      Gradients accumulate in the parameters over the micro-batches.
//      Every message is a small header (status, dtype, message id, shape) then the tensor, sent
//      asynchronously; the receiver checks the id (the boundary and the micro-batch).
//   3. Agreement: one all-reduce over the pipeline group (over all ranks with replicas > 1) carries
//      the loss to every rank and tells whether any rank failed (Note [pipeline failure]).
//   4. With replicas > 1, DDP (over the ranks holding the same stage) averages the accumulated
//      gradients; then the caller's optimizer steps on every rank.
//
// Note [pipeline failure]: a stage that throws (its forward, backward, weight gradient or the loss) must
// make every rank fail with that error, without hanging. The failing rank writes its message to the
// job's store, sends a FAIL message on both of its outgoing channels (to the next rank and to the
// previous one; with virtual stages they form a ring and every rank has both), and goes to
// the agreement. A rank that receives FAIL where it expected data does the same (without a message),
// so every rank blocked on a receive is released: the chain of waits ends at a failed rank. The
// agreement then tells everyone which ranks failed (the lowest one's message is used); every rank
// sends FAIL on the channels it has not yet, reads each incoming channel up to its FAIL (so no send
// stays unmatched: Gloo's send completes only when it is received), and throws
//   "rank R: pipeline step K failed: stage S (rank Q) failed in forward of micro-batch I: <what>".
// The pipeline stays usable after that (the channels are empty). With replicas, the agreement spans
// every rank and comes before DDP's all-reduce, so no replica waits in a collective for a failed one.
//
// Boundary check: at the first step, a stage whose forward rejects what its predecessor sent fails with
// an error naming both stages and the shape; a received gradient must have the sent activation's shape.
#include "dtrain/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <limits>
#include <sstream>

#include "comm/state.h"
#include "dtrain/data_parallel.h"  // balance_by_size
#include "comm/tags.h"
#include "pipeline/impl.h"

namespace dtrain {

using pipeline::Links;

namespace {

// Point-to-point tags of the pipelines (2 per pipeline on a group): comm/tags.h.
constexpr int kTagBase = comm::kPipelineTagBase;

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " (" << t.scalar_type() << ")";
  return os.str();
}

}  // namespace

void Pipeline::Impl::init(std::vector<torch::nn::Sequential> parts, bool whole_model) {
  DTRAIN_CHECK(options.chunks() >= 1, "PipelineOptions: chunks must be >= 1, got ", options.chunks());
  if (const DeviceMesh& mesh = options.mesh(); mesh.ndim() > 0) {
    DTRAIN_CHECK(mesh.ndim() == 1, "PipelineOptions: mesh has ", mesh.ndim(),
                 " dimensions; a pipeline runs over a 1-D mesh: pass the pipeline dimension's sub-mesh, e.g. "
                 "mesh[\"pp\"]");
    const Group group = mesh.get_group();
    DTRAIN_CHECK(options.process_group().name() == Group().name() || options.process_group().name() == group.name(),
                 "PipelineOptions: both mesh (group '", group.name(), "') and process_group ('",
                 options.process_group().name(), "') are set: set one of the two");
    DTRAIN_CHECK(options.replicas() == 1, "PipelineOptions: mesh and replicas(", options.replicas(),
                 ") are both set: replicas lays out the whole world itself; with a mesh, give the pipeline its "
                 "\"pp\" sub-mesh and build the data-parallel replicas over the mesh's other dimension");
    options.process_group(group);
  }
  layout = pipeline::make_layout(options.process_group(), options.replicas(), options.virtual_stages());
  pipeline::check_schedule(options.schedule(), layout.stages, options.chunks(), layout.virtual_stages);
  const int p = layout.stages, v = layout.virtual_stages, total = p * v;
  // "4 ranks", or "8 stages (4 ranks x 2 virtual stages)": what a balance or a stage list must match.
  const std::string shape =
      v == 1 ? detail::cat(p, " ranks") : detail::cat(total, " stages (", p, " ranks x ", v, " virtual stages)");
  std::vector<torch::nn::Sequential> all;  // every global stage's module (whole model) or the given list
  if (whole_model) {
    torch::nn::Sequential model = parts.at(0);
    DTRAIN_CHECK(!model.is_empty(), "Pipeline: the Sequential is null: pass a constructed model");
    const int64_t layers = static_cast<int64_t>(model->size());
    balance = options.balance();
    if (balance.empty()) {
      std::vector<int64_t> sizes;
      for (const auto& layer : *model) {
        int64_t numel = 0;
        for (const auto& param : layer.ptr()->parameters()) numel += param.numel();
        sizes.push_back(numel);
      }
      balance = balance_by_size(sizes, total);
    }
    DTRAIN_CHECK(static_cast<int>(balance.size()) == total, "Pipeline: balance has ", balance.size(),
                 " stages but the pipeline has ", shape, ": give one layer count per stage");
    int64_t sum = 0;
    for (int64_t b : balance) {
      DTRAIN_CHECK(b > 0, "Pipeline: every stage needs at least one layer, balance has ", b);
      sum += b;
    }
    DTRAIN_CHECK(sum == layers, "Pipeline: balance sums to ", sum, " layers but the Sequential has ", layers,
                 ": make the counts add up");
    auto it = model->begin();
    for (int k = 0; k < total; ++k) {
      torch::nn::Sequential stage;
      for (int64_t j = 0; j < balance[k]; ++j, ++it) stage->push_back(*it);
      all.push_back(stage);
    }
  } else {
    DTRAIN_CHECK(options.balance().empty(),
                 "Pipeline: balance is for a whole Sequential; with one module per "
                 "stage leave it empty");
    DTRAIN_CHECK(static_cast<int>(parts.size()) == total, "Pipeline: ", parts.size(),
                 " stage modules given but the pipeline has ", shape, ": give one module per stage");
    for (int k = 0; k < total; ++k) {
      DTRAIN_CHECK(!parts[k].is_empty(), "Pipeline: stage module ", k, " is null");
      balance.push_back(static_cast<int64_t>(parts[k]->size()));
    }
    all = std::move(parts);
  }
  for (int c = 0; c < v; ++c) {
    const int k = pipeline::global_stage(layout, c);
    int64_t first = 0;
    for (int j = 0; j < k; ++j) first += balance[j];
    first_layers.push_back(first);
    chunks.push_back(all[k]);
    if (split_backward()) pipeline::check_split_backward(all[k], k);
  }
  held = chunks[0].ptr();
  if (v > 1) {
    held = std::make_shared<torch::nn::Module>("PipelineChunks");
    for (int c = 0; c < v; ++c) held->register_module(std::to_string(c), chunks[c].ptr());
  }
  const auto params = held->parameters();
  if (!params.empty()) device = params[0].device();
  // Note [Group-agreed ids]: numbered on the agreement group, whose ranks all build this pipeline and
  // read each other's error keys. Its links' group is that group (replicas == 1) or a group just made
  // for this pipeline, so no other pipeline's messages share their tags.
  const int64_t index = layout.agreement.next_object_index();
  DTRAIN_ASSERT(index < (std::numeric_limits<int>::max() - kTagBase) / 2, "pipeline tags exhausted on a group");
  store_prefix = detail::cat("pipeline/", layout.agreement.name(), "/", index, "/");
  links = std::make_unique<Links>(layout.pipeline, layout.prev, layout.next, kTagBase + 2 * static_cast<int>(index),
                                  device);
  if (layout.replicas > 1) {
    DDPOptions o = options.ddp();
    o.process_group(layout.stage_group);
    ddp = std::make_unique<detail::DDPCore>(held, std::move(o));
  }
}

at::Tensor Pipeline::Impl::run_forward(int k, const at::Tensor& x, int64_t i,
                                       std::vector<pipeline::WeightPart>* parts) {
  torch::nn::Sequential stage = chunks[pipeline::chunk_of(layout, k)];
  auto forward = [&] { return parts ? pipeline::forward_recording(stage, x, *parts) : stage->forward(x); };
  if (k == 0 || steps > 1 || i > 0) return forward();
  // First step, first micro-batch: torch rejecting the predecessor's output (a c10::Error, e.g. "mat1
  // and mat2 shapes cannot be multiplied") is a boundary mismatch; other exceptions pass unchanged.
  try {
    return forward();
  } catch (const c10::Error& e) {
    const int64_t first = first_layers[pipeline::chunk_of(layout, k)];
    throw Error(detail::cat("pipeline boundary mismatch: stage ", k - 1, " (rank ", links->peer_rank(Links::kPrev),
                            ") outputs ", describe(x), " but stage ", k, " (rank ", dtrain::rank(), ", layers ", first,
                            "..", first + balance[k] - 1, ") cannot take it: ", brief(e),
                            " -- check the balance or the stage modules"));
  }
}

std::string Pipeline::Impl::what_failed(int k, const std::string& action, const std::exception& e) const {
  return detail::cat("stage ", k, " (rank ", dtrain::rank(), ") failed in ", action, ": ", brief(e));
}

// Note [pipeline failure], after the agreement: end every channel, read them empty, then throw the
// message of the lowest failed rank (from the store) on every rank.
void Pipeline::Impl::fail_step(const at::Tensor& agreement) {
  try {
    links->send_fail();
    links->drain();
    links->finish_step();
  } catch (const std::exception& e) {
    warn_once("pipeline-drain", detail::cat("pipeline: cleaning up after a failed step failed too: ", brief(e)));
  }
  const double* a = agreement.data_ptr<double>();
  int origin = -1;
  for (int r = 0; r < layout.agreement.size() && origin < 0; ++r)
    if (a[1 + r] > 0) origin = layout.agreement.ranks()[r];
  std::string msg = "unknown failure";
  if (origin >= 0) {
    const auto bytes = default_store()->get(detail::cat(store_prefix, steps, "/error/", origin));
    msg.assign(bytes.begin(), bytes.end());
  }
  throw Error(detail::cat("rank ", dtrain::rank(), ": pipeline step ", steps, " failed: ", msg));
}

// DDP inside the stage group: the micro-batches' backwards ran with DDP unarmed (gradients only
// accumulated); one synchronized backward of a zero-valued function of every parameter adds zeros and
// fires DDP's hooks, so its buckets all-reduce the accumulated gradients (as the first synchronized
// backward after no_sync does). It runs after the agreement, so a failed replica never leaves the
// others waiting in this all-reduce.
void Pipeline::Impl::sync_replicas() {
  at::Tensor zero;
  for (const auto& param : held->parameters()) {
    if (!param.requires_grad()) continue;
    at::Tensor term = (param * 0).sum();
    zero = zero.defined() ? zero + term : term;
  }
  ddp->post_forward({zero});
  zero.backward();
}

Pipeline::Pipeline(torch::nn::Sequential model, PipelineOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->init({std::move(model)}, /*whole_model=*/true);
}

Pipeline::Pipeline(std::vector<torch::nn::Sequential> stages, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->init(std::move(stages), /*whole_model=*/false);
}

Pipeline::~Pipeline() = default;

const torch::nn::Sequential& Pipeline::stage_module() const {
  DTRAIN_CHECK(impl_->chunks.size() == 1, "Pipeline::stage_module: this rank holds ", impl_->chunks.size(),
               " virtual stages: use stage_modules()");
  return impl_->chunks[0];
}
const std::vector<torch::nn::Sequential>& Pipeline::stage_modules() const { return impl_->chunks; }
std::vector<at::Tensor> Pipeline::parameters() const { return impl_->held->parameters(); }
int Pipeline::stage() const { return impl_->layout.stage; }
int Pipeline::num_stages() const { return impl_->layout.stages; }
int Pipeline::virtual_stages() const { return impl_->layout.virtual_stages; }
int Pipeline::replica() const { return impl_->layout.replica; }
const std::vector<int64_t>& Pipeline::balance() const { return impl_->balance; }
int64_t Pipeline::first_layer(int chunk) const {
  DTRAIN_CHECK(chunk >= 0 && chunk < static_cast<int>(impl_->first_layers.size()), "Pipeline::first_layer: chunk ",
               chunk, " is not in [0, ", impl_->first_layers.size(), ")");
  return impl_->first_layers[chunk];
}
const PipelineOptions& Pipeline::options() const { return impl_->options; }
const Group& Pipeline::pipeline_group() const { return impl_->layout.pipeline; }
const Group& Pipeline::stage_group() const { return impl_->layout.stage_group; }
int64_t Pipeline::max_live_micro_batches() const { return impl_->stats.max_live_micro_batches; }
const PipelineStepStats& Pipeline::last_step_stats() const { return impl_->stats; }

}  // namespace dtrain
