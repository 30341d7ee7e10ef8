// dtrain::Pipeline: stages on ranks, micro-batches through a schedule, the failure protocol and the
// optional DDP inside each stage group (protocol and notes in include/dtrain/pipeline.h).
#include "dtrain/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <limits>
#include <optional>
#include <sstream>

#include "comm/state.h"
#include "dtrain/data_parallel.h"  // balance_by_size
#include "pipeline/layout.h"
#include "pipeline/links.h"

namespace dtrain {

using pipeline::Action;
using pipeline::Links;
using pipeline::PeerFailed;

namespace {

// Point-to-point tags of the pipelines (2 per pipeline on a group), far from the small tags users pick.
constexpr int kTagBase = 0x70000000;

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " (" << t.scalar_type() << ")";
  return os.str();
}

}  // namespace

struct Pipeline::Impl {
  PipelineOptions options;
  pipeline::Layout layout;
  torch::nn::Sequential stage_module{nullptr};
  std::vector<int64_t> balance;
  int64_t first_layer = 0;
  c10::Device device{at::kCPU};
  std::unique_ptr<Links> links;
  std::unique_ptr<ddp::Core> ddp;  // replicas > 1
  std::string store_prefix;        // this pipeline's keys in the job store (Note [Group-agreed ids])
  int64_t steps = 0;
  PipelineStepStats stats;

  // One micro-batch's stored activations between its forward and its backward.
  struct Live {
    at::Tensor input;   // the received activation (a leaf requiring grad) or the input chunk
    at::Tensor output;  // what backward starts from: the sent output, or the weighted loss
  };

  void init(std::vector<torch::nn::Sequential> stages_or_model, bool whole_model);
  at::Tensor run_forward(const at::Tensor& x, int64_t i);
  std::string what_failed(const std::string& action, const std::exception& e) const;
  [[noreturn]] void fail_step(const at::Tensor& agreement);
  void sync_replicas();
};

void Pipeline::Impl::init(std::vector<torch::nn::Sequential> parts, bool whole_model) {
  DTRAIN_CHECK(options.chunks() >= 1, "PipelineOptions: chunks must be >= 1, got ", options.chunks());
  layout = pipeline::make_layout(options.group(), options.replicas());
  const int p = layout.stages, s = layout.stage;
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
      balance = balance_by_size(sizes, p);
    }
    DTRAIN_CHECK(static_cast<int>(balance.size()) == p, "Pipeline: balance has ", balance.size(),
                 " stages but the pipeline has ", p, " ranks: give one layer count per stage");
    int64_t total = 0;
    for (int64_t b : balance) {
      DTRAIN_CHECK(b > 0, "Pipeline: every stage needs at least one layer, balance has ", b);
      total += b;
    }
    DTRAIN_CHECK(total == layers, "Pipeline: balance sums to ", total, " layers but the Sequential has ", layers,
                 ": make the counts add up");
    for (int k = 0; k < s; ++k) first_layer += balance[k];
    stage_module = torch::nn::Sequential();
    auto it = model->begin() + first_layer;
    for (int64_t k = 0; k < balance[s]; ++k, ++it) stage_module->push_back(*it);
  } else {
    DTRAIN_CHECK(options.balance().empty(),
                 "Pipeline: balance is for a whole Sequential; with one module per "
                 "stage leave it empty");
    DTRAIN_CHECK(static_cast<int>(parts.size()) == p, "Pipeline: ", parts.size(),
                 " stage modules given but the "
                 "pipeline has ",
                 p, " ranks: give one module per stage");
    for (int k = 0; k < p; ++k) {
      DTRAIN_CHECK(!parts[k].is_empty(), "Pipeline: stage module ", k, " is null");
      balance.push_back(static_cast<int64_t>(parts[k]->size()));
      if (k < s) first_layer += balance.back();
    }
    stage_module = parts[s];
  }
  const auto params = stage_module->parameters();
  if (!params.empty()) device = params[0].device();
  // Note [Group-agreed ids]: numbered on the agreement group, whose ranks all build this pipeline and
  // read each other's error keys. Its links' group is that group (replicas == 1) or a group just made
  // for this pipeline, so no other pipeline's messages share their tags.
  const int64_t index = layout.agreement.next_object_index();
  DTRAIN_ASSERT(index < (std::numeric_limits<int>::max() - kTagBase) / 2, "pipeline tags exhausted on a group");
  store_prefix = detail::cat("pipeline/", layout.agreement.name(), "/", index, "/");
  const auto& ranks = layout.pipeline.ranks();
  links = std::make_unique<Links>(layout.pipeline, s > 0 ? ranks[s - 1] : -1, s + 1 < p ? ranks[s + 1] : -1,
                                  kTagBase + 2 * static_cast<int>(index), device);
  if (layout.replicas > 1) {
    DDPOptions o = options.ddp();
    o.process_group(layout.stage_group);
    ddp = std::make_unique<ddp::Core>(stage_module.ptr(), std::move(o));
  }
}

