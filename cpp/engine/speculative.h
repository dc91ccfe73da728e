// Speculative decoding's proposers: guesses of the tokens that follow a
// decode sample, which the scheduler (scheduler.h) places after the sample's
// decode token, each with a logits row, so one forward of the target checks
// them; the engine's token choice (sampling.h verify) keeps those the target
// agrees with plus one token of its own. The C++ face of
// executorch_cellcache/runtime/speculative.py: the same options, messages,
// lookup rule and draft-model procedure, so the engine's steps are the
// Python runtime's (tests/test_engine_differential.py checks prompt lookup
// step by step).
//
// Two proposers:
// - PromptLookup (prompt lookup decoding; transformers'
//   prompt_lookup_num_tokens, vLLM's n-gram proposer): the sample's last m
//   tokens, m from max_ngram down to min_ngram, are searched in its prompt +
//   output; at the earliest earlier occurrence, the up to k tokens that
//   followed it are proposed (lookup below). No model, no memory.
// - DraftModel: a second cell-cache Forward with the same vocabulary (and
//   tokenizer) and its own cache. Each sample has a mirror sequence there
//   holding the tokens the draft has seen; before it proposes, the mirror is
//   cut back to what the target accepted (seq_rm) and fed the rest (catch-up
//   chunks packed within the draft's max_tokens_per_step), then k tokens are
//   proposed one forward at a time, every proposing sample batched in each
//   forward. A fork's mirror starts as a clone of a sibling's (or empty, when
//   a pooled draft cache no longer holds the sibling's window there). Greedy
//   requests get the draft's argmax; sampled ones a draw from the draft's
//   distribution under the request's parameters (draft_generator), with the
//   distributions kept for the rejection rule. A draft forward that fails
//   stops proposing for the rest of the engine's life (failure() says why);
//   decoding goes on without proposals.
//
// Not thread-safe: the engine's stepping thread calls them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "forward.h"
#include "proposer.h"
#include "run_status.h"
#include "sampling.h"
#include "scheduler.h"

namespace cellcache::runner {

enum class SpeculativeMethod : uint8_t { kLookup, kDraft };

// The method named `name`; a user error naming the value otherwise (the
// message of Speculative.validate).
Outcome<SpeculativeMethod> speculative_method(const std::string& name);

constexpr int32_t kDefaultMaxDraft = 7;
constexpr int32_t kDefaultMinNgram = 2;
constexpr int32_t kDefaultMaxNgram = 3;
// Sample j's draft draws: a generator of (seed, j, this) (speculative.py's _DRAFT_STREAM).
constexpr uint32_t kDraftStream = 0x5eed;

struct SpeculativeOptions {
  SpeculativeMethod method = SpeculativeMethod::kLookup;
  // k: most tokens proposed per sample and step; nullopt = "auto", chosen by
  // Engine::create from measured step costs (draft_length.h), or
  // kDefaultMaxDraft where they cannot be measured.
  std::optional<int32_t> max_draft;
  int32_t min_ngram = kDefaultMinNgram;  // prompt lookup's match lengths, 1 <= min <= max
  int32_t max_ngram = kDefaultMaxNgram;

  // A user error naming the value at fault (Speculative.validate's rules and
  // messages): a target whose max_tokens_per_step < 2 (a decode token and a
  // proposal), max_draft outside [1, max_tokens_per_step - 1], an n-gram
  // length < 1 or min_ngram > max_ngram, method kDraft without a draft
  // (has_draft false) or kLookup with one.
  Outcome<> validate(int32_t max_tokens_per_step, bool has_draft) const;
};

// Prompt lookup: for m = max_ngram down to min_ngram, the earliest i with
// context[i, i+m) == the last m tokens and i + m < context.size() gives
// context[i+m, i+m+limit) (cut at the end); {} when no length matches, when
// context has < 2 tokens or limit <= 0.
// Example: context [5 6 7 5 6], limit 4, m 2..3 -> m=3: "7 5 6" not earlier;
// m=2: "5 6" at i=0 -> [7 5 6] (context[2, 5)).
std::vector<int64_t> lookup(std::span<const int64_t> context, int32_t limit, int32_t min_ngram,
                            int32_t max_ngram);

// Sample `sample_index`'s draft generator: std::mt19937_64 seeded with
// std::seed_seq{seed low 32 bits, seed high 32 bits, sample_index,
// kDraftStream} (sample_generator's rule plus the stream word); fresh entropy
// when seed is nullopt.
std::mt19937_64 draft_generator(const SamplingParams& params, int32_t sample_index);

class PromptLookup final : public Proposer {
 public:
  explicit PromptLookup(const SpeculativeOptions& options) : options_(options) {}
  int32_t max_draft() const override { return options_.max_draft.value_or(kDefaultMaxDraft); }
  void propose(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) override;
  void release(const Sample&) override {}
  void close() override {}
  const std::string& failure() const override { return failure_; }

