// A DDP training loop (an MLP on random data) in which one rank misbehaves at one step, for the
// flight recorder's tests (tests/dist/test_flight_recorder.py). Each step: forward, backward (DDP's
// gradient all_reduce), an all_reduce of the loss, the optimizer's step.
//
//   flight_program --fault skip|stop|compute|other_op|size|p2p|unwaited|none [--bad_rank 1] [--at_step 5]
//                  [--steps 20]
//
//   skip      the bad rank skips the loss's all_reduce at the step
//   stop      the bad rank stops itself (SIGSTOP) at the step, as a debugger or an operator would
//   compute   the bad rank computes (sleeps) for 60 s at the step, outside any collective
//   other_op  the bad rank broadcasts the loss where the others all_reduce it
//   size      the bad rank all_reduces 5 values where the others all_reduce 4
//   p2p       no DDP: a pipeline of stages (rank r receives activations from r-1 and sends to r+1);
//             the bad rank's stage runs `at_step` micro-batches where the others run `steps`
//   unwaited  no fault: at the step every rank starts an asynchronous all_reduce, drops it unwaited and
//             computes for 3 s (no stall: the call completed)
// Prints "flight_program: done" on rank 0 when the loop ends; errors exit 1 with the message.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/ddp.h"
#include "dtrain/process_group.h"

namespace {

struct Args {
  std::string fault = "none";
  int bad_rank = 1;
  int at_step = 5;
  int steps = 20;
};

void train(const Args& a, int rank) {
  torch::manual_seed(0);
  torch::nn::Sequential mlp(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 10));
  dtrain::DistributedDataParallel ddp(mlp);
  torch::optim::SGD opt(ddp.parameters(), 0.01);
  const at::Tensor x = at::randn({16, 32}), y = at::randint(0, 10, {16});
  for (int step = 0; step < a.steps; ++step) {
    const bool bad = rank == a.bad_rank && step == a.at_step;
    if (bad && a.fault == "stop") raise(SIGSTOP);
    if (bad && a.fault == "compute") std::this_thread::sleep_for(std::chrono::seconds(60));
    if (step == a.at_step && a.fault == "unwaited") {
      at::Tensor unused = at::ones({4});
      dtrain::all_reduce(unused, dtrain::ReduceOp::SUM, dtrain::Group(), /*async_op=*/true);
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    opt.zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(ddp(x), y);
    loss.backward();
    at::Tensor report = a.fault == "size" && bad ? at::zeros({5}) : at::zeros({4});
    report[0] = loss.item<float>();
    if (bad && a.fault == "skip") {
      // skipped
    } else if (bad && a.fault == "other_op") {
      dtrain::broadcast(report, 0);
    } else {
      dtrain::all_reduce(report);
    }
    opt.step();
  }
}

void pipeline(const Args& a, int rank, int world) {
  const int micro_batches = rank == a.bad_rank ? a.at_step : a.steps;
  at::Tensor act = at::zeros({8, 16});
  for (int m = 0; m < micro_batches; ++m) {
    if (rank > 0) dtrain::recv(act, rank - 1);
    act = act + 1;  // this stage's work
    if (rank + 1 < world) dtrain::send(act, rank + 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flight_program"};
  Args a;
  app.add_option("--fault", a.fault)
      ->check(CLI::IsMember({"skip", "stop", "compute", "other_op", "size", "p2p", "unwaited", "none"}));
  app.add_option("--bad_rank", a.bad_rank);
  app.add_option("--at_step", a.at_step);
  app.add_option("--steps", a.steps);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    dtrain::init_process_group();
    const int rank = dtrain::rank();
    if (a.fault == "p2p")
      pipeline(a, rank, dtrain::world_size());
    else
      train(a, rank);
    dtrain::barrier();
    if (rank == 0) std::printf("flight_program: done\n");
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flight_program: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
