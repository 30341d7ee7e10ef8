// train_llm: torchtitan's recipe in C++ — a Llama-style model (llm/llama.h) trained on a real text
// corpus (byte-level tokens, llm/text_data.h) with fully_shard, HSDP and tensor parallelism on one
// world mesh (and pipeline parallelism by blocks, the mesh's outermost dimension, and context parallelism
// along the sequence), AdamW with warmup and cosine decay,
// gradient accumulation, clipping by the global norm, activation checkpointing, asynchronous checkpoints with exact
// resume and JSONL metrics.
//
//   ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/train_llm
//       --job.config_file examples/llm/configs/debug.toml --parallelism.data_parallel_shard_degree 2
//
// Every key of the TOML file is also a flag (`--section.key value`, train_llm --help lists them).
// Output (rank 0): a configuration line, a metrics line every metrics.log_freq steps (also appended to
// <job.dump_folder>/metrics.jsonl), the validation loss and perplexity, a sampled text, and last
//   RESULT steps=N final_loss=L loss_bits=H val_loss=V val_ppl=P
// L: the last step's loss averaged over the ranks; H: the same double in C's %a (hex float), so two
// runs compare bit for bit. Exit status: 0 on success, 1 on any error (one line
// "train_llm: error: ..." on stderr of every rank).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "collective_errors.h"
#include "dtrain/checkpoint.h"
#include "dtrain/context_parallel.h"
#include "dtrain/device_mesh.h"
#include "dtrain/dtrain.h"
#include "dtrain/fsdp.h"
#include "dtrain/functional_collectives.h"
#include "dtrain/safetensors.h"
#include "dtrain/shard_spec.h"
#include "dtrain/pipeline.h"
#include "dtrain/system.h"
#include "llm/job_config.h"
#include "llm/llama.h"
#include "llm/metrics.h"
#include "llm/parallel_dims.h"
#include "llm/text_data.h"

