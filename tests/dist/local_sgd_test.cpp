// LocalSGD and DiLoCo on 2 replicas, from the inside: what crosses the replica group (read back from
// this rank's flight record: one all-reduce of all P parameters per sync_every steps, nothing in
// between; streaming DiLoCo one fragment's elements per sync), what a sync leaves (the replicas equal,
// DiLoCo's original = the parameters, no gradients), a failed sync (a real one: rank 0's group times
// out because rank 1 is late, then rank 1 finds the group broken) that puts the parameters back to the
// last sync's and reports one line, and bad input refused in one line.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "dist_main.h"
#include "dtrain/errors.h"
#include "dtrain/local_sgd.h"
#include "flight_log.h"
#include "matchers.h"
#include "test_util.h"

using namespace dtrain;
using dtrain::test_util::dtrain_error_of;

namespace {

torch::nn::Sequential lsgd_model() {
  torch::nn::Sequential m(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3));
  m->to(at::kDouble);
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : m->parameters()) p.copy_(at::arange(p.numel(), at::kDouble).mul(0.37).add(k++).sin().view(p.sizes()));
  return m;
}

int64_t lsgd_numel(const std::vector<at::Tensor>& ps) {
  int64_t n = 0;
  for (const auto& p : ps) n += p.numel();
  return n;
}

// One inner step on this rank's own batch (the replicas' data differ).
void lsgd_inner_step(torch::nn::Sequential& m, torch::optim::Optimizer& opt, int s) {
  at::Tensor x = at::arange(20, at::kDouble).mul(0.1).add(0.9 * s + 3.0 * rank()).cos().view({4, 5});
  opt.zero_grad();
  m->forward(x).pow(2).mean().backward();
  opt.step();
}

std::vector<at::Tensor> lsgd_copy(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone());
  return out;
}

bool lsgd_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!at::equal(a[i], b[i])) return false;
  return true;
}

// The largest difference between the replicas' parameters (a collective on the default group).
double lsgd_spread(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> parts;
  for (const auto& p : ps) parts.push_back(p.detach().reshape({-1}));
  at::Tensor hi = at::cat(parts), lo = hi.clone();
  all_reduce(hi, ReduceOp::MAX);
  all_reduce(lo, ReduceOp::MIN);
  return (hi - lo).abs().max().item<double>();
}

torch::optim::SGDOptions lsgd_outer() { return torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true); }

// Every call made since `log` last looked was one all_reduce of `numel` elements on `group`.
void expect_one_all_reduce(FlightLog& log, const Group& group, int64_t numel, const std::string& where) {
  const auto calls = log.take();
  ASSERT_EQ(calls.size(), 1u) << where;
  EXPECT_EQ(calls[0].op, "all_reduce") << where;
  EXPECT_EQ(calls[0].ranks, ranks_text(group.ranks())) << where;
  EXPECT_EQ(calls[0].numel, numel) << where;
}

TEST(LocalSgd, AveragesEveryFiveStepsInOneAllReduceOfAllParameters) {
  expect_default_group_transport_from_env();
  auto m = lsgd_model();
  Group replicas = new_group({0, 1});
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  LocalSGD local(m->parameters(), 5, replicas);
  const int64_t P = lsgd_numel(m->parameters());
  FlightLog log;
  for (int s = 1; s <= 15; ++s) {
    lsgd_inner_step(m, opt, s);
    const bool synced = local.step();
    EXPECT_EQ(synced, s % 5 == 0) << "step " << s;
    if (s % 5 != 0) {
      EXPECT_TRUE(log.take().empty()) << "step " << s << ": nothing crosses the replicas between syncs";
      continue;
    }
    expect_one_all_reduce(log, replicas, P, "step " + std::to_string(s));
    if (s == 5 && rank() == 0)
      std::cout << "LocalSGD: " << P << " parameters, " << P * 8 << " bytes all-reduced per rank per 5 steps\n";
    EXPECT_EQ(lsgd_spread(m->parameters()), 0.0) << "step " << s << ": the replicas hold the average";
    log.take();
  }
}

