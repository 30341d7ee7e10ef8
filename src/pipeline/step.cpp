// Pipeline::step: the micro-batches through this rank's schedule, then the agreement (protocol and
// Note [pipeline failure] in src/pipeline/pipeline.cpp).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/state.h"
#include "pipeline/impl.h"

namespace dtrain {

using pipeline::Action;
using pipeline::Links;
using pipeline::PeerFailed;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One step's state on this rank, and the actions that change it.
struct StepRun {
  StepRun(Pipeline::Impl& impl, const at::Tensor& t, const Pipeline::LossFn& fn) : m(impl), target(t), loss_fn(fn) {}
  Pipeline::Impl& m;
  const at::Tensor& target;
  const Pipeline::LossFn& loss_fn;
  std::vector<at::Tensor> in_chunks, tgt_chunks;
  std::vector<Pipeline::Impl::Live> live;  // [chunk * chunks + micro-batch]
  std::vector<at::Tensor> outputs;         // the last stage's, per micro-batch
  PipelineStepStats st;
  int64_t live_now = 0;
  double loss_sum = 0;

  Pipeline::Impl::Live& state(const Action& a) {
    return live[pipeline::chunk_of(m.layout, a.stage) * m.options.chunks() + a.micro_batch];
  }
  // The links' receive and send, timed into the step's stats.
  at::Tensor recv(Links::Peer from, int64_t id) {
    const auto t0 = Clock::now();
    at::Tensor t = m.links->recv(from, id);
    st.recv_s += since(t0);
    return t;
  }
  void send(Links::Peer to, const at::Tensor& t, int64_t id) {
    const auto t0 = Clock::now();
    m.links->send(to, t, id);
    st.send_s += since(t0);
  }
  void forward(const Action& a, std::string& action);
  void backward(const Action& a);
  void weight(const Action& a);
};

void StepRun::forward(const Action& a, std::string& action) {
  const int k = a.stage;
  const int64_t i = a.micro_batch;
  const bool first = k == 0, last = k == m.total_stages() - 1;
  Pipeline::Impl::Live& l = state(a);
  at::Tensor x = first ? in_chunks[i] : recv(Links::kPrev, m.message_id(k - 1, i)).requires_grad_(true);
  const auto tc = Clock::now();
  at::Tensor out = m.run_forward(k, x, i, m.split_backward() ? &l.parts : nullptr);
  if (last) {
    action = detail::cat("loss of micro-batch ", i);
    DTRAIN_CHECK(out.size(0) == tgt_chunks[i].size(0), "Pipeline::step: micro-batch ", i, " has ", out.size(0),
                 " outputs but ", tgt_chunks[i].size(0), " targets: give the last stage the targets of the same batch");
    at::Tensor loss = loss_fn(out, tgt_chunks[i]);
    DTRAIN_CHECK(loss.numel() == 1, "Pipeline::step: loss_fn must return a scalar, got shape ", loss.sizes());
    if (m.options.loss_reduction() == LossReduction::kMean)
      loss = loss * (static_cast<double>(tgt_chunks[i].size(0)) / static_cast<double>(target.size(0)));
    loss_sum += loss.item<double>();
    outputs[i] = out.detach();
    l.input = x;
    l.output = loss;
  } else {
    l.input = x;
    l.output = out;
  }
  st.compute_s += since(tc);
  if (!last) send(Links::kNext, out, m.message_id(k, i));
  st.max_live_micro_batches = std::max(st.max_live_micro_batches, ++live_now);
}

// The whole backward, or under ZB-H1 its input-gradient part B (split_backward.h).
void StepRun::backward(const Action& a) {
  const int k = a.stage;
  const int64_t i = a.micro_batch;
  const bool first = k == 0, last = k == m.total_stages() - 1;
  Pipeline::Impl::Live& l = state(a);
  at::Tensor grad;
  if (!last) {
    grad = recv(Links::kNext, m.message_id(k, i));
    DTRAIN_CHECK(grad.sizes() == l.output.sizes(), "pipeline boundary mismatch: stage ", k + 1, " (rank ",
                 m.links->peer_rank(Links::kNext), ") returned a gradient of shape ", grad.sizes(), " for stage ", k,
                 "'s output of shape ", l.output.sizes());
  }
  const auto tc = Clock::now();
  at::Tensor gx;
  if (m.split_backward()) {
    gx = pipeline::backward_input(l.output, grad, first ? at::Tensor() : l.input, l.parts);
  } else {
    if (l.output.requires_grad()) {
      if (last)
        l.output.backward();
      else
        torch::autograd::backward({l.output}, {grad});
    }
    if (!first) gx = l.input.grad();
  }
  st.compute_s += since(tc);
  if (!first) send(Links::kPrev, gx.defined() ? gx : at::zeros_like(l.input), m.message_id(k - 1, i));
  if (m.split_backward()) {
    l.input = l.output = at::Tensor();  // the graph lives on in l.parts until W
  } else {
    l = {};
    --live_now;
  }
}

void StepRun::weight(const Action& a) {
  Pipeline::Impl::Live& l = state(a);
  const auto tc = Clock::now();
  pipeline::backward_weight(l.parts);
  st.compute_s += since(tc);
  l = {};
  --live_now;
}

}  // namespace

