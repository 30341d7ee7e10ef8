// Join for uneven inputs: the per-iteration exchange of the active set, the joined rank's shadow loop
// and the scope's bookkeeping (protocol in include/dtrain/join.h).
#include "dtrain/join.h"

#include <algorithm>
#include <exception>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>

#include "comm/state.h"

namespace dtrain {

namespace detail {
struct JoinContext {
  Group group;
  JoinOptions options;
  bool joined = false;     // this rank called join()
  int64_t iterations = 0;  // iterations so far, notified or shadowed (the same count on every rank)
  int64_t exchanges = 0;   // iterations and joinables' own rounds
  JoinIteration current;   // the latest exchange
  JoinIteration last;      // the latest exchange in which some rank was active
};
}  // namespace detail

namespace {

// PyTorch warns when a joined rank has shadowed this many iterations: a skew that large is more
// likely a bug (one rank's loader restarting, say) than uneven data.
constexpr int64_t kSkewWarnIterations = 1000;

std::string join_ranks(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

// Open Joins of this process that have not joined yet (Join::could_strand).
std::mutex open_mu;
std::vector<const detail::JoinContext*> open_joins;

// What a tag (1 + the position of the joinable that notified) says, for error messages.
std::string call_of(int64_t tag) {
  if (tag == 1) return "joinable #0's iteration (e.g. DistributedDataParallel's forward)";
  return detail::cat("joinable #", tag - 1, "'s own round (e.g. ZeroRedundancyOptimizer::step)");
}

// The active ranks of one exchange were at different calls: the same text on every rank.
[[noreturn]] void throw_mixed_calls(const detail::JoinContext& ctx, const std::vector<int64_t>& tags) {
  std::vector<int64_t> seen;
  for (int64_t t : tags)
    if (t != 0 && std::find(seen.begin(), seen.end(), t) == seen.end()) seen.push_back(t);
  std::ostringstream where;
  for (size_t i = 0; i < seen.size(); ++i) {
    std::vector<int> ranks;
    for (size_t r = 0; r < tags.size(); ++r)
      if (tags[r] == seen[i]) ranks.push_back(ctx.group.ranks()[r]);
    where << (i ? ", " : "") << "rank" << (ranks.size() > 1 ? "s " : " ") << join_ranks(ranks) << " at "
          << call_of(seen[i]);
  }
  throw Error(detail::cat("rank ", rank(), ": dtrain::Join: after ", ctx.iterations,
                          " iteration(s) the active ranks are at different calls: ", where.str(),
                          ": every active rank must make the same calls in the same order (an optimizer step "
                          "skipped on some ranks only? GradScaler skips alike only where the gradients are alike, "
                          "as DDP's averages are)"));
}

// Step 1 / 1b / 2: one all-reduce; each member adds its tag (1 + the position of the joinable that
// notified) at its own group rank while it is active, 0 once it has joined.
JoinIteration exchange(detail::JoinContext& ctx, bool active, int position) {
  std::vector<int64_t> mine(static_cast<size_t>(ctx.group.size()), 0);
  if (active) mine[static_cast<size_t>(ctx.group.rank())] = position + 1;
  std::vector<int64_t> all;
  try {
    all = all_reduce_values(mine, ReduceOp::SUM, ctx.group);
  } catch (const std::exception& e) {
    throw Error(detail::cat("rank ", rank(), ": dtrain::Join: the exchange of active ranks at iteration ",
                            ctx.iterations, " (exchange ", ctx.exchanges, ") failed: ", e.what()));
  }
  ++ctx.exchanges;
  JoinIteration it;
  int64_t tag = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == 0) continue;
    it.active.push_back(static_cast<int>(r));
    if (tag != 0 && all[r] != tag) throw_mixed_calls(ctx, all);
    tag = all[r];
  }
  it.joinable = tag > 0 ? static_cast<int>(tag - 1) : 0;
  // A joinable's own round belongs to the iteration in progress.
  it.index = it.joinable == 0 ? ctx.iterations++ : ctx.iterations - 1;
  ctx.current = it;
  if (!it.active.empty()) ctx.last = it;
  return it;
}

// The same text on every rank: everyone saw the same exchange.
[[noreturn]] void throw_early_termination(const detail::JoinContext& ctx, const JoinIteration& it) {
  std::vector<int> out;
  for (int r = 0; r < ctx.group.size(); ++r)
    if (!std::binary_search(it.active.begin(), it.active.end(), r)) out.push_back(ctx.group.ranks()[r]);
  throw Error(detail::cat("rank ", rank(), ": dtrain::Join: rank", out.size() > 1 ? "s " : " ", join_ranks(out),
                          " ran out of inputs first, at iteration ", it.index, " (after ", it.index,
                          " iterations), and throw_on_early_termination is set, so every rank stops here: "
                          "give every rank the same number of batches, or leave throw_on_early_termination "
                          "false to let the ranks that ran out shadow the others"));
}

// Python's Join (include/dtrain/join.h): one all-reduce of `value` in the default dtype (Python's
// torch.ones(1) and torch.zeros(1): float32 unless the program set another default), its sum.
double python_all_reduce(const detail::JoinContext& ctx, double value) {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::get_default_dtype()));
  try {
    all_reduce(t, ReduceOp::SUM, ctx.group);
  } catch (const std::exception& e) {
    throw Error(detail::cat("rank ", rank(), ": dtrain::Join: the exchange of active ranks at iteration ",
                            ctx.iterations, " failed: ", e.what()));
  }
  return t.item<double>();
}

