// train_llm's configuration checked as a whole, and the degrees of its world mesh (llm/parallel_dims.h).
#include "llm/parallel_dims.h"

#include <algorithm>

#include "dtrain/errors.h"

namespace llm {

// The degrees from the configuration, refused in one line unless their product is the world.
ParallelDims parallel_dims(const JobConfig::Parallelism& p, int64_t world) {
  DTRAIN_CHECK(
      p.pipeline_parallel_degree >= 1 && p.data_parallel_replicate_degree >= 1 && p.tensor_parallel_degree >= 1 &&
          p.context_parallel_degree >= 1 && (p.data_parallel_shard_degree >= 1 || p.data_parallel_shard_degree == -1),
      "parallelism: pipeline_parallel_degree ", p.pipeline_parallel_degree, ", data_parallel_replicate_degree ",
      p.data_parallel_replicate_degree, ", data_parallel_shard_degree ", p.data_parallel_shard_degree,
      ", context_parallel_degree ", p.context_parallel_degree, ", tensor_parallel_degree ", p.tensor_parallel_degree,
      ": each must be at least 1 (the shard degree may be -1: the rest)");
  ParallelDims d{p.pipeline_parallel_degree, p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                 p.context_parallel_degree, p.tensor_parallel_degree};
  if (d.dp_shard == -1) d.dp_shard = std::max<int64_t>(1, world / (d.pp * d.dp_replicate * d.cp * d.tp));
  const int64_t product = d.pp * d.dp_replicate * d.dp_shard * d.cp * d.tp;
  DTRAIN_CHECK(product == world, "parallelism: pipeline_parallel_degree ", d.pp, " x data_parallel_replicate_degree ",
               d.dp_replicate, " x data_parallel_shard_degree ", d.dp_shard, " x context_parallel_degree ", d.cp,
               " x tensor_parallel_degree ", d.tp, " = ", product, ", but the world has ", world,
               " rank(s); make the product equal the world size");
  return d;
}

// The pipeline's schedule by its name (dtrain::to_string's; torchtitan's for GPipe and 1F1B).
dtrain::Schedule pipeline_schedule(const std::string& name) {
  for (auto s : {dtrain::Schedule::kGPipe, dtrain::Schedule::k1F1B, dtrain::Schedule::kZeroBubbleH1})
    if (name == dtrain::to_string(s)) return s;
  DTRAIN_CHECK(false, "parallelism.pipeline_parallel_schedule ", name,
               ": use GPipe, 1F1B or ZeroBubbleH1 (Interleaved1F1B's virtual stages are not in train_llm)");
  return dtrain::Schedule::k1F1B;
}

namespace {

// The context-parallel keys against the others, one line each.
void validate_context_parallel(const JobConfig& cfg) {
  const auto& p = cfg.parallelism;
  DTRAIN_CHECK(p.context_parallel_method == "ring" || p.context_parallel_method == "ulysses",
               "parallelism.context_parallel_method ", p.context_parallel_method, ": use ring or ulysses");
  if (p.context_parallel_degree <= 1) return;
  DTRAIN_CHECK(cfg.training.seq_len % (2 * p.context_parallel_degree) == 0, "training.seq_len ", cfg.training.seq_len,
               " with parallelism.context_parallel_degree ", p.context_parallel_degree,
               ": each cp rank holds two equal chunks of every window; make seq_len a multiple of ",
               2 * p.context_parallel_degree);
  DTRAIN_CHECK(p.pipeline_parallel_degree == 1, "parallelism.context_parallel_degree ", p.context_parallel_degree,
               " with pipeline_parallel_degree ", p.pipeline_parallel_degree,
               ": context parallelism inside pipeline stages is not in train_llm yet; set one of them to 1");
  const int64_t heads = cfg.model.n_kv_heads > 0 ? cfg.model.n_kv_heads : cfg.model.n_heads;
  DTRAIN_CHECK(
      p.context_parallel_method != "ulysses" || (heads % p.tensor_parallel_degree == 0 &&
                                                 (heads / p.tensor_parallel_degree) % p.context_parallel_degree == 0),
      "parallelism.context_parallel_method ulysses: the ", heads, " (key/value) heads over tensor_parallel_degree ",
      p.tensor_parallel_degree, " do not divide by context_parallel_degree ", p.context_parallel_degree,
      "; Ulysses gives each cp rank whole heads: use ring or change the degrees");
  // fully_shard spans the data-parallel and cp degrees as one dimension: HSDP's replicate x shard
  // mesh would need a two-dimensional flattening.
  DTRAIN_CHECK(p.data_parallel_replicate_degree == 1 || p.data_parallel_shard_degree == 1,
               "parallelism.context_parallel_degree ", p.context_parallel_degree,
               " with data_parallel_replicate_degree ", p.data_parallel_replicate_degree,
               " and data_parallel_shard_degree ", p.data_parallel_shard_degree,
               ": HSDP with context parallelism is not in train_llm yet; set one of the "
               "data-parallel degrees to 1");
}

}  // namespace

void validate(const JobConfig& cfg) {
  const auto& t = cfg.training;
  DTRAIN_CHECK(t.stop_at_step >= 0, "training.stop_at_step ", t.stop_at_step, ": must be at least 0 (0: off)");
  DTRAIN_CHECK(t.steps >= 1 && t.local_batch_size >= 1 && t.seq_len >= 2 && t.gradient_accumulation_steps >= 1,
               "training: steps ", t.steps, ", local_batch_size ", t.local_batch_size, ", seq_len ", t.seq_len,
               ", gradient_accumulation_steps ", t.gradient_accumulation_steps,
               ": each must be at least 1 (seq_len at least 2)");
  DTRAIN_CHECK(cfg.model.vocab_size >= llm::kByteVocab, "model.vocab_size ", cfg.model.vocab_size,
               ": the byte-level tokens need at least ", llm::kByteVocab);
  DTRAIN_CHECK(cfg.optimizer.lr > 0 && cfg.optimizer.weight_decay >= 0 && t.max_norm >= 0, "optimizer.lr ",
               cfg.optimizer.lr, ", optimizer.weight_decay ", cfg.optimizer.weight_decay, ", training.max_norm ",
               t.max_norm, ": lr must be positive, the others at least 0");
  DTRAIN_CHECK(cfg.lr_scheduler.warmup_steps >= 0 && cfg.lr_scheduler.lr_min >= 0 && cfg.lr_scheduler.lr_min <= 1,
               "lr_scheduler: warmup_steps ", cfg.lr_scheduler.warmup_steps, ", lr_min ", cfg.lr_scheduler.lr_min,
               ": warmup_steps at least 0, lr_min a fraction of lr in [0, 1]");
  const auto& ac = cfg.activation_checkpoint;
  DTRAIN_CHECK(ac.mode == "none" || ac.mode == "full" || (ac.mode == "selective" && ac.selective_ac_option >= 1),
               "activation_checkpoint.mode ", ac.mode, " (selective_ac_option ", ac.selective_ac_option,
               "): use none, full, or selective with selective_ac_option k >= 1");
  DTRAIN_CHECK(cfg.checkpoint.async_mode == "disabled" || cfg.checkpoint.async_mode == "async",
               "checkpoint.async_mode ", cfg.checkpoint.async_mode, ": use disabled or async");
  DTRAIN_CHECK(cfg.checkpoint.interval >= 1 && cfg.checkpoint.keep_latest_k >= 1 && cfg.metrics.log_freq >= 1,
               "checkpoint.interval ", cfg.checkpoint.interval, ", checkpoint.keep_latest_k ",
               cfg.checkpoint.keep_latest_k, ", metrics.log_freq ", cfg.metrics.log_freq, ": each must be at least 1");
  DTRAIN_CHECK(t.dtype == "float32" || t.dtype == "float64", "training.dtype ", t.dtype, ": use float32 or float64");
  for (const std::string* dtype : {&t.mixed_precision_param, &t.mixed_precision_reduce})
    DTRAIN_CHECK(*dtype == "float32" || *dtype == "bfloat16", "training.mixed_precision_",
                 dtype == &t.mixed_precision_param ? "param " : "reduce ", *dtype, ": use float32 or bfloat16");
  DTRAIN_CHECK(cfg.validation.temperature >= 0 && cfg.validation.top_k >= 1, "validation.temperature ",
               cfg.validation.temperature, ", validation.top_k ", cfg.validation.top_k,
               ": the temperature at least 0 (0: greedy), top_k at least 1");
  DTRAIN_CHECK(cfg.data.val_fraction > 0 && cfg.data.val_fraction < 1, "data.val_fraction ", cfg.data.val_fraction,
               ": must lie strictly between 0 and 1");
  const auto& p = cfg.parallelism;
  pipeline_schedule(p.pipeline_parallel_schedule);
  DTRAIN_CHECK(
      p.pipeline_parallel_microbatch_size >= 1 && t.local_batch_size % p.pipeline_parallel_microbatch_size == 0,
      "parallelism.pipeline_parallel_microbatch_size ", p.pipeline_parallel_microbatch_size,
      ": must divide training.local_batch_size ", t.local_batch_size);
  validate_context_parallel(cfg);
  DTRAIN_CHECK(p.pipeline_parallel_degree <= cfg.model.n_layers, "parallelism.pipeline_parallel_degree ",
               p.pipeline_parallel_degree, ": more stages than model.n_layers ", cfg.model.n_layers,
               "; every stage needs a block");
}

llama::ModelArgs model_args(const JobConfig& cfg) {
  llama::ModelArgs a;
  a.vocab_size = cfg.model.vocab_size;
  a.dim = cfg.model.dim;
  a.n_layers = cfg.model.n_layers;
  a.n_heads = cfg.model.n_heads;
  a.n_kv_heads = cfg.model.n_kv_heads;
  a.ffn_hidden = cfg.model.ffn_hidden;
  a.rope_theta = cfg.model.rope_theta;
  a.max_seq_len = cfg.training.seq_len;
  a.validate();
  return a;
}

}  // namespace llm