 private:
  SpeculativeOptions options_;
  std::string failure_;          // always "": lookup cannot fail
  std::vector<int64_t> context_;  // propose()'s scratch: prompt + tokens
};

class DraftModel final : public Proposer {
 public:
  // draft: the draft program (its cache only this proposer's; it outlives
  // the proposer). The caller checked it with check_draft.
  DraftModel(const SpeculativeOptions& options, Forward& draft);
  ~DraftModel() override;
  int32_t max_draft() const override { return options_.max_draft.value_or(kDefaultMaxDraft); }
  void propose(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) override;
  void release(const Sample& sample) override;
  void close() override;
  const std::string& failure() const override { return failure_; }

 private:
  struct Mirror {
    seq_t seq = -1;
    std::vector<int64_t> fed;  // the tokens whose K/V the draft holds, positions 0..size-1
    std::optional<std::mt19937_64> rng;  // sampled requests only
  };
  using Key = std::pair<RequestId, int32_t>;  // (request id, sample index)
  struct Work {
    size_t ask = 0;
    Mirror* mirror = nullptr;
    const SamplingParams* params = nullptr;
    int32_t limit = 0;
    std::vector<int64_t> pending;  // tokens still to feed this round
  };

  Outcome<> propose_all(std::span<const ProposalAsk> asks, std::vector<Proposal>& out);
  // The sample's mirror (made on first use: a clone of a sibling's prefix, or
  // a new sequence); nullptr when the draft's cache has no free id.
  Outcome<Mirror*> mirror(const Sample& sample, std::span<const int64_t> context);
  void stop(const std::string& why);

  SpeculativeOptions options_;
  Forward& draft_;
  std::map<Key, Mirror> mirrors_;
  std::string failure_;
  // propose()'s scratch.
  std::vector<int64_t> context_;
  std::vector<Work> work_;
  StepBatch batch_;
  std::vector<Work*> owners_;
  std::vector<double> scratch_;
  std::mt19937_64 greedy_rng_;  // handed to choose_token for greedy requests: never drawn from
};

// The largest max_draft a draft whose cache is `draft_cache` can serve, or
// nullopt for no bound. A draft mirror feeds max_draft - 1 proposals, one
// token a step, and rolls back those the target rejected: a windowed pool
// that reclaims (issue #25) guarantees a rollback of R + 1 positions
// (cell_pool.h: R = retained_margin), so max_draft <= R + 2. A cache of
// pools that do not reclaim: no bound.
std::optional<int32_t> max_draft_within_margin(const CellCache& draft_cache);

// A user error when `draft` cannot propose for `target`: another vocabulary
// size, or another tokenizer (either embeds tokenizer json and they differ),
// or the target's own cache. `name` names the draft in the message
// ("the draft model d.pte").
Outcome<> check_draft(Forward& target, Forward& draft, const std::string& name);

// The proposer for `options` (nullptr for nullopt): options validated
// (SpeculativeOptions::validate), a draft checked (check_draft; its cache
// emptied), max_draft resolved (auto: draft_length.h's choice from measured
// step costs; a pooled draft's capped to max_draft_within_margin, a given one
// beyond it refused). A draft without speculation is a user error; a forward
// that fails while measuring, a runtime error. Engine::create and
// Engine::set_speculative use it.
Outcome<std::unique_ptr<Proposer>> make_proposer(Forward& forward,
                                                 const std::optional<SpeculativeOptions>& options,
                                                 Forward* draft, const std::string& draft_name);

}  // namespace cellcache::runner
