// The scheduler's part of speculative decoding (scheduler.h): asking the
// proposer for the decode samples' proposals within the step's budget, and
// taking a verified group's tokens (rollback of rejected proposals, the
// sample's proposal limit and backoff, then its tokens one by one).
#include <algorithm>

#include "proposer.h"
#include "scheduler.h"

namespace cellcache::runner {

void Scheduler::propose(std::span<Sample* const> decode, int32_t left) {
  proposals_.resize(decode.size());
  for (Proposal& p : proposals_) p.clear();
  if (proposer_ == nullptr || left <= 0) return;
  asks_.clear();
  asked_.clear();
  for (size_t i = 0; i < decode.size(); ++i) {
    Sample* s = decode[i];
    if (!s->request->speculate || s->request->constrained) continue;
    if (s->draft_limit == 0) s->draft_limit = proposer_->max_draft();
    const int64_t room =
        static_cast<int64_t>(s->request->params.max_new_tokens) - static_cast<int64_t>(s->tokens.size()) - 1;
    const int32_t limit = static_cast<int32_t>(
        std::min<int64_t>({s->draft_limit, room, static_cast<int64_t>(left)}));
    if (limit > 0 && s->draft_wait > 0) {
      --s->draft_wait;
    } else if (limit > 0) {
      asks_.push_back({s, limit});
      asked_.push_back(static_cast<int32_t>(i));
      left -= limit;
    }
  }
  if (asks_.empty()) return;
  proposer_->propose(asks_, answers_);
  for (size_t a = 0; a < asks_.size() && a < answers_.size(); ++a) {
    Proposal& got = answers_[a];
    const size_t limit = static_cast<size_t>(asks_[a].limit);
    if (got.tokens.size() > limit) {
      if (!got.probs.empty()) got.probs.resize(got.probs.size() / got.tokens.size() * limit);
      got.tokens.resize(limit);
    }
    if (got.tokens.empty()) got.probs.clear();
    std::swap(proposals_[static_cast<size_t>(asked_[a])], got);
  }
}

Outcome<> Scheduler::emit_run(Sample& sample, int32_t draft_len, std::span<const int64_t> tokens,
                              int32_t first_pick) {
  const int32_t accepted = static_cast<int32_t>(tokens.size()) - 1;
  speculation_.proposed += draft_len;
  speculation_.accepted += accepted;
  speculation_.verified_groups += 1;
  sample.proposed_tokens += draft_len;
  if (sample.done()) return {};  // ended meanwhile: end() already rolled back or freed its sequence
  if (accepted < draft_len) {
    const int64_t keep =
        static_cast<int64_t>(sample.request->prompt.size() + sample.tokens.size()) + accepted;
    if (Status rm = cache_.seq_rm(sample.seq, static_cast<pos_t>(keep)); !rm.is_ok()) {
      return cache_failure("seq_rm", rm);
    }
    sample.draft_limit = std::max(1, sample.draft_limit - 1);
  } else {
    sample.draft_limit = std::min(proposer_->max_draft(), sample.draft_limit + 2);
  }
  sample.draft_misses = accepted > 0 ? 0 : sample.draft_misses + 1;
  if (sample.draft_misses > 0) {
    sample.draft_wait = std::min(kMaxDraftWait, 1 << std::min(sample.draft_misses - 1, 30));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (sample.done()) return {};
    ++speculation_.emitted;
    ++decode_emitted_;
    // tokens[0, accepted) are accepted proposals; the last is the target's own.
    if (static_cast<int32_t>(i) < accepted) ++sample.accepted_tokens;
    if (auto emitted = emit(sample, tokens[i], first_pick + static_cast<int32_t>(i));
        !emitted.ok()) {
      return emitted;
    }
  }
  return {};
}

}  // namespace cellcache::runner