namespace {

using llm::JobConfig;
using llm::model_args;
using llm::ParallelDims;
using llm::pipeline_schedule;
using train::collectively;
using train::one_line;

// Where this rank trains: the world mesh and this rank's place on it.
struct Place {
  int rank = 0, world = 1;
  ParallelDims dims;
  dtrain::DeviceMesh mesh;
  int64_t dp_rank = 0;  // which data-parallel part of every global batch this rank reads
  bool main_rank() const { return rank == 0; }
};

Place setup(const JobConfig& cfg) {
  if (cfg.training.threads > 0) at::set_num_threads(static_cast<int>(cfg.training.threads));
  dtrain::init_process_group();
  Place p;
  p.rank = dtrain::rank();
  p.world = dtrain::world_size();
  collectively("checking the configuration", true, [&] {
    validate(cfg);
    model_args(cfg);
    p.dims = parallel_dims(cfg.parallelism, p.world);
    const auto& t = cfg.training;
    DTRAIN_CHECK(p.dims.dp() > 1 || (t.mixed_precision_param == "float32" && t.mixed_precision_reduce == "float32"),
                 "training.mixed_precision_param ", t.mixed_precision_param, " / mixed_precision_reduce ",
                 t.mixed_precision_reduce,
                 ": mixed precision comes with fully_shard, and this run has no data-parallel "
                 "degree above 1; use float32 or shard the model");
  });
  // torchtitan's world mesh: tensor parallelism innermost (its ranks adjacent), then context
  // parallelism, the shard dimension, replicas, and pipeline stages outermost (a stage's tp, cp and dp
  // groups lie inside it).
  p.mesh = dtrain::init_device_mesh({p.dims.pp, p.dims.dp_replicate, p.dims.dp_shard, p.dims.cp, p.dims.tp},
                                    {"pp", "dp_replicate", "dp_shard", "cp", "tp"});
  p.dp_rank = p.mesh.get_local_rank("dp_replicate") * p.dims.dp_shard + p.mesh.get_local_rank("dp_shard");
  return p;
}

// The token files: prepared (or found in the cache) by rank 0, then mapped by every rank.
struct Data {
  std::unique_ptr<llm::TokenFile> train, val;
  llm::PreparedTokens prepared;
};

Data load_data(const JobConfig& cfg, const Place& place) {
  const std::string cache = cfg.data.cache_dir.empty()
                                ? (std::filesystem::path(cfg.data.corpus_dir) / "tokens").string()
                                : cfg.data.cache_dir;
  Data d;
  collectively("preparing the token files", place.main_rank(),
               [&] { d.prepared = llm::prepare_tokens(cfg.data.corpus_dir, cache, cfg.data.val_fraction); });
  collectively("mapping the token files", true, [&] {
    d.train = std::make_unique<llm::TokenFile>((std::filesystem::path(cache) / "train.bin").string());
    d.val = std::make_unique<llm::TokenFile>((std::filesystem::path(cache) / "val.bin").string());
  });
  return d;
}

// torchtitan's mixed precision: through fully_shard's policy (float32 keys: none, full precision).
dtrain::MixedPrecisionPolicy mixed_precision(const JobConfig::Training& t) {
  auto dtype = [](const std::string& name) { return name == "bfloat16" ? at::kBFloat16 : at::kFloat; };
  dtrain::MixedPrecisionPolicy mp;
  if (t.mixed_precision_param != "float32") mp.param_dtype(dtype(t.mixed_precision_param));
  if (t.mixed_precision_reduce != "float32") mp.reduce_dtype(dtype(t.mixed_precision_reduce));
  return mp;
}

llama::CpAttention cp_attention(const JobConfig& cfg) {
  return cfg.parallelism.context_parallel_method == "ulysses" ? llama::CpAttention::kUlysses
                                                              : llama::CpAttention::kRing;
}

// The model with its parallelisms applied in torchtitan's order: pipeline stages, then on this rank's
// stage tensor parallel, activation checkpointing, then fully_shard (each block a unit, the root last).
struct Parallel {
  llama::Transformer model{nullptr};  // the whole model, or this rank's pipeline stage
  std::optional<dtrain::FSDPModule<llama::TransformerImpl>> fsdp;
  std::unique_ptr<dtrain::Pipeline> pipeline;  // pp > 1
  std::optional<dtrain::Group> pp_group;       // pp > 1
  std::optional<dtrain::Group> cp_group;       // cp > 1
  // The model's (or this stage's) forward: tokens, or the previous stage's activations, in.
  at::Tensor operator()(const at::Tensor& x) { return fsdp ? (*fsdp)(x) : model->forward(x); }
};

// With pp > 1 every rank builds the whole model (the same weights everywhere) and keeps its stage's
// modules (torchtitan's pipeline_llama), the other stages' views only for the Pipeline's list.
std::vector<torch::nn::Sequential> split_stages(const JobConfig& cfg, const Place& place, Parallel& par) {
  llama::Transformer whole(model_args(cfg));
  // float64: initialized in float32 as ever (the same draws), then widened, before the split.
  if (cfg.training.dtype == "float64") whole->to(at::kDouble);
  const int64_t pp = place.dims.pp, mine = place.mesh.get_local_rank("pp");
  std::vector<torch::nn::Sequential> stages;
  for (int64_t s = 0; s < pp; ++s) {
    llama::Transformer stage = llama::pipeline_stage(*whole, s, pp);
    if (s == mine) par.model = stage;
    stages.push_back(llama::pipeline_stage_module(stage));
  }
  return stages;
}

// doc:begin build_model
Parallel build_model(const JobConfig& cfg, const Place& place) {
  const ParallelDims& d = place.dims;
  Parallel par;
  torch::manual_seed(static_cast<uint64_t>(cfg.training.seed));  // the same weights on every rank
  std::vector<torch::nn::Sequential> stages;
  if (d.pp > 1) {
    stages = split_stages(cfg, place, par);
  } else {
    par.model = llama::Transformer(model_args(cfg));
    // float64: initialized in float32 as ever (the same draws), then widened, before any sharding.
    if (cfg.training.dtype == "float64") par.model->to(at::kDouble);
  }
  if (d.tp > 1) llama::apply_tensor_parallel(*par.model, place.mesh["tp"]);
  if (d.cp > 1) {
    par.cp_group = place.mesh.get_group("cp");
    llama::apply_context_parallel(*par.model, *par.cp_group, cp_attention(cfg));
  }
  const auto& ac = cfg.activation_checkpoint;
  llama::apply_activation_checkpoint(*par.model, ac.mode == "full" ? llama::ActivationCheckpoint::full()
                                                 : ac.mode == "selective"
                                                     ? llama::ActivationCheckpoint::every_k(ac.selective_ac_option)
                                                     : llama::ActivationCheckpoint::none());
  if (d.dp() * d.cp > 1) {
    // HSDP with both data-parallel degrees above 1; otherwise fully_shard over the one there is
    // (replicas alone are sharded too: the same arithmetic as DDP, with a third of the memory). The cp
    // ranks of a data-parallel rank each computed the gradient of their part of its tokens: fully_shard
    // spans them too (torchtitan's dp_shard_cp), so its average is over every token of the step.
    dtrain::DeviceMesh dp_mesh = d.cp > 1 ? place.mesh[{"dp_replicate", "dp_shard", "cp"}].flatten("dp_cp")
                                 : d.dp_replicate > 1 && d.dp_shard > 1 ? place.mesh[{"dp_replicate", "dp_shard"}]
                                 : d.dp_shard > 1                       ? place.mesh["dp_shard"]
                                                                        : place.mesh["dp_replicate"];
    par.fsdp.emplace(llama::apply_fully_shard(
        par.model, dtrain::FullyShardOptions().mesh(dp_mesh).mp_policy(mixed_precision(cfg.training))));
  }
  if (d.pp > 1) {
    const auto& p = cfg.parallelism;
    par.pp_group = place.mesh.get_group("pp");
    par.pipeline = std::make_unique<dtrain::Pipeline>(
        std::move(stages), dtrain::PipelineOptions()
                               .mesh(place.mesh["pp"])
                               .schedule(pipeline_schedule(p.pipeline_parallel_schedule))
                               .chunks(cfg.training.local_batch_size / p.pipeline_parallel_microbatch_size));
  }
  return par;
}
// doc:end build_model

// The whole model's weights on global rank 0 (elsewhere: this stage's, or nothing). Each stage's ranks
// put their stage together over fully_shard and tensor parallelism (full_state_dict, collective within
// the stage); with pipeline stages, the pp group through rank 0 (every other coordinate 0) then
// gathers the stages' on it.
dtrain::NamedTensors whole_weights(Parallel& par) {
  dtrain::NamedTensors mine = dtrain::full_state_dict(*par.model);
  if (!par.pp_group || par.pp_group->ranks().front() != 0) return mine;
  return dtrain::gather_named_tensors(mine, 0, *par.pp_group);
}

// checkpoint.export_initial and export_final: the weights before the first step or after the last,
// whole (gathered over fully_shard, tensor parallelism and pipeline stages), in one safetensors file
// that rank 0 writes; the metadata names the step. Collective.
void export_weights(const JobConfig& cfg, const Place& place, Parallel& par, const std::string& key,
                    const std::string& path, int64_t step) {
  if (path.empty()) return;
  const dtrain::NamedTensors whole = whole_weights(par);
  collectively("writing checkpoint." + key, place.main_rank(), [&] {
    dtrain::save_safetensors(whole, path,
                             {{"step", std::to_string(step)}, {"seed", std::to_string(cfg.training.seed)}});
  });
}

// Linear warmup to lr, then cosine decay to lr * lr_min at the last step (torchtitan's schedule).
double lr_at(const JobConfig& cfg, int64_t step) {
  const double lr = cfg.optimizer.lr;
  const int64_t warmup = cfg.lr_scheduler.warmup_steps;
  if (step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup + 1);
  const double progress =
      static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, cfg.training.steps - warmup));
  const double lr_min = cfg.lr_scheduler.lr_min;
  return lr * (lr_min + (1 - lr_min) * 0.5 * (1 + std::cos(M_PI * std::min(1.0, progress))));
}

