// train_llm's configuration: every key registered once with its help, read from TOML (toml++) and
// from `--section.key value` flags by the same table, so the two can never disagree on a key's type.
#include "llm/job_config.h"

#include <toml++/toml.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <variant>
#include <vector>

namespace llm {
namespace {

struct Key {
  std::string name;  // "section.key"
  std::variant<int64_t*, double*, bool*, std::string*> value;
  std::string help;
};

std::vector<Key> job_keys(JobConfig& c) {
  return {
      {"job.config_file", &c.job.config_file, "TOML file read before the other flags"},
      {"job.dump_folder", &c.job.dump_folder, "folder of metrics.jsonl and the checkpoints"},
      {"model.vocab_size", &c.model.vocab_size, "vocabulary (at least 258: bytes, BOS, EOS)"},
      {"model.dim", &c.model.dim, "model width"},
      {"model.n_layers", &c.model.n_layers, "transformer blocks"},
      {"model.n_heads", &c.model.n_heads, "attention heads"},
      {"model.n_kv_heads", &c.model.n_kv_heads, "key/value heads (0: n_heads)"},
      {"model.ffn_hidden", &c.model.ffn_hidden, "MLP hidden width"},
      {"model.rope_theta", &c.model.rope_theta, "rotary embedding base"},
      {"data.corpus_dir", &c.data.corpus_dir, "folder of the corpus's .txt files (scripts/setup.sh installs it)"},
      {"data.cache_dir", &c.data.cache_dir, "folder of the token files (empty: <corpus_dir>/tokens)"},
      {"data.val_fraction", &c.data.val_fraction, "fraction of the corpus held out for validation"},
      {"training.steps", &c.training.steps, "optimizer steps"},
      {"training.stop_at_step", &c.training.stop_at_step,
       "end this run after that step, with a checkpoint (0: at training.steps); a planned interruption"},
      {"training.local_batch_size", &c.training.local_batch_size, "windows per micro-batch per data-parallel rank"},
      {"training.seq_len", &c.training.seq_len, "tokens per window"},
      {"training.gradient_accumulation_steps", &c.training.gradient_accumulation_steps, "micro-batches per step"},
      {"training.max_norm", &c.training.max_norm, "clip the global gradient norm (0: off)"},
      {"training.seed", &c.training.seed, "seed of the weights and of the windows' shuffle"},
      {"training.threads", &c.training.threads, "intra-op threads per rank (0: $OMP_NUM_THREADS or LibTorch's)"},
      {"training.dtype", &c.training.dtype, "dtype of the parameters and activations: float32 or float64"},
      {"training.mixed_precision_param", &c.training.mixed_precision_param,
       "fully_shard's compute dtype: float32 or bfloat16"},
      {"training.mixed_precision_reduce", &c.training.mixed_precision_reduce,
       "fully_shard's gradient reduce dtype: float32 or bfloat16"},
      {"optimizer.lr", &c.optimizer.lr, "AdamW's peak learning rate"},
      {"optimizer.beta1", &c.optimizer.beta1, "AdamW's beta1"},
      {"optimizer.beta2", &c.optimizer.beta2, "AdamW's beta2"},
      {"optimizer.eps", &c.optimizer.eps, "AdamW's eps"},
      {"optimizer.weight_decay", &c.optimizer.weight_decay, "AdamW's decoupled weight decay"},
      {"lr_scheduler.warmup_steps", &c.lr_scheduler.warmup_steps, "linear warmup steps"},
      {"lr_scheduler.lr_min", &c.lr_scheduler.lr_min, "the cosine decay's end, as a fraction of lr"},
      {"parallelism.data_parallel_replicate_degree", &c.parallelism.data_parallel_replicate_degree,
       "replicas (HSDP with a shard degree > 1)"},
      {"parallelism.data_parallel_shard_degree", &c.parallelism.data_parallel_shard_degree,
       "fully_shard degree (-1: what the other degrees leave of the world)"},
      {"parallelism.tensor_parallel_degree", &c.parallelism.tensor_parallel_degree, "tensor parallel degree"},
      {"parallelism.context_parallel_degree", &c.parallelism.context_parallel_degree,
       "context parallel degree (each rank a head-tail part of the sequence)"},
      {"parallelism.context_parallel_method", &c.parallelism.context_parallel_method,
       "ring (K/V rotate around the cp ranks) or ulysses (all-to-all over heads)"},
      {"parallelism.pipeline_parallel_degree", &c.parallelism.pipeline_parallel_degree,
       "pipeline stages (by blocks; the outermost mesh dimension)"},
      {"parallelism.pipeline_parallel_schedule", &c.parallelism.pipeline_parallel_schedule,
       "GPipe, 1F1B or ZeroBubbleH1"},
      {"parallelism.pipeline_parallel_microbatch_size", &c.parallelism.pipeline_parallel_microbatch_size,
       "windows per pipeline micro-batch (dividing training.local_batch_size)"},
      {"activation_checkpoint.mode", &c.activation_checkpoint.mode, "none, full or selective"},
      {"activation_checkpoint.selective_ac_option", &c.activation_checkpoint.selective_ac_option,
       "selective: every k-th block recomputes"},
      {"checkpoint.enable", &c.checkpoint.enable, "write checkpoints and resume from the newest"},
      {"checkpoint.folder", &c.checkpoint.folder, "checkpoint folder under job.dump_folder"},
      {"checkpoint.interval", &c.checkpoint.interval, "steps between checkpoints"},
      {"checkpoint.async_mode", &c.checkpoint.async_mode, "disabled or async"},
      {"checkpoint.keep_latest_k", &c.checkpoint.keep_latest_k, "checkpoints kept"},
      {"checkpoint.export_initial", &c.checkpoint.export_initial,
       "safetensors file of the initial weights, whole, written before step 1 (empty: none)"},
      {"checkpoint.export_final", &c.checkpoint.export_final,
       "safetensors file of the final weights, whole, written after the last step (empty: none)"},
      {"metrics.log_freq", &c.metrics.log_freq, "steps between metric lines"},
      {"metrics.enable_jsonl", &c.metrics.enable_jsonl, "write <dump_folder>/metrics.jsonl"},
      {"metrics.enable_tensorboard", &c.metrics.enable_tensorboard, "write TensorBoard events into <dump_folder>/tb"},
      {"validation.max_windows", &c.validation.max_windows, "validation windows evaluated at the end (0: all)"},
      {"validation.sample_tokens", &c.validation.sample_tokens, "tokens of the sample at the end"},
      {"validation.temperature", &c.validation.temperature, "the sample's temperature (0: greedy)"},
      {"validation.top_k", &c.validation.top_k, "the sample draws from the k likeliest tokens"},
      {"validation.prompt", &c.validation.prompt, "the sample's prompt"},
  };
}

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

// A flag's text into the key's type.
void set_from_text(const Key& key, const std::string& text) {
  const std::string where = "--" + key.name + " " + text;
  if (auto* s = std::get_if<std::string*>(&key.value)) {
    **s = text;
  } else if (auto* b = std::get_if<bool*>(&key.value)) {
    if (text == "true" || text == "1") {
      **b = true;
    } else if (text == "false" || text == "0") {
      **b = false;
    } else {
      fail(where + ": not a boolean (use true or false)");
    }
  } else if (auto* i = std::get_if<int64_t*>(&key.value)) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0) fail(where + ": not an integer");
    **i = v;
  } else {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0') fail(where + ": not a number");
    *std::get<double*>(key.value) = v;
  }
}

