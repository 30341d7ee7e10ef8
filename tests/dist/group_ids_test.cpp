// Objects built on a subgroup before one on the whole world (on 3 and 4 real ranks).
//
// The ranks outside the subgroup build nothing on it, so anything numbered by a process-wide count
// of objects differs between them and the subgroup's ranks once the world's object comes: a
// pipeline's message tags (neighbours then wait on different tags and hang) or DDP's store keys
// (each rank reads keys its peers never write). Identifiers must be agreed per group
// (Note [Group-agreed ids]). Each test here runs that sequence first thing in its own subgroup, and
// checks the results against one process, so a wrong id fails or hangs (until DTRAIN_TIMEOUT_S).
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/pipeline.h"
#include "pipeline_models.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;
using namespace dtrain::test_pipeline;
using torch::nn::Linear;
using torch::nn::Sequential;

namespace {

// The subgroup: every rank but the last, so the last rank (outside it) is a neighbour of a member
// in the world's pipeline, and the world's DDP mixes members with a non-member.
std::vector<int> sub_ranks() {
  std::vector<int> r;
  for (int i = 0; i + 1 < world_size(); ++i) r.push_back(i);
  return r;
}

bool in(const std::vector<int>& ranks, int r) { return std::find(ranks.begin(), ranks.end(), r) != ranks.end(); }

// --- Pipeline ---------------------------------------------------------------------------------------

// A pipeline beside one process training the whole model: each step() trains both one SGD step on the
// step's batch and expects the same output, loss and parameters.
class CheckedPipeline {
 public:
  explicit CheckedPipeline(PipelineOptions options)
      : pipe_(make_model(), std::move(options)), opt_(pipe_.parameters(), 0.1), ref_opt_(ref_->parameters(), 0.1) {}

  void step(int n, const std::string& what) {
    SCOPED_TRACE(what);
    auto [x, y] = batch(n);
    ref_opt_.zero_grad();
    at::Tensor ref_out = ref_->forward(x);
    at::Tensor ref_loss = loss_fn(ref_out, y);
    ref_loss.backward();
    ref_opt_.step();

    opt_.zero_grad();
    auto r = pipe_.step(x, y, loss_fn);
    opt_.step();
    EXPECT_NEAR(r.loss, ref_loss.item<double>(), 1e-12);
    if (pipe_.is_last()) {
      EXPECT_TRUE(at::allclose(r.output, ref_out.detach(), 0, 1e-12)) << r.output << ref_out;
    }
    EXPECT_LT(stage_diff(pipe_, ref_), 1e-12);
  }
  const Pipeline& pipe() const { return pipe_; }

 private:
  Pipeline pipe_;
  torch::optim::SGD opt_;
  Sequential ref_ = make_model();
  torch::optim::SGD ref_opt_;
};

TEST(GroupIds, PipelineOnASubgroupThenOnTheWorld) {
  const auto ranks = sub_ranks();
  Group sub = new_group(ranks);  // every rank, members or not
  std::unique_ptr<CheckedPipeline> on_sub;
  if (in(ranks, rank())) {
    on_sub = std::make_unique<CheckedPipeline>(PipelineOptions().process_group(sub).chunks(2));
    on_sub->step(1, "the subgroup's pipeline");
  }
  CheckedPipeline on_world(PipelineOptions().chunks(2));
  ASSERT_EQ(on_world.pipe().num_stages(), world_size());
  on_world.step(2, "the world's pipeline");
  // Both stay usable side by side, and a second pipeline on the subgroup gets tags of its own.
  if (on_sub) {
    CheckedPipeline again(PipelineOptions().process_group(sub).chunks(4));
    again.step(3, "a second pipeline on the subgroup");
    on_sub->step(4, "the subgroup's first pipeline, again");
  }
  on_world.step(5, "the world's pipeline, again");
}

// --- DDP --------------------------------------------------------------------------------------------

Linear make_linear(int64_t in_features) {
  torch::manual_seed(5);
  Linear m(in_features, 3);
  m->to(at::kDouble);
  return m;
}

at::Tensor input_of(int r) { return at::randn({4, 5}, at::make_generator<at::CPUGeneratorImpl>(50 + r), at::kDouble); }

// After one backward through DDP on `group`, every gradient is the mean over the group's ranks of the
// gradient each would compute alone on its own input.
void expect_mean_gradients(const Group& group, const std::string& what) {
  SCOPED_TRACE(what);
  DistributedDataParallel ddp(make_linear(5), DDPOptions().process_group(group));
  ddp(input_of(rank())).pow(2).sum().backward();
  std::vector<at::Tensor> want;
  for (int r : group.ranks()) {
    Linear alone = make_linear(5);
    alone(input_of(r)).pow(2).sum().backward();
    const auto ps = alone->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      at::Tensor g = ps[i].grad() / group.size();
      if (want.size() <= i)
        want.push_back(g);
      else
        want[i] += g;
    }
  }
  const auto got = ddp.module()->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(at::allclose(got[i].grad(), want[i], 0, 1e-12)) << "parameter " << i;
}

TEST(GroupIds, DDPOnASubgroupThenOnTheWorld) {
  const auto ranks = sub_ranks();
  Group sub = new_group(ranks);
  if (in(ranks, rank())) expect_mean_gradients(sub, "DDP on the subgroup");
  expect_mean_gradients(Group(), "DDP on the world");
  // A model that differs on the last rank: every rank must get the explanation, which DDP exchanges
  // through the store under its id; ranks disagreeing on the id wait for keys nobody writes.
  const std::string err =
      test_util::error_of([&] { DistributedDataParallel bad(make_linear(rank() + 1 == world_size() ? 6 : 5)); });
  EXPECT_THAT(err, HasSubstr("ranks disagree on the model")) << err;
  EXPECT_THAT(err, HasSubstr("first difference at parameter #")) << err;
  if (in(ranks, rank())) expect_mean_gradients(sub, "DDP on the subgroup, again");
}

}  // namespace

DTRAIN_DIST_TEST_MAIN()
