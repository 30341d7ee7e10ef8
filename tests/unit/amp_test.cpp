// Autocast scopes and GradScaler semantics (PyTorch's torch.autocast / GradScaler).
#include "dtrain/amp.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>
#include "compat/amp_compat.h"
#include "test_util.h"
#include "matchers.h"

using dtrain::Autocast;
using dtrain::GradScaler;
using dtrain::GradScalerOptions;

namespace {
using dtrain::test_util::error_of;

// Whether CPU autocast is on (LibTorch 2.4 replaced is_cpu_enabled() by is_autocast_enabled(device)).
bool cpu_autocast_on() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}
}  // namespace

TEST(Autocast, CpuComputesMatmulAndConvInBfloat16AndKeepsLossInFloat32) {
  at::Tensor a = at::randn({8, 8});
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, 2, 3));
  {
    Autocast ac(at::kCPU);
    EXPECT_TRUE(cpu_autocast_on());
    at::Tensor mm = at::mm(a, a);
    EXPECT_EQ(mm.scalar_type(), at::kBFloat16);
    EXPECT_EQ(conv(at::randn({1, 1, 5, 5})).scalar_type(), at::kBFloat16);
    EXPECT_EQ((a + a).scalar_type(), at::kFloat);  // not on the lower-precision list
    // cross_entropy stays in float32 (PyTorch 1.13's CPU fp32 list), as python3-torch shows.
    auto loss = torch::nn::functional::cross_entropy(mm, at::arange(8) % 4);
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(cpu_autocast_on());
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kFloat);
}

TEST(Autocast, NestsAndRestoresThePreviousState) {
  at::Tensor a = at::randn({4, 4});
  {
    Autocast outer(at::kCPU);
    {
      Autocast inner(at::kCPU, at::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(at::mm(a, a).scalar_type(), at::kFloat);
    }
    EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(cpu_autocast_on());
}

TEST(Autocast, RejectsUnsupportedTypes) {
  EXPECT_THAT(error_of([] { Autocast ac(at::kCPU, at::kDouble); }), HasSubstr("Autocast on CPU supports"));
  if (dtrain::compat::kAutocastCpuHalf) {  // LibTorch 2.4 added float16 to CPU autocast
    Autocast ac(at::kCPU, at::kHalf);
    EXPECT_EQ(at::mm(at::randn({4, 4}), at::randn({4, 4})).scalar_type(), at::kHalf);
  } else {
    EXPECT_THAT(error_of([] { Autocast ac(at::kCPU, at::kHalf); }), HasSubstr("only bfloat16"));
  }
  EXPECT_FALSE(cpu_autocast_on());
}

namespace {
struct Fixture {
  torch::nn::Linear lin{4, 2};
  torch::optim::SGD opt{lin->parameters(), 0.1};
  at::Tensor x = at::randn({3, 4});
  at::Tensor loss() { return lin(x).pow(2).sum(); }
};
}  // namespace

TEST(GradScaler, ScaleUnscaleRoundTrip) {
  Fixture f;
  f.loss().backward();
  at::Tensor expected = f.lin->weight.grad().clone();
  f.opt.zero_grad();
  GradScaler scaler;
  at::Tensor scaled = scaler.scale(f.loss());
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 65536.0);
  scaled.backward();
  EXPECT_TRUE(at::allclose(f.lin->weight.grad(), expected * 65536.0, 1e-5));
  scaler.unscale_(f.opt);
  EXPECT_TRUE(at::allclose(f.lin->weight.grad(), expected, 1e-5));
  EXPECT_TRUE(scaler.step(f.opt));
  scaler.update();
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScaler, InfOrNanSkipsTheStepAndHalvesTheScale) {
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    Fixture f;
    GradScaler scaler;
    at::Tensor before = f.lin->weight.detach().clone();
    scaler.scale(f.loss() * bad).backward();
    EXPECT_FALSE(scaler.step(f.opt));
    scaler.update();
    EXPECT_TRUE(at::equal(f.lin->weight, before));
    EXPECT_DOUBLE_EQ(scaler.get_scale(), 32768.0);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, GrowsAfterGrowthIntervalCleanSteps) {
  Fixture f;
  GradScaler scaler(GradScalerOptions().init_scale(8).growth_interval(3));
  for (int i = 0; i < 3; ++i) {
    f.opt.zero_grad();
    scaler.scale(f.loss()).backward();
    EXPECT_TRUE(scaler.step(f.opt));
    scaler.update();
    EXPECT_DOUBLE_EQ(scaler.get_scale(), i < 2 ? 8.0 : 16.0);
  }
  EXPECT_EQ(scaler.growth_tracker(), 0);
  scaler.update(4.0);  // an explicit new scale
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 4.0);
}