TEST(DiLoCo, OneAllReduceOfThePseudoGradientPerSyncThenOriginalIsTheParameters) {
  auto m = lsgd_model();
  Group replicas = new_group({0, 1});
  torch::optim::AdamW inner(m->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::SGD outer(m->parameters(), lsgd_outer());
  DiLoCo diloco(m->parameters(), inner, outer, 5, replicas);
  const int64_t P = lsgd_numel(m->parameters());
  FlightLog log;
  for (int s = 1; s <= 10; ++s) {
    lsgd_inner_step(m, inner, s);
    EXPECT_EQ(diloco.step(), s % 5 == 0) << "step " << s;
    if (s % 5 != 0) {
      EXPECT_TRUE(log.take().empty()) << "step " << s;
      EXPECT_FALSE(lsgd_equal(diloco.original_parameters(), lsgd_copy(m->parameters()))) << "step " << s;
      continue;
    }
    expect_one_all_reduce(log, replicas, P, "step " + std::to_string(s));
    if (s == 5 && rank() == 0)
      std::cout << "DiLoCo: " << P << " parameters, " << P * 8 << " bytes all-reduced per rank per 5 steps\n";
    EXPECT_TRUE(lsgd_equal(diloco.original_parameters(), lsgd_copy(m->parameters())));
    for (const auto& p : m->parameters()) EXPECT_FALSE(p.grad().defined()) << "the outer zero_grad sets none";
    EXPECT_EQ(lsgd_spread(m->parameters()), 0.0) << "step " << s << ": every replica took the same outer step";
    log.take();
  }
  EXPECT_EQ(diloco.sync_count(), 2);
}

TEST(DiLoCo, StreamingSyncsOneFragmentPerAllReduceInTurn) {
  auto m = lsgd_model();
  Group replicas = new_group({0, 1});
  std::vector<std::vector<at::Tensor>> fragments = {m[0]->parameters(), m[2]->parameters()};
  torch::optim::SGD inner(m->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD outer0(fragments[0], lsgd_outer()), outer1(fragments[1], lsgd_outer());
  DiLoCo diloco(fragments, inner, {&outer0, &outer1}, 4, replicas);
  FlightLog log;
  for (int s = 1; s <= 8; ++s) {
    lsgd_inner_step(m, inner, s);
    EXPECT_EQ(diloco.step(), s % 2 == 0) << "step " << s;
    if (s % 2 != 0) {
      EXPECT_TRUE(log.take().empty());
      continue;
    }
    const size_t f = (s / 2 - 1) % 2;  // fragment 0 at steps 2 and 6, fragment 1 at 4 and 8
    expect_one_all_reduce(log, replicas, lsgd_numel(fragments[f]), "step " + std::to_string(s));
    EXPECT_EQ(lsgd_spread(fragments[f]), 0.0) << "step " << s << ": the synced fragment is the same everywhere";
    EXPECT_GT(lsgd_spread(fragments[1 - f]), 0.0) << "step " << s << ": the other one trained apart";
    log.take();
  }
}

// The bytes one rank sends per optimizer step, over a run of `steps`: every call the flight record
// holds must be an all-reduce on `group`, which a ring sends 2 (n - 1) / n of its payload for (n = 2:
// the payload once: half reduce-scattered, half all-gathered).
double lsgd_sent_bytes_per_step(FlightLog& log, const Group& group, int steps) {
  const auto calls = log.take();
  const double n = group.size();
  double sent = 0;
  for (const auto& c : calls) {
    EXPECT_EQ(c.op, "all_reduce");
    EXPECT_EQ(c.ranks, ranks_text(group.ranks()));
    sent += 2.0 * (n - 1) / n * static_cast<double>(c.bytes);
  }
  return sent / steps;
}

// float32, as a model trains: LocalSGD and DiLoCo with sync_every H send 4 P / H bytes per rank per
// step (P parameters), over a whole run, within 1%; DDP would send 4 P every step.
TEST(LocalSgd, AndDiLoCoSendFourPOverHBytesPerRankPerStepInFloat32) {
  torch::nn::Sequential m(torch::nn::Linear(32, 64), torch::nn::Tanh(), torch::nn::Linear(64, 10));
  const int64_t P = lsgd_numel(m->parameters());
  const int H = 10, steps = 40;
  const double expected = 4.0 * static_cast<double>(P) / H;
  Group replicas = new_group({0, 1});
  const auto run = [&](const std::function<void()>& step_and_sync) {
    FlightLog log;
    for (int s = 1; s <= steps; ++s) step_and_sync();
    return lsgd_sent_bytes_per_step(log, replicas, steps);
  };
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  LocalSGD local(m->parameters(), H, replicas);
  int s = 0;
  const auto inner = [&](torch::optim::Optimizer& o) {
    at::Tensor x = at::arange(8 * 32, at::kFloat).mul(0.01).add(0.3 * ++s + rank()).sin().view({8, 32});
    o.zero_grad();
    m->forward(x).pow(2).mean().backward();
    o.step();
  };
  const double lsgd = run([&] {
    inner(opt);
    local.step();
  });
  torch::optim::AdamW adamw(m->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::SGD outer(m->parameters(), lsgd_outer());
  DiLoCo diloco(m->parameters(), adamw, outer, H, replicas);
  const double dil = run([&] {
    inner(adamw);
    diloco.step();
  });
  // The pseudo-gradient in 16 bits: half the bytes (bfloat16; float16 where Gloo has no bfloat16 sum:
  // LibTorch 1.13's, without shared memory).
  const at::ScalarType half = TORCH_VERSION_MAJOR >= 2 || replicas.uses_shared_memory() ? at::kBFloat16 : at::kHalf;
  DiLoCo diloco_bf16(m->parameters(), adamw, outer, H, replicas, DiLoCoOptions().reduce_dtype(half));
  const double bf16 = run([&] {
    inner(adamw);
    diloco_bf16.step();
  });
  EXPECT_NEAR(lsgd, expected, 0.01 * expected) << "LocalSGD, P = " << P << ", H = " << H;
  EXPECT_NEAR(dil, expected, 0.01 * expected) << "DiLoCo, P = " << P << ", H = " << H;
  EXPECT_NEAR(bf16, expected / 2, 0.01 * expected) << "DiLoCo in " << half << ", P = " << P << ", H = " << H;
  for (const auto& p : m->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "back in the parameters' dtype";
  EXPECT_EQ(diloco.sync_count(), steps / H);
  if (rank() == 0)
    std::cout << "float32, P = " << P << ", H = " << H << ": bytes sent per rank per step LocalSGD " << lsgd
              << ", DiLoCo " << dil << " (in " << half << " " << bf16 << "), 4 P / H = " << expected << "\n";
}

// Rank 0's group times out after 2 s, rank 1's after 60 s; rank 1 comes to the sync only after rank 0
// has failed, and then finds the group broken (Note [Broken groups]). Both fail, both in one line.
Group lsgd_breakable_group() {
  return new_group({}, rank() == 0 ? std::chrono::milliseconds(2000) : std::chrono::milliseconds(60000));
}

template <typename Fn>
std::string lsgd_fail_late(Fn sync) {
  std::string e;
  if (rank() == 0) e = dtrain_error_of(sync);
  barrier();
  if (rank() != 0) e = dtrain_error_of(sync);
  return e;
}

void expect_sync_failure_line(const std::string& e, const std::string& algo, const std::string& now, const Group& g,
                              int64_t P) {
  const std::string head = "rank " + std::to_string(rank()) + ": " + algo;
  EXPECT_EQ(e.rfind(head, 0), 0u) << e;
  EXPECT_THAT(e, HasSubstr("all_reduce of " + std::to_string(P) + " elements on group '" + g.name() + "') failed; " +
                           now + ": "));
  EXPECT_THAT(e, Not(HasSubstr("\n"))) << "one line: " << e;
}

TEST(DiLoCo, AFailedSyncRestoresTheLastSyncsParametersAndThrowsOneLine) {
  auto m = lsgd_model();
  Group g = lsgd_breakable_group();
  torch::optim::AdamW inner(m->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::SGD outer(m->parameters(), lsgd_outer());
  DiLoCo diloco(m->parameters(), inner, outer, 2, g);
  for (int s = 1; s <= 2; ++s) {
    lsgd_inner_step(m, inner, s);
    diloco.step();
  }
  ASSERT_EQ(diloco.sync_count(), 1);
  const auto last_sync = lsgd_copy(m->parameters());
  lsgd_inner_step(m, inner, 3);
  ASSERT_FALSE(diloco.step());
  ASSERT_FALSE(lsgd_equal(last_sync, lsgd_copy(m->parameters())));
  lsgd_inner_step(m, inner, 4);
  const std::string e = lsgd_fail_late([&] { diloco.step(); });
  expect_sync_failure_line(e, "DiLoCo sync (fragment 0, ", "the parameters are back to the last sync's", g,
                           lsgd_numel(m->parameters()));
  EXPECT_TRUE(lsgd_equal(last_sync, lsgd_copy(m->parameters()))) << "the 2 inner steps since are discarded";
  EXPECT_TRUE(lsgd_equal(last_sync, diloco.original_parameters()));
  EXPECT_EQ(diloco.sync_count(), 1);
  EXPECT_EQ(diloco.local_step(), 0) << "the count starts again";
  std::cout << "rank " << rank() << " saw: " << e << "\n";
}

// torchft's fragment_sync_delay: the all-reduce leaves 2 steps before the sync point and is waited
// for at it; with fragment_update_alpha 0 the 2 inner steps it overlapped are the replica's own only
// until then: the fragment becomes the outer step's result, the same on every replica.
TEST(DiLoCo, WithFragmentSyncDelayTheAllReduceStartsThatManyStepsEarly) {
  auto m = lsgd_model();
  Group replicas = new_group({0, 1});
  torch::optim::SGD inner(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD outer(m->parameters(), lsgd_outer());
  DiLoCo diloco(m->parameters(), inner, outer, 5, replicas, DiLoCoOptions().fragment_sync_delay(2));
  const int64_t P = lsgd_numel(m->parameters());
  FlightLog log;
  for (int s = 1; s <= 10; ++s) {
    lsgd_inner_step(m, inner, s);
    EXPECT_EQ(diloco.step(), s % 5 == 0) << "step " << s;
    if (s % 5 == 3) {
      expect_one_all_reduce(log, replicas, P, "step " + std::to_string(s));
    } else {
      EXPECT_TRUE(log.take().empty()) << "step " << s << ": nothing but the one all-reduce, 2 steps early";
    }
    if (s % 5 == 0) {
      EXPECT_TRUE(lsgd_equal(diloco.original_parameters(), lsgd_copy(m->parameters()))) << "step " << s;
      EXPECT_EQ(lsgd_spread(m->parameters()), 0.0) << "step " << s << ": the overlapped steps are discarded";
      log.take();
    }
  }
  EXPECT_EQ(diloco.sync_count(), 2);
}

// A sync that fails while in flight fails at its point (or at its start, on the rank that finds the
// group already broken): the fragment goes back to the last sync's parameters either way.
TEST(DiLoCo, ADelayedSyncThatFailsRestoresTheLastSyncsParameters) {
  auto m = lsgd_model();
  Group g = lsgd_breakable_group();
  torch::optim::SGD inner(m->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD outer(m->parameters(), lsgd_outer());
  DiLoCo diloco(m->parameters(), inner, outer, 2, g, DiLoCoOptions().fragment_sync_delay(1));
  const auto initial = lsgd_copy(m->parameters());
  const std::string e = lsgd_fail_late([&] {
    for (int s = 1; s <= 2; ++s) {
      lsgd_inner_step(m, inner, s);
      diloco.step();
    }
  });
  expect_sync_failure_line(e, "DiLoCo sync (fragment 0, ", "the parameters are back to the last sync's", g,
                           lsgd_numel(m->parameters()));
  EXPECT_TRUE(lsgd_equal(initial, lsgd_copy(m->parameters())));
  EXPECT_EQ(diloco.sync_count(), 0);
  EXPECT_EQ(diloco.local_step(), 0) << "the round starts again";
}

TEST(LocalSgd, AFailedSyncLeavesTheParametersAsTheyWereAndThrowsOneLine) {
  auto m = lsgd_model();
  Group g = lsgd_breakable_group();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.05));
  LocalSGD local(m->parameters(), 1, g);
  lsgd_inner_step(m, opt, 1);
  const auto before = lsgd_copy(m->parameters());
  const std::string e = lsgd_fail_late([&] { local.step(); });
  expect_sync_failure_line(e, "LocalSGD sync (", "the parameters are this rank's own, not averaged", g,
                           lsgd_numel(m->parameters()));
  EXPECT_TRUE(lsgd_equal(before, lsgd_copy(m->parameters())));
}

TEST(DiLoCo, BadInputIsRefusedInOneLine) {
  auto m = lsgd_model();
  auto other = lsgd_model();
  torch::optim::SGD inner(m->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD outer(m->parameters(), lsgd_outer()), stranger(other->parameters(), lsgd_outer());
  const auto one_line = [](const std::string& what) {
    return ThrowsDtrainError(AllOf(HasSubstr(what), Not(HasSubstr("\n"))));
  };
  EXPECT_THAT([&] { DiLoCo(m->parameters(), inner, outer, 0); },
              one_line("DiLoCo: sync_every is 0: it must be at least 1 (optimizer steps)"));
  EXPECT_THAT([&] { LocalSGD(m->parameters(), -3); },
              one_line("LocalSGD: sync_every is -3: it must be at least 1 (optimizer steps)"));
  EXPECT_THAT([&] { LocalSGD(m->parameters(), 5, LocalSgdAverage()); },
              one_line("LocalSGD: the Average function is empty: pass a function that averages over the replicas, "
                       "or a Group"));
  EXPECT_THAT([&] { LocalSGD({}, 5); },
              one_line("LocalSGD: no parameters in the parameters: pass the model's parameters()"));
  EXPECT_THAT([&] { DiLoCo(m->parameters(), inner, stranger, 5); },
              one_line("DiLoCo: parameter 0 of the parameters is not in the outer optimizer's param_groups: build the "
                       "outer optimizer over the same parameters"));
  std::vector<std::vector<at::Tensor>> fragments = {m[0]->parameters(), m[2]->parameters()};
  torch::optim::SGD o0(fragments[0], lsgd_outer()), o1(fragments[1], lsgd_outer());
  EXPECT_THAT(
      [&] {
        DiLoCo(fragments, inner, {&o0, &o1}, 5);
      },
      one_line("DiLoCo: sync_every is 5 with 2 fragments: it must be a multiple of the number of fragments"));
  EXPECT_THAT([&] { DiLoCo(fragments, inner, {&o0}, 4); },
              one_line("DiLoCo: 1 outer optimizers for 2 fragments: pass one outer optimizer per fragment"));
  EXPECT_THAT(
      [&] {
        DiLoCo(fragments, inner, {&o1, &o0}, 4);
      },
      one_line("DiLoCo: parameter 0 of fragment 0 is not in the outer optimizer 0's param_groups"));
  EXPECT_THAT(
      [&] {
        DiLoCo(fragments, inner, {&o0, &o1}, 4, Group(), DiLoCoOptions().fragment_sync_delay(2));
      },
      one_line("DiLoCo: fragment_sync_delay is 2 with sync_every 4 and 2 fragment(s): it must be in [0, 2) (a "
               "fragment's sync must finish before its next one starts)"));
  EXPECT_THAT([&] { DiLoCo(m->parameters(), inner, outer, 5, Group(), DiLoCoOptions().reduce_dtype(at::kInt)); },
              one_line("DiLoCo: reduce_dtype is Int: pass a floating-point dtype (at::kBFloat16, at::kHalf, "
                       "at::kFloat) or none"));
  EXPECT_THAT([&] { DiLoCo(m->parameters(), inner, outer, 5, Group(), DiLoCoOptions().fragment_update_alpha(1.5)); },
              one_line("DiLoCo: fragment_update_alpha is 1.5: it must be in [0, 1] (the share of the replica's own "
                       "parameters kept)"));
  EXPECT_THAT(
      [&] {
        LocalSGD({m[0]->parameters()[0], m[0]->parameters()[1].to(at::kFloat)}, 5);
      },
      one_line("LocalSGD: parameter 1 of the parameters is Float on cpu but parameter 0 is Double on cpu: "
               "cast the model to one dtype and device (model->to(...)) first"));
}

}  // namespace

int main(int argc, char** argv) {
  OwnFlightDir flight_dir("dtrain_local_sgd_flight");
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new DistEnvironment());
  return RUN_ALL_TESTS();
}