// A TOML value into the key's type (an integer is a fine float; nothing else converts).
void set_from_toml(const Key& key, const toml::node& node, const std::string& file) {
  const std::string where = file + ": " + key.name;
  if (auto* s = std::get_if<std::string*>(&key.value)) {
    if (!node.is_string()) fail(where + " must be a string");
    **s = *node.value<std::string>();
  } else if (auto* b = std::get_if<bool*>(&key.value)) {
    if (!node.is_boolean()) fail(where + " must be true or false");
    **b = *node.value<bool>();
  } else if (auto* i = std::get_if<int64_t*>(&key.value)) {
    if (!node.is_integer()) fail(where + " must be an integer");
    **i = *node.value<int64_t>();
  } else {
    if (!node.is_number()) fail(where + " must be a number");
    *std::get<double*>(key.value) = *node.value<double>();
  }
}

const Key* find_key(const std::vector<Key>& keys, const std::string& name) {
  for (const Key& k : keys)
    if (k.name == name) return &k;
  return nullptr;
}

void load_toml(const std::vector<Key>& keys, const std::string& file) {
  toml::table root;
  try {
    root = toml::parse_file(file);
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;
    fail(file + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) + ": " + std::string(e.description()));
  }
  for (auto&& [section, table] : root) {
    if (!table.is_table()) fail(file + ": " + std::string(section.str()) + " is not a [section]");
    for (auto&& [name, node] : *table.as_table()) {
      const std::string full = std::string(section.str()) + "." + std::string(name.str());
      const Key* key = find_key(keys, full);
      if (!key || full == "job.config_file")
        fail(file + ": unknown key " + full + " (train_llm --help lists the keys)");
      set_from_toml(*key, node, file);
    }
  }
}

void print_help(const std::vector<Key>& keys) {
  std::printf(
      "train_llm: a Llama-style model on a byte-level text corpus with fully_shard, HSDP and tensor parallelism\n"
      "(start it with dtrain-run). Every key below is a TOML key [section] key = value and a flag:\n\n");
  for (const Key& k : keys) std::printf("  --%-46s %s\n", k.name.c_str(), k.help.c_str());
}

}  // namespace

std::optional<int> parse_job_config(int argc, char** argv, JobConfig& cfg) {
  const std::vector<Key> keys = job_keys(cfg);
  try {
    // Pairs of (key, text) in order; --job.config_file is applied first, wherever it stands.
    std::vector<std::pair<const Key*, std::string>> flags;
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        print_help(keys);
        return 0;
      }
      if (arg.rfind("--", 0) != 0) fail("unexpected argument " + arg + " (flags are --section.key value)");
      std::string name = arg.substr(2), text;
      if (const size_t eq = name.find('='); eq != std::string::npos) {
        text = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (i + 1 < argc) {
        text = argv[++i];
      } else {
        fail(arg + " needs a value");
      }
      const Key* key = find_key(keys, name);
      if (!key) fail("unknown flag --" + name + " (train_llm --help lists the keys)");
      flags.emplace_back(key, text);
    }
    for (const auto& [key, text] : flags)
      if (key->name == "job.config_file") set_from_text(*key, text);
    if (!cfg.job.config_file.empty()) load_toml(keys, cfg.job.config_file);
    for (const auto& [key, text] : flags)
      if (key->name != "job.config_file") set_from_text(*key, text);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_llm: error: %s\n", e.what());
    return 1;
  }
  return std::nullopt;
}

}  // namespace llm