JoinIteration python_iteration(detail::JoinContext& ctx, double active) {
  JoinIteration it;
  it.index = ctx.iterations++;
  it.python_active_count = static_cast<int>(active);
  ctx.current = it;
  if (it.python_active_count > 0) ctx.last = it;
  return it;
}

bool pytorch_peers() { return comm::world_state().pytorch_peers; }

}  // namespace

int JoinIteration::authoritative_rank(const Group& group) const {
  return group.ranks()[active.empty() ? 0 : active.front()];
}

Joinable::~Joinable() = default;

const JoinIteration* Joinable::join_iteration() const {
  if (!context_ || !context_->options.enable() || context_->current.index < 0) return nullptr;
  return &context_->current;
}

bool Joinable::is_first_joinable() const { return join_position() == 0; }

int Joinable::join_position() const { return context_ && context_->options.enable() ? position_ : -1; }

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : joinables_(std::move(joinables)), options_(options), uncaught_at_entry_(std::uncaught_exceptions()) {
  DTRAIN_CHECK(!joinables_.empty(),
               "dtrain::Join: no joinables given: pass the objects whose collectives to shadow, e.g. "
               "Join({&ddp, &optimizer})");
  for (size_t i = 0; i < joinables_.size(); ++i) {
    DTRAIN_CHECK(joinables_[i] != nullptr, "dtrain::Join: joinable #", i, " is null: pass constructed objects");
    for (size_t j = 0; j < i; ++j)
      DTRAIN_CHECK(joinables_[j] != joinables_[i], "dtrain::Join: joinable #", i, " is joinable #", j,
                   " again: list each object once");
    DTRAIN_CHECK(!joinables_[i]->context_, "dtrain::Join: joinable #", i,
                 " is already inside another Join: finish that one (join()) before entering a new one");
  }
  auto ctx = std::make_shared<detail::JoinContext>();
  ctx->group = joinables_[0]->join_process_group();
  ctx->options = options_;
  for (size_t i = 1; i < joinables_.size(); ++i) {
    const Group g = joinables_[i]->join_process_group();
    DTRAIN_CHECK(g.name() == ctx->group.name(), "dtrain::Join: joinable #", i, " communicates over group '", g.name(),
                 "' but joinable #0 over '", ctx->group.name(),
                 "': every joinable of one Join must use the same process group");
  }
  DTRAIN_CHECK(ctx->group.is_member(), "dtrain::Join: rank ", rank(), " is not a member of group '", ctx->group.name(),
               "': enter the Join only on the group's ranks");
  context_ = ctx;
  for (size_t i = 0; i < joinables_.size(); ++i) {
    joinables_[i]->context_ = ctx;
    joinables_[i]->position_ = static_cast<int>(i);
  }
  try {
    for (Joinable* j : joinables_) hooks_.push_back(j->join_hook(options_));
  } catch (...) {
    for (Joinable* j : joinables_) j->context_.reset();
    throw;
  }
  if (options_.enable()) {
    std::lock_guard<std::mutex> g(open_mu);
    open_joins.push_back(context_.get());
  }
}

Join::~Join() noexcept(false) {
  // Unwinding (this rank failed, or throw_on_early_termination fired): no collective, only leave.
  if (!joined_ && std::uncaught_exceptions() == uncaught_at_entry_) {
    join();
    return;
  }
  leave();
}

void Join::join() {
  DTRAIN_CHECK(!joined_, "dtrain::Join::join called twice on rank ", rank(), ": call it once, after the loop");
  joined_ = true;
  try {
    if (options_.enable()) shadow_until_all_joined();
  } catch (...) {
    leave();  // the joinables leave the scope however join() ends
    throw;
  }
  leave();
}