PipelineStepResult Pipeline::step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  ++m.steps;
  const int64_t chunks = m.options.chunks();
  const bool first = is_first(), last = is_last();
  StepRun run(m, target, loss_fn);
  run.st.micro_batches = chunks;
  run.live.resize(chunks * m.layout.virtual_stages);
  run.outputs.resize(chunks);
  std::string local_error;
  bool failed = false;
  std::string action = "preparing the step";
  int stage = m.layout.stage;  // the global stage of the action running
  try {
    if (first) {
      DTRAIN_CHECK(input.defined(), "Pipeline::step: the first stage needs the input batch, got an undefined tensor");
      DTRAIN_CHECK(input.dim() >= 1 && input.size(0) >= chunks, "Pipeline::step: a batch of ",
                   input.dim() ? input.size(0) : 0, " samples cannot make chunks=", chunks,
                   " micro-batches: use a batch of at least `chunks` samples");
      run.in_chunks = input.chunk(chunks, 0);
      DTRAIN_CHECK(static_cast<int64_t>(run.in_chunks.size()) == chunks, "Pipeline::step: a batch of ", input.size(0),
                   " samples splits into ", run.in_chunks.size(), " micro-batches, not chunks=", chunks,
                   ": use a batch size divisible by chunks or at least chunks * (chunks - 1)");
    }
    if (last) {
      DTRAIN_CHECK(target.defined(), "Pipeline::step: the last stage needs the target batch, got an undefined tensor");
      DTRAIN_CHECK(loss_fn, "Pipeline::step: the last stage needs a loss_fn");
      run.tgt_chunks = target.chunk(chunks, 0);
      DTRAIN_CHECK(static_cast<int64_t>(run.tgt_chunks.size()) == chunks, "Pipeline::step: the target's ",
                   target.size(0), " samples split into ", run.tgt_chunks.size(),
                   " micro-batches, not chunks=", chunks);
    }
    if (m.ddp) m.ddp->pre_forward();  // buffers from the stage group's first rank, once per step
    for (const Action& a : pipeline::make_schedule(m.options.schedule(), m.layout.stages, m.layout.stage, chunks,
                                                   m.layout.virtual_stages)) {
      stage = a.stage;
      if (a.kind == Action::kForward) {
        action = detail::cat("forward of micro-batch ", a.micro_batch);
        run.forward(a, action);
      } else if (a.kind == Action::kBackward) {
        action = detail::cat("backward of micro-batch ", a.micro_batch);
        run.backward(a);
      } else {
        action = detail::cat("weight gradient of micro-batch ", a.micro_batch);
        run.weight(a);
      }
    }
  } catch (const PeerFailed&) {
    failed = true;
  } catch (const std::exception& e) {
    failed = true;
    local_error = m.what_failed(stage, action, e);
  }
  run.live.clear();  // free the activations (and their graphs) of a failed step

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
  agreement[0] = last ? run.loss_sum : 0.0;
  if (!local_error.empty()) agreement[1 + m.layout.agreement.rank()] = 1.0;
  agreement = agreement.to(m.device);
  all_reduce(agreement, ReduceOp::SUM, m.layout.agreement);
  agreement = agreement.cpu();
  if (agreement.slice(0, 1).sum().item<double>() > 0 || failed) m.fail_step(agreement);
  run.st.boundary_tensors = m.links->tensors_sent();
  run.st.boundary_messages = m.links->messages_sent();
  m.links->finish_step();
  if (m.ddp) m.sync_replicas();

  run.st.step_s = since(t0);
  m.stats = run.st;
  PipelineStepResult result;
  result.loss = agreement[0].item<double>() / m.layout.replicas;
  if (last) result.output = at::cat(run.outputs);
  return result;
}

}  // namespace dtrain
