// Pipeline::Impl, shared by pipeline.cpp (construction, failure, replicas) and step.cpp (one step).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/pipeline.h"
#include "pipeline/layout.h"
#include "pipeline/links.h"
#include "pipeline/split_backward.h"

namespace dtrain {

struct Pipeline::Impl {
  PipelineOptions options;
  pipeline::Layout layout;
  std::vector<torch::nn::Sequential> chunks;  // this rank's stages: global stage chunk * stages + stage
  std::shared_ptr<torch::nn::Module> held;    // every parameter of this rank: chunks[0], or all of them
  std::vector<int64_t> balance;               // layers per global stage
  std::vector<int64_t> first_layers;          // per chunk: the index of its first layer in the model
  c10::Device device{at::kCPU};
  std::unique_ptr<pipeline::Links> links;
  std::unique_ptr<detail::DDPCore> ddp;  // replicas > 1
  std::string store_prefix;              // this pipeline's keys in the job store (Note [Group-agreed ids])
  int64_t steps = 0;
  PipelineStepStats stats;

  // One micro-batch's state on one stage between its forward and its backward (or its W).
  struct Live {
    at::Tensor input;                         // the received activation (a leaf requiring grad) or the input chunk
    at::Tensor output;                        // what backward starts from: the sent output, or the weighted loss
    std::vector<pipeline::WeightPart> parts;  // ZB-H1: layer outputs waiting for their W
  };

  int total_stages() const { return layout.stages * layout.virtual_stages; }
  bool split_backward() const { return options.schedule() == Schedule::kZeroBubbleH1; }
  // Names the boundary below global stage k (k -> k+1) and the micro-batch, for the links' check.
  int64_t message_id(int k, int64_t micro_batch) const { return k * options.chunks() + micro_batch; }

  void init(std::vector<torch::nn::Sequential> stages_or_model, bool whole_model);
  at::Tensor run_forward(int k, const at::Tensor& x, int64_t i, std::vector<pipeline::WeightPart>* parts);
  std::string what_failed(int k, const std::string& action, const std::exception& e) const;
  [[noreturn]] void fail_step(const at::Tensor& agreement);
  void sync_replicas();
};

}  // namespace dtrain