// This rank's windows: the sampler's next local_batch_size of them, a new epoch (a new shuffle) when
// the current one has no full batch left. The sampler's epoch and position are the checkpoint's.
at::Tensor next_batch(dtrain::DistributedSampler& sampler, const llm::TokenFile& file, int64_t batch, int64_t seq) {
  for (;;) {
    auto indices = sampler.next(static_cast<size_t>(batch));
    if (indices && static_cast<int64_t>(indices->size()) == batch) {
      std::vector<at::Tensor> rows;
      for (size_t i : *indices) rows.push_back(file.window(static_cast<int64_t>(i), seq));
      return at::stack(rows);  // [batch, seq + 1]
    }
    sampler.set_epoch(sampler.epoch() + 1);
    sampler.reset();
  }
}

// This rank's part of a batch's tokens [batch, seq] under context parallelism (the head-tail chunks of
// every window, dtrain/context_parallel.h), the whole batch without it.
at::Tensor cp_part(const Parallel& par, const at::Tensor& tokens) {
  return par.cp_group ? dtrain::context_parallel_shard(tokens, 1, *par.cp_group) : tokens;
}

// doc:begin train_step
// One optimizer step over gradient_accumulation_steps micro-batches. Returns this rank's loss (the
// mean over its micro-batches).
llm::StepMetricsInput train_step(const JobConfig& cfg, Parallel& par, torch::optim::AdamW& optimizer,
                                 dtrain::DistributedSampler& sampler, const llm::TokenFile& train, int64_t step) {
  const int64_t accum = cfg.training.gradient_accumulation_steps, seq = cfg.training.seq_len;
  llm::StepMetricsInput r;
  optimizer.zero_grad();
  for (int64_t m = 0; m < accum; ++m) {
    const at::Tensor w = next_batch(sampler, train, cfg.training.local_batch_size, seq);
    if (par.pipeline) {
      // The last stage computes the loss; the step's result carries it to every stage.
      auto loss_fn = [&](const at::Tensor& logits, const at::Tensor& targets) {
        return par.model->loss(logits, targets) / static_cast<double>(accum);
      };
      r.loss += par.pipeline->step(w.narrow(1, 0, seq), w.narrow(1, 1, seq), loss_fn).loss;
      continue;
    }
    at::Tensor loss = par.model->loss(par(cp_part(par, w.narrow(1, 0, seq))), cp_part(par, w.narrow(1, 1, seq))) /
                      static_cast<double>(accum);
    loss.backward();
    r.loss += loss.item<double>();
  }
  // The norm of the whole gradients, whatever tensor parallelism and fully_shard cut (each parameter's
  // ShardSpec says over which groups) and the stages' totals summed over pp; max_norm 0 measures it
  // without clipping.
  const double max_norm = cfg.training.max_norm > 0 ? cfg.training.max_norm : std::numeric_limits<double>::infinity();
  r.grad_norm = dtrain::clip_grad_norm_(par.model->parameters(), max_norm, 2.0, std::nullopt, par.pp_group);
  r.lr = lr_at(cfg, step);
  for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(r.lr);
  optimizer.step();
  return r;
}
// doc:end train_step