void Join::shadow_until_all_joined() {
  detail::JoinContext& ctx = *context_;
  ctx.joined = true;
  {
    std::lock_guard<std::mutex> g(open_mu);
    open_joins.erase(std::remove(open_joins.begin(), open_joins.end(), context_.get()), open_joins.end());
  }
  bool is_last_joiner = true;
  if (pytorch_peers()) {
    for (;;) {  // Python's loop: the count of active ranks, then every main hook
      const double active = python_all_reduce(ctx, 0.0);
      if (active == 0) break;
      if (options_.throw_on_early_termination()) {
        python_all_reduce(ctx, 1.0);  // tells the active ranks to stop too
        throw Error(detail::cat("rank ", rank(), ": dtrain::Join: this rank ran out of inputs first, at iteration ",
                                ctx.iterations, ", and throw_on_early_termination is set, so every rank stops here"));
      }
      is_last_joiner = false;
      const JoinIteration it = python_iteration(ctx, active);
      for (auto& h : hooks_) h->main_hook(it);
    }
    for (auto& h : hooks_) h->post_hook(is_last_joiner, ctx.last);
    return;
  }
  for (int64_t shadowed = 0;;) {
    // Step 2.
    const JoinIteration it = exchange(ctx, /*active=*/false, /*position=*/0);
    if (it.active.empty()) break;
    if (options_.throw_on_early_termination()) throw_early_termination(ctx, it);
    is_last_joiner = false;
    if (it.joinable != 0) {  // step 1b's round: its joinable's hook alone
      DTRAIN_CHECK(it.joinable < static_cast<int>(hooks_.size()), "rank ", rank(), ": dtrain::Join: the active ranks ",
                   "started a round of joinable #", it.joinable, " but this rank's Join has ", hooks_.size(),
                   " joinable(s): enter the same Join (the same joinables, in the same order) on every rank");
      hooks_[static_cast<size_t>(it.joinable)]->main_hook(it);
      continue;
    }
    if (shadowed++ == kSkewWarnIterations)
      warn_once("join-skew", detail::cat("dtrain::Join: rank ", rank(), " has shadowed ", kSkewWarnIterations,
                                         " iterations of the other ranks: inputs this uneven may be a bug"));
    for (auto& h : hooks_) h->main_hook(it);
  }
  // Step 3.
  for (auto& h : hooks_) h->post_hook(is_last_joiner, ctx.last);
}

void Join::leave() {
  {
    std::lock_guard<std::mutex> g(open_mu);
    open_joins.erase(std::remove(open_joins.begin(), open_joins.end(), context_.get()), open_joins.end());
  }
  for (Joinable* j : joinables_)
    if (j->context_ == context_) j->context_.reset();
}

const JoinIteration* Join::notify_join_context(Joinable& joinable) {
  if (joinable.join_position() != 0) return nullptr;
  detail::JoinContext* ctx = joinable.context_.get();
  if (!pytorch_peers() || ctx->joined) return notify_own_round(joinable);
  // Python's step 1: a 1 from every active rank, then (throw_on_early_termination) a 0 that a
  // joined rank's 1 turns into the signal to stop.
  const double active = python_all_reduce(*ctx, 1.0);
  if (ctx->options.throw_on_early_termination() && python_all_reduce(*ctx, 0.0) != 0)
    throw Error(detail::cat("rank ", rank(), ": dtrain::Join: a rank ran out of inputs at iteration ", ctx->iterations,
                            " and throw_on_early_termination is set, so every rank stops here: give every rank the "
                            "same number of batches, or leave throw_on_early_termination false"));
  python_iteration(*ctx, active);
  return &ctx->current;
}

const JoinIteration* Join::notify_own_round(Joinable& joinable) {
  detail::JoinContext* ctx = joinable.context_.get();
  if (joinable.join_position() < 0 || ctx->joined) return nullptr;
  DTRAIN_CHECK(!pytorch_peers() || joinable.join_position() == 0, "rank ", rank(), ": dtrain::Join: joinable #",
               joinable.join_position(),
               " starts rounds of its own, which Python's Join has no call for: in a job with Python ranks list "
               "only DistributedDataParallel in the Join");
  // Step 1 (the first joinable) or 1b.
  exchange(*ctx, /*active=*/true, joinable.position_);
  const JoinIteration& it = ctx->current;
  if (ctx->options.throw_on_early_termination() && it.active_count() < ctx->group.size())
    throw_early_termination(*ctx, it);
  return &it;
}

bool Join::could_strand(const Group& group) {
  if (!group.is_member()) return false;
  std::lock_guard<std::mutex> g(open_mu);
  for (const detail::JoinContext* ctx : open_joins)
    for (int r : ctx->group.ranks())
      if (r != rank() && std::find(group.ranks().begin(), group.ranks().end(), r) != group.ranks().end()) return true;
  return false;
}

void join(std::vector<Joinable*> joinables, const JoinOptions& options, const std::function<void()>& fn) {
  Join scope(std::move(joinables), options);
  fn();
  scope.join();
}

}  // namespace dtrain