// PyTorch's _amp_update_scale_ multiplies the float scale by the double factor in double and rounds
// once. With factors that are not powers of two, rounding the factor to float first drifts by an ulp
// from the first backoff on. 60 steps, an overflow every 7th and 11th, growth every 3 clean steps.
static float pytorch_update(float scale, int32_t& tracker, bool overflow, double growth, double backoff,
                            int32_t interval) {
  if (overflow) {
    tracker = 0;
    return static_cast<float>(static_cast<double>(scale) * backoff);
  }
  if (++tracker < interval) return scale;
  tracker = 0;
  const float grown = static_cast<float>(static_cast<double>(scale) * growth);
  return std::isfinite(grown) ? grown : scale;
}

TEST(GradScaler, ScaleTrajectoryMatchesPyTorchBitForBitWithOddFactors) {
  Fixture f;
  GradScaler scaler(GradScalerOptions().init_scale(1000.0).growth_factor(1.7).backoff_factor(0.3).growth_interval(3));
  float expected = 1000.0f;
  int32_t tracker = 0;
  for (int step = 1; step <= 60; ++step) {
    const bool overflow = step % 7 == 0 || step % 11 == 0;
    f.opt.zero_grad();
    scaler.scale(overflow ? f.loss() * std::numeric_limits<double>::infinity() : f.loss()).backward();
    scaler.step(f.opt);
    scaler.update();
    expected = pytorch_update(expected, tracker, overflow, 1.7, 0.3, 3);
    ASSERT_EQ(static_cast<float>(scaler.get_scale()), expected) << "step " << step;
    ASSERT_EQ(scaler.growth_tracker(), tracker) << "step " << step;
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  // The reference above is ATen's own CPU kernel (LibTorch >= 2.3 has one) to the last bit.
  at::Tensor s = at::full({1}, 1000.0f), t = at::zeros({1}, at::kInt);
  float mine = 1000.0f;
  int32_t my_tracker = 0;
  for (int step = 1; step <= 60; ++step) {
    const bool overflow = step % 7 == 0 || step % 11 == 0;
    at::_amp_update_scale_(s, t, at::full({1}, overflow ? 1.0f : 0.0f), 1.7, 0.3, 3);
    mine = pytorch_update(mine, my_tracker, overflow, 1.7, 0.3, 3);
    ASSERT_EQ(s.item<float>(), mine) << "step " << step;
  }
#endif
}

TEST(GradScaler, UnscaleTwiceAndStepTwiceAreErrors) {
  Fixture f;
  GradScaler scaler;
  scaler.scale(f.loss()).backward();
  scaler.unscale_(f.opt);
  EXPECT_THAT(error_of([&] { scaler.unscale_(f.opt); }), HasSubstr("already been called"));
  scaler.step(f.opt);
  EXPECT_THAT(error_of([&] { scaler.step(f.opt); }), HasSubstr("step() has already been called"));
  EXPECT_THAT(error_of([&] { scaler.unscale_(f.opt); }), HasSubstr("after step()"));
  scaler.update();
  scaler.scale(f.loss()).backward();
  scaler.unscale_(f.opt);  // fine again after update()
}

TEST(GradScaler, StateDictAndArchiveRoundTrip) {
  Fixture f;
  GradScaler a(GradScalerOptions().init_scale(1024).growth_interval(5));
  for (int i = 0; i < 2; ++i) {
    a.scale(f.loss()).backward();
    a.step(f.opt);
    a.update();
  }
  auto sd = a.state_dict();
  EXPECT_DOUBLE_EQ(sd.at("scale"), 1024.0);
  EXPECT_DOUBLE_EQ(sd.at("_growth_tracker"), 2.0);
  EXPECT_DOUBLE_EQ(sd.at("growth_interval"), 5.0);
  GradScaler b;
  b.load_state_dict(sd);
  EXPECT_EQ(b.state_dict(), sd);

  torch::serialize::OutputArchive out;
  a.save(out);
  std::stringstream ss;
  out.save_to(ss);
  torch::serialize::InputArchive in;
  in.load_from(ss);
  GradScaler c;
  c.load(in);
  EXPECT_EQ(c.state_dict(), sd);
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Fixture f;
  GradScaler scaler(GradScalerOptions().enabled(false));
  at::Tensor l = f.loss();
  EXPECT_TRUE(at::equal(scaler.scale(l), l));
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

TEST(GradScaler, BadOptionsAreClearErrors) {
  EXPECT_THAT(error_of([] { GradScaler s(GradScalerOptions().growth_factor(0.5)); }),
              HasSubstr("growth_factor must be > 1"));
  EXPECT_THAT(error_of([] { GradScaler s(GradScalerOptions().init_scale(-1)); }),
              HasSubstr("init_scale must be > 0, got -1"));
}