// The model's forward outside a pipeline step (evaluation, no gradients): each stage in turn runs
// its part on what the previous one sent and sends its activations on. Returns the logits on the last
// stage (on every rank without pipeline parallelism), an undefined tensor on the other stages.
at::Tensor forward_through_stages(const JobConfig& cfg, Parallel& par, const at::Tensor& tokens) {
  if (!par.pipeline) return par(tokens);
  const std::vector<int>& ranks = par.pp_group->ranks();
  const int stage = par.pipeline->stage();
  at::Tensor x = tokens;
  if (stage > 0) {
    x = at::empty({tokens.size(0), tokens.size(1), cfg.model.dim}, par.model->parameters().at(0).options());
    dtrain::recv(x, ranks[stage - 1], *par.pp_group);
  }
  at::Tensor y = par(x);
  if (par.pipeline->is_last()) return y;
  dtrain::send(y.contiguous(), ranks[stage + 1], *par.pp_group);
  return at::Tensor();
}

// Mean loss over the first validation.max_windows windows of the validation split, each
// data-parallel rank its share; every rank runs the same number of batches (fully_shard's
// collectives). Collective.
double validation_loss(const JobConfig& cfg, const Place& place, Parallel& par, const llm::TokenFile& val) {
  torch::NoGradGuard no_grad;
  const int64_t seq = cfg.training.seq_len, dp = place.dims.dp();
  int64_t n = val.num_windows(seq);
  if (cfg.validation.max_windows > 0) n = std::min(n, cfg.validation.max_windows);
  const int64_t per_rank = n / dp;
  DTRAIN_CHECK(per_rank >= 1, "the validation split has ", val.num_windows(seq), " windows of ", seq,
               " tokens, fewer than the ", dp,
               " data-parallel ranks; lower training.seq_len or raise data.val_fraction");
  double sum = 0;
  for (int64_t begin = 0; begin < per_rank; begin += cfg.training.local_batch_size) {
    std::vector<at::Tensor> rows;
    for (int64_t k = begin; k < std::min(per_rank, begin + cfg.training.local_batch_size); ++k)
      rows.push_back(val.window(k * dp + place.dp_rank, seq));
    const at::Tensor w = at::stack(rows);
    // Under context parallelism each cp rank's loss is the mean of its part of the tokens: the
    // world's sum below averages the cp ranks' equal parts into the windows' mean.
    const at::Tensor logits = forward_through_stages(cfg, par, cp_part(par, w.narrow(1, 0, seq)));
    if (logits.defined())
      sum +=
          par.model->loss(logits, cp_part(par, w.narrow(1, 1, seq))).item<double>() * static_cast<double>(rows.size());
  }
  if (par.fsdp) par.fsdp->reshard();  // no backward follows to free the root's gathered parameters
  // Only the last pipeline stage holds losses: the other stages count no windows.
  const bool holds_loss = !par.pipeline || par.pipeline->is_last();
  const auto s = dtrain::all_reduce_values(std::vector<double>{sum, holds_loss ? static_cast<double>(per_rank) : 0.0});
  return s[0] / s[1];
}

