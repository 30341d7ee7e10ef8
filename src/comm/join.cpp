// Join for uneven inputs: the per-iteration exchange of the active set, the joined rank's shadow loop
// and the scope's bookkeeping (protocol in include/dtrain/join.h).
#include "dtrain/join.h"

#include <algorithm>
#include <exception>
#include <sstream>

namespace dtrain {

namespace detail {
struct JoinContext {
  Group group;
  JoinOptions options;
  bool joined = false;     // this rank called join()
  int64_t iterations = 0;  // exchanges so far, notified or shadowed (the same count on every rank)
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

// Step 1 / 2: one all-reduce; each member adds a 1 at its own group rank while it is active.
JoinIteration exchange(detail::JoinContext& ctx, bool active) {
  std::vector<int64_t> mine(static_cast<size_t>(ctx.group.size()), 0);
  if (active) mine[static_cast<size_t>(ctx.group.rank())] = 1;
  std::vector<int64_t> all;
  try {
    all = all_reduce_values(mine, ReduceOp::SUM, ctx.group);
  } catch (const std::exception& e) {
    throw Error(detail::cat("rank ", rank(), ": dtrain::Join: the exchange of active ranks at iteration ",
                            ctx.iterations, " failed: ", e.what()));
  }
  JoinIteration it;
  it.index = ctx.iterations++;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != 0) it.active.push_back(static_cast<int>(r));
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

}  // namespace

int JoinIteration::authoritative_rank(const Group& group) const {
  return group.ranks()[active.empty() ? 0 : active.front()];
}

Joinable::~Joinable() = default;

const JoinIteration* Joinable::join_iteration() const {
  if (!context_ || !context_->options.enable() || context_->current.index < 0) return nullptr;
  return &context_->current;
}

bool Joinable::is_first_joinable() const { return context_ && context_->options.enable() && first_; }

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
    joinables_[i]->first_ = i == 0;
  }
  try {
    for (Joinable* j : joinables_) hooks_.push_back(j->join_hook(options_));
  } catch (...) {
    for (Joinable* j : joinables_) j->context_.reset();
    throw;
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
  bool is_last_joiner = true;
  for (int64_t shadowed = 0;; ++shadowed) {
    // Step 2.
    const JoinIteration it = exchange(ctx, /*active=*/false);
    if (it.active.empty()) break;
    if (options_.throw_on_early_termination()) throw_early_termination(ctx, it);
    if (shadowed == kSkewWarnIterations)
      warn_once("join-skew", detail::cat("dtrain::Join: rank ", rank(), " has shadowed ", kSkewWarnIterations,
                                         " iterations of the other ranks: inputs this uneven may be a bug"));
    is_last_joiner = false;
    for (auto& h : hooks_) h->main_hook(it);
  }
  // Step 3.
  for (auto& h : hooks_) h->post_hook(is_last_joiner, ctx.last);
}

void Join::leave() {
  for (Joinable* j : joinables_)
    if (j->context_ == context_) j->context_.reset();
}

const JoinIteration* Join::notify_join_context(Joinable& joinable) {
  detail::JoinContext* ctx = joinable.context_.get();
  if (!ctx || !ctx->options.enable() || !joinable.first_ || ctx->joined) return nullptr;
  // Step 1.
  exchange(*ctx, /*active=*/true);
  const JoinIteration& it = ctx->current;
  if (ctx->options.throw_on_early_termination() && it.active_count() < ctx->group.size())
    throw_early_termination(*ctx, it);
  return &it;
}

void join(std::vector<Joinable*> joinables, const JoinOptions& options, const std::function<void()>& fn) {
  Join scope(std::move(joinables), options);
  fn();
  scope.join();
}

}  // namespace dtrain