at::Tensor Pipeline::Impl::run_forward(const at::Tensor& x, int64_t i) {
  if (layout.stage == 0 || steps > 1 || i > 0) return stage_module->forward(x);
  // First step, first micro-batch: torch rejecting the predecessor's output (a c10::Error, e.g. "mat1
  // and mat2 shapes cannot be multiplied") is a boundary mismatch; other exceptions pass unchanged.
  try {
    return stage_module->forward(x);
  } catch (const c10::Error& e) {
    throw Error(detail::cat("pipeline boundary mismatch: stage ", layout.stage - 1, " (rank ",
                            links->peer_rank(Links::kPrev), ") outputs ", describe(x), " but stage ", layout.stage,
                            " (rank ", dtrain::rank(), ", layers ", first_layer, "..",
                            first_layer + balance[layout.stage] - 1, ") cannot take it: ", brief(e),
                            " -- check the balance or the stage modules"));
  }
}

std::string Pipeline::Impl::what_failed(const std::string& action, const std::exception& e) const {
  return detail::cat("stage ", layout.stage, " (rank ", dtrain::rank(), ") failed in ", action, ": ", brief(e));
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
  for (const auto& param : stage_module->parameters()) {
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

PipelineStepResult Pipeline::step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  ++m.steps;
  const int64_t chunks = m.options.chunks();
  const bool first = is_first(), last = is_last();
  PipelineStepStats st;
  st.micro_batches = chunks;
  std::vector<Impl::Live> live(chunks);
  std::vector<at::Tensor> outputs(chunks);
  int64_t live_now = 0;
  double loss_sum = 0;
  std::string local_error;
  bool failed = false;
  std::string action = "preparing the step";
  try {
    std::vector<at::Tensor> in_chunks, tgt_chunks;
    if (first) {
      DTRAIN_CHECK(input.defined(), "Pipeline::step: the first stage needs the input batch, got an undefined tensor");
      DTRAIN_CHECK(input.dim() >= 1 && input.size(0) >= chunks, "Pipeline::step: a batch of ",
                   input.dim() ? input.size(0) : 0, " samples cannot make chunks=", chunks,
                   " micro-batches: use a batch of at least `chunks` samples");
      in_chunks = input.chunk(chunks, 0);
      DTRAIN_CHECK(static_cast<int64_t>(in_chunks.size()) == chunks, "Pipeline::step: a batch of ", input.size(0),
                   " samples splits into ", in_chunks.size(), " micro-batches, not chunks=", chunks,
                   ": use a batch size divisible by chunks or at least chunks * (chunks - 1)");
    }
    if (last) {
      DTRAIN_CHECK(target.defined(), "Pipeline::step: the last stage needs the target batch, got an undefined tensor");
      DTRAIN_CHECK(loss_fn, "Pipeline::step: the last stage needs a loss_fn");
      tgt_chunks = target.chunk(chunks, 0);
      DTRAIN_CHECK(static_cast<int64_t>(tgt_chunks.size()) == chunks, "Pipeline::step: the target's ", target.size(0),
                   " samples split into ", tgt_chunks.size(), " micro-batches, not chunks=", chunks);
    }
    if (m.ddp) m.ddp->pre_forward();  // buffers from the stage group's first rank, once per step
    for (const Action& a : pipeline::make_schedule(m.options.schedule(), m.layout.stages, m.layout.stage, chunks)) {
      const int64_t i = a.micro_batch;
      Impl::Live& l = live[i];
      if (a.kind == Action::kForward) {
        action = detail::cat("forward of micro-batch ", i);
        at::Tensor x = first ? in_chunks[i] : m.links->recv(Links::kPrev).requires_grad_(true);
        const auto tc = Clock::now();
        at::Tensor out = m.run_forward(x, i);
        if (last) {
          action = detail::cat("loss of micro-batch ", i);
          DTRAIN_CHECK(out.size(0) == tgt_chunks[i].size(0), "Pipeline::step: micro-batch ", i, " has ", out.size(0),
                       " outputs but ", tgt_chunks[i].size(0),
                       " targets: give the last stage the "
                       "targets of the same batch");
          at::Tensor loss = loss_fn(out, tgt_chunks[i]);
          DTRAIN_CHECK(loss.numel() == 1, "Pipeline::step: loss_fn must return a scalar, got shape ", loss.sizes());
          if (m.options.loss_reduction() == LossReduction::kMean)
            loss = loss * (static_cast<double>(tgt_chunks[i].size(0)) / static_cast<double>(target.size(0)));
          loss_sum += loss.item<double>();
          outputs[i] = out.detach();
          l = {x, loss};
        } else {
          l = {x, out};
        }
        st.compute_s += since(tc);
        if (!last) m.links->send(Links::kNext, out);
        st.max_live_micro_batches = std::max(st.max_live_micro_batches, ++live_now);
      } else {
        action = detail::cat("backward of micro-batch ", i);
        at::Tensor grad;
        if (!last) {
          grad = m.links->recv(Links::kNext);
          DTRAIN_CHECK(grad.sizes() == l.output.sizes(), "pipeline boundary mismatch: stage ", m.layout.stage + 1,
                       " (rank ", m.links->peer_rank(Links::kNext), ") returned a gradient of shape ", grad.sizes(),
                       " for stage ", m.layout.stage, "'s output of shape ", l.output.sizes());
        }
        const auto tc = Clock::now();
        if (l.output.requires_grad()) {
          if (last)
            l.output.backward();
          else
            torch::autograd::backward({l.output}, {grad});
        }
        st.compute_s += since(tc);
        if (!first) {
          at::Tensor gx = l.input.grad();
          m.links->send(Links::kPrev, gx.defined() ? gx : at::zeros_like(l.input));
        }
        l = {};
        --live_now;
      }
    }
  } catch (const PeerFailed&) {
    failed = true;
  } catch (const std::exception& e) {
    failed = true;
    local_error = m.what_failed(action, e);
  }
  live.clear();  // free the activations (and their graphs) of a failed step

  // Note [pipeline failure]: release whoever waits on us, publish our message, then agree.
  if (failed) {
    try {
      m.links->send_fail();
    } catch (const std::exception& e) {
      warn_once("pipeline-fail-send", detail::cat("pipeline: could not tell the neighbours: ", brief(e)));
    }
  }
  if (!local_error.empty())
    default_store()->set(detail::cat(m.store_prefix, m.steps, "/error/", dtrain::rank()),
                         std::vector<uint8_t>(local_error.begin(), local_error.end()));
  // [loss on the last stage, one failure flag per rank of the agreement group]
  at::Tensor agreement = at::zeros({1 + m.layout.agreement.size()}, at::kDouble);
  agreement[0] = last ? loss_sum : 0.0;
  if (!local_error.empty()) agreement[1 + m.layout.agreement.rank()] = 1.0;
  agreement = agreement.to(m.device);
  all_reduce(agreement, ReduceOp::SUM, m.layout.agreement);
  agreement = agreement.cpu();
  if (agreement.slice(0, 1).sum().item<double>() > 0 || failed) m.fail_step(agreement);
  m.links->finish_step();
  if (m.ddp) m.sync_replicas();

  st.step_s = since(t0);
  m.stats = st;
  PipelineStepResult result;
  result.loss = agreement[0].item<double>() / m.layout.replicas;
  if (last) result.output = at::cat(outputs);
  return result;
}

const torch::nn::Sequential& Pipeline::stage_module() const { return impl_->stage_module; }
std::vector<at::Tensor> Pipeline::parameters() const { return impl_->stage_module->parameters(); }
int Pipeline::stage() const { return impl_->layout.stage; }
int Pipeline::num_stages() const { return impl_->layout.stages; }
int Pipeline::replica() const { return impl_->layout.replica; }
const std::vector<int64_t>& Pipeline::balance() const { return impl_->balance; }
int64_t Pipeline::first_layer() const { return impl_->first_layer; }
const PipelineOptions& Pipeline::options() const { return impl_->options; }
const Group& Pipeline::pipeline_group() const { return impl_->layout.pipeline; }
const Group& Pipeline::stage_group() const { return impl_->layout.stage_group; }
int64_t Pipeline::max_live_micro_batches() const { return impl_->stats.max_live_micro_batches; }
const PipelineStepStats& Pipeline::last_step_stats() const { return impl_->stats; }

}  // namespace dtrain