// Text from the prompt, the context cut to the last seq_len tokens: top-k sampling at
// validation.temperature (greedy at 0, where an undertrained model repeats its likeliest byte, a
// newline, to the end). Every rank decodes the same tokens (the same parameters, the whole logits
// gathered over tensor parallelism, each token sent from the last pipeline stage to the others).
std::string sample_text(const JobConfig& cfg, const Place& place, Parallel& par) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> tokens{llm::kBos};
  for (int64_t t : llm::encode(cfg.validation.prompt)) tokens.push_back(t);
  const size_t prompt = tokens.size();
  // Every rank draws from the same generator and sees the same logits (gathered over tensor
  // parallelism, sent on by the last pipeline stage), so every rank picks the same token.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(cfg.training.seed));
  const double temperature = cfg.validation.temperature;
  // The context grows a token at a time, not in 2 cp equal chunks: every cp rank decodes it whole
  // (the parameters are whole on every cp rank), and training's split is put back after.
  if (par.cp_group) llama::remove_context_parallel(*par.model);
  for (int64_t i = 0; i < cfg.validation.sample_tokens; ++i) {
    const size_t from = tokens.size() > static_cast<size_t>(cfg.training.seq_len)
                            ? tokens.size() - static_cast<size_t>(cfg.training.seq_len)
                            : 0;
    const at::Tensor ctx =
        at::tensor(std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(from), tokens.end()), at::kLong)
            .unsqueeze(0);
    const at::Tensor logits = forward_through_stages(cfg, par, ctx);
    at::Tensor next = at::zeros({1}, at::kLong);
    if (logits.defined()) {
      at::Tensor last = logits.select(1, -1);  // [1, vocab / tp]
      if (place.dims.tp > 1) last = dtrain::functional::all_gather(last, 1, place.mesh.get_group("tp"));
      last = last.narrow(1, 0, llm::kByteVocab).to(at::kDouble);
      if (temperature <= 0) {
        next = last.argmax(1);
      } else {  // top-k sampling at the temperature, as nanoGPT's sample.py
        auto [top, where] = last.topk(std::min<int64_t>(cfg.validation.top_k, llm::kByteVocab), 1);
        const at::Tensor pick = at::multinomial(at::softmax(top / temperature, 1), 1, false, gen);
        next = where.gather(1, pick).view({1});
      }
    }
    if (par.pipeline) dtrain::broadcast(next, par.pp_group->ranks().back(), *par.pp_group);
    tokens.push_back(next.item<int64_t>());
    if (tokens.back() == llm::kEos) break;
  }
  if (par.fsdp) par.fsdp->reshard();
  if (par.cp_group) llama::apply_context_parallel(*par.model, *par.cp_group, cp_attention(cfg));
  return llm::decode(std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(prompt), tokens.end()));
}

std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// The sample as text a terminal and a log show whole: bytes outside printable ASCII (an undertrained
// model picks any byte) as \xNN, newlines kept.
std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n' || (c >= 0x20 && c < 0x7f)) {
      out.push_back(static_cast<char>(c));
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

void print_configuration(const JobConfig& cfg, const Place& place, const Data& data,
                         const dtrain::DistributedSampler& s) {
  if (!place.main_rank()) return;
  const ParallelDims& d = place.dims;
  const char* ac = cfg.activation_checkpoint.mode.c_str();
  const auto& p = cfg.parallelism;
  const std::string pipeline =
      d.pp > 1
          ? " (pipeline " + p.pipeline_parallel_schedule + ", " +
                std::to_string(cfg.training.local_batch_size / p.pipeline_parallel_microbatch_size) + " micro-batches)"
          : "";
  std::printf(
      "train_llm: %d rank(s) x %d thread(s) | mesh pp %lld x dp_replicate %lld x dp_shard %lld x cp %lld x tp %lld%s | "
      "Llama "
      "%lld params "
      "(dim %lld, %lld layers, %lld heads), activation checkpointing %s | %s %lld documents: %lld train tokens "
      "(%zu windows of %lld per dp rank), %lld validation | global batch %lld windows x %lld steps, AdamW lr %g "
      "wd %g\n",
      place.world, at::get_num_threads(), static_cast<long long>(d.pp), static_cast<long long>(d.dp_replicate),
      static_cast<long long>(d.dp_shard), static_cast<long long>(d.cp), static_cast<long long>(d.tp), pipeline.c_str(),
      static_cast<long long>(model_args(cfg).num_params()), static_cast<long long>(cfg.model.dim),
      static_cast<long long>(cfg.model.n_layers), static_cast<long long>(cfg.model.n_heads), ac,
      data.prepared.reused ? "cached tokens of" : "prepared", static_cast<long long>(data.prepared.documents),
      static_cast<long long>(data.train->size()), s.size(), static_cast<long long>(cfg.training.seq_len),
      static_cast<long long>(data.val->size()),
      static_cast<long long>(d.dp() * cfg.training.local_batch_size * cfg.training.gradient_accumulation_steps),
      static_cast<long long>(cfg.training.steps), cfg.optimizer.lr, cfg.optimizer.weight_decay);
  std::fflush(stdout);
}

// The metrics (llm/metrics.h): the model's FLOPs per token, and the peak of a matmul in the
// parameters' dtype measured by every rank at once (printed: the MFU's denominator).
std::unique_ptr<llm::TrainMetrics> open_metrics(const JobConfig& cfg, const Place& place, Parallel& par) {
  const double peak = llm::measure_peak_flops(par.model->parameters().front().scalar_type());
  const double per_token = llm::flops_per_token(model_args(cfg), cfg.training.seq_len);
  if (place.main_rank()) {
    std::printf("train_llm: model %.6g FLOPs per token; this machine's matmul peak %.2f GFLOP/s per rank\n", per_token,
                peak / 1e9);
    std::fflush(stdout);
  }
  llm::TrainMetricsOptions o;
  o.rank = place.rank;
  o.world = place.world;
  o.dp = place.dims.dp();
  o.windows_per_step = cfg.training.gradient_accumulation_steps * cfg.training.local_batch_size;
  o.tokens_per_step = o.windows_per_step * cfg.training.seq_len;
  o.total_steps = cfg.training.steps;
  o.dump_folder = cfg.job.dump_folder;
  o.jsonl = cfg.metrics.enable_jsonl;
  o.tensorboard = cfg.metrics.enable_tensorboard;
  std::unique_ptr<llm::TrainMetrics> m;
  // Rank 0 opens the files; a failure there ends every rank in one line.
  collectively("opening the metrics' files", true,
               [&] { m = std::make_unique<llm::TrainMetrics>(o, per_token, peak); });
  return m;
}

// The whole job, top to bottom.
int run(const JobConfig& cfg) {
  Place place = setup(cfg);
  Data data = load_data(cfg, place);
  Parallel par = build_model(cfg, place);
  export_weights(cfg, place, par, "export_initial", cfg.checkpoint.export_initial, 0);
  torch::optim::AdamW optimizer(par.model->parameters(), torch::optim::AdamWOptions(cfg.optimizer.lr)
                                                             .betas({cfg.optimizer.beta1, cfg.optimizer.beta2})
                                                             .eps(cfg.optimizer.eps)
                                                             .weight_decay(cfg.optimizer.weight_decay));

  // Each data-parallel rank its share of the shuffled windows; the tensor-parallel ranks of one
  // data-parallel rank read the same ones.
  const int64_t seq = cfg.training.seq_len;
  dtrain::DistributedSampler sampler(static_cast<size_t>(data.train->num_windows(seq)),
                                     dtrain::DistributedSamplerOptions()
                                         .num_replicas(place.dims.dp())
                                         .rank(place.dp_rank)
                                         .seed(cfg.training.seed)
                                         .drop_last(true));
  DTRAIN_CHECK(static_cast<int64_t>(sampler.size()) >= cfg.training.local_batch_size, "training.local_batch_size ",
               cfg.training.local_batch_size, ": the corpus has only ", sampler.size(), " windows of ", seq,
               " tokens per data-parallel rank; lower it or training.seq_len");

  // Checkpoints: model and optimizer (sharded: a DCP folder), the sampler's epoch and position, RNG.
  const std::filesystem::path dump(cfg.job.dump_folder);
  dtrain::TrainingState state;
  state.model = par.model.get();
  state.optimizer = &optimizer;
  state.sampler = &sampler;              // its position() is the windows this rank consumed in the epoch
  state.model_part = place.dims.pp > 1;  // a pipeline stage: each rank saves and loads its own blocks
  std::optional<dtrain::CheckpointManager> checkpoints;
  int64_t start = 0;
  if (cfg.checkpoint.enable) {
    checkpoints.emplace((dump / cfg.checkpoint.folder).string(),
                        dtrain::CheckpointOptions().keep(cfg.checkpoint.keep_latest_k));
    if (auto path = checkpoints->load_latest(state)) {
      start = state.step;
      if (place.main_rank())
        std::printf("resumed from %s at step %lld\n", path->c_str(), static_cast<long long>(start));
    }
  }
  if (start == 0) sampler.set_epoch(0);
  sampler.reset();  // a resumed run's pass starts at the checkpoint's position
  print_configuration(cfg, place, data, sampler);

  std::unique_ptr<llm::TrainMetrics> metrics = open_metrics(cfg, place, par);
  // training.stop_at_step ends this run early; the learning-rate schedule still spans training.steps,
  // so a run resumed from its checkpoint continues the same schedule.
  const int64_t last =
      cfg.training.stop_at_step > 0 ? std::min(cfg.training.stop_at_step, cfg.training.steps) : cfg.training.steps;
  double loss = NAN;
  for (int64_t step = start + 1; step <= last; ++step) {
    const llm::StepMetricsInput r = train_step(cfg, par, optimizer, sampler, *data.train, step);
    metrics->step_done(step, r.loss);
    if (step % cfg.metrics.log_freq == 0 || step == last) loss = metrics->log(step, r);
    if (checkpoints && (step % cfg.checkpoint.interval == 0 || step == last)) {
      state.step = step;
      state.epoch = sampler.epoch();
      cfg.checkpoint.async_mode == "async" ? checkpoints->save_async(state) : checkpoints->save(state);
    }
  }
  metrics->finish();
  if (checkpoints) checkpoints->wait();
  export_weights(cfg, place, par, "export_final", cfg.checkpoint.export_final, last);

  const double val_loss = validation_loss(cfg, place, par, *data.val);
  const std::string sample = sample_text(cfg, place, par);
  if (place.main_rank()) {
    const std::string how = cfg.validation.temperature > 0
                                ? "temperature " + format_number(cfg.validation.temperature) + ", top " +
                                      std::to_string(cfg.validation.top_k)
                                : std::string("greedy");
    std::printf("validation: loss %.4f, perplexity %.2f\nsample (%s, prompt %s):\n%s%s\n---\n", val_loss,
                std::exp(val_loss), how.c_str(), one_line(cfg.validation.prompt).c_str(),
                printable(cfg.validation.prompt).c_str(), printable(sample).c_str());
    std::printf("RESULT steps=%lld final_loss=%.6f loss_bits=%a val_loss=%.4f val_ppl=%.2f\n",
                static_cast<long long>(last), loss, loss, val_loss, std::exp(val_loss));
    std::fflush(stdout);
  }
  dtrain::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dtrain::reduce_allocator_churn();  // Note [malloc churn] in dtrain/system.h
  JobConfig cfg;
  if (std::optional<int> exit_code = llm::parse_job_config(argc, argv, cfg)) return *exit_code;
  try {
    return run(cfg);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "train_llm: error: %s\n", one_line(e.what_without_backtrace()).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_llm: error: %s\n", one_line(e.what()).c_str());
  }
  return 1;
}
