// Scheduler: continuous batching over the cell cache. A line-for-line port of
// executorch_cellcache/runtime/scheduler.py: the two plan identical steps
// (tokens, positions, sequence ids, admission, prefix-cache hits and
// evictions), which tests/test_engine_differential.py checks.
//
// Each step packs, up to max_tokens_per_step tokens: first one decode token
// of every running sample (round-robin from where the last step stopped when
// they exceed the budget), then chunks of admitted prompts in admission
// order. A prompt is prefilled once into one sequence; its n samples are
// seq_clones of it (sample 0 is the prompt's sequence itself).
//
// Admission (FIFO): a waiting request is admitted when, in every pool of the
// cache, the cells it can still need in the worst case fit in the free cells
// left after what the running requests may still take there, and its n ids
// fit. Pools (issue #25; scheduler.py and runtime/pools.py, the same rule): a
// waiting request's worst case in a pool is cellcache/admission.h's
// request_worst_case_cells_in_pool (a full pool: prompt - cached + n *
// (max_new_tokens - 1); a windowed pool that reclaims: at most n * (W +
// max(R, T - 1) + T), T = max_tokens_per_step, the most tokens of one
// sequence a step carries). A running request may still take, in a full
// pool, the positions it may still place (`remaining`: prompt - prefilled +
// n * (max_new_tokens - 1) while prefilling, then the sum of its live
// samples' max_new_tokens - len); in a reclaiming pool max(0, min(remaining,
// B - X)), B = that bound for its sequences (n while prefilling, its live
// samples after) and X the cells only they own there now (those free as it
// gives them up; cells it shares may not). A pool that does not reclaim (the
// one pool of an unpooled cache, even with sliding layers) counts as full
// (pool_limits). With a prefix cache, the head first clones its longest
// cached prefix; cells and ids only the cache holds count as available and
// least-recently-used entries are evicted when needed. A head that does not
// fit with its prefix while nothing runs is tried cold (the clone freed): in
// a reclaiming pool a clone's cells stay its entry's while the request fills
// its own window, so the cached prefix could keep it waiting forever; with
// one pool the cold try fails whenever the clone's did.
//
// Sampling is not the scheduler's: plan() says which rows of logits a step
// needs and for whom (consumers); the caller chooses the tokens and hands
// them to commit(). The scheduler then records them, stops samples (a stop
// token: one of the program's EOS ids when stop_on_eos, or one of the
// request's stop_token_ids, kept as the sample's last token; or
// max_new_tokens) and reports each as a SampleEvent.
//
// Speculative decoding (optional, speculative.h): a Proposer guesses the
// tokens that follow a decode sample's last token; the step carries them
// right after that sample's decode token, each with its logits row (one
// group of 1 + k rows per sample), and the caller's token choice (sampling.h
// verify) keeps the proposals the target agrees with plus one token of its
// own. commit() removes the rejected proposals' positions (seq_rm) and emits
// the accepted run token by token, so stop tokens, max_new_tokens and the
// prefix cache see exactly the tokens plain decoding would have produced.
// Budget: decode tokens first, then prompt chunks; proposals get what is
// left, in decode order, each sample up to min(draft_limit, max_new_tokens -
// tokens - 1, left), so they never delay another sequence's work and
// admission's worst case holds. draft_limit starts at max_draft and adapts
// per sample: +2 after a fully accepted proposal (at most max_draft), -1
// after a rejection (at least 1) (transformers' assisted-generation
// schedule). Backoff: after m proposals in a row with no token accepted, a
// sample sits out min(2^(m-1), kMaxDraftWait) of its proposal turns (turns
// where it would have been asked), so a batch whose samples do not copy
// spends its budget on little more than plain decoding. The rules are
// scheduler.py's (its module docstring).
//
// A sample that ends leaves its sequence to the prefix cache (or frees it);
// abandon() frees without caching. Not thread-safe: Engine (engine.h) queues
// other threads' submits and cancels and applies them between steps.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cellcache/admission.h"
#include "cellcache/cell_cache.h"
#include "forward.h"
#include "prefix_cache.h"
#include "proposer.h"
#include "run_status.h"
#include "sampling.h"

namespace cellcache::runner {

using RequestId = int64_t;

enum class FinishReason : uint8_t { kNone, kStop, kLength, kCancelled, kError };
// "stop", "length", "cancelled", "error" ("" for kNone).
const char* finish_reason_name(FinishReason reason);

struct Request;

// Speculation's backoff cap (scheduler.py MAX_DRAFT_WAIT).
constexpr int32_t kMaxDraftWait = 16;

struct Sample {
  int32_t index = 0;             // within its request
  seq_t seq = -1;
  Request* request = nullptr;
  std::vector<int64_t> tokens;   // generated so far
  FinishReason finish = FinishReason::kNone;
  int32_t draft_limit = 0;       // proposal length it may ask for next (0: not yet set)
  int32_t draft_misses = 0;      // its proposals in a row with no token accepted
  int32_t draft_wait = 0;        // proposal turns it sits out (after misses)
  int64_t proposed_tokens = 0;   // speculation: tokens proposed for it and verified
  // Of those, accepted and emitted: a proposal accepted after the token that
  // ended the sample never reaches its output, so it does not count (OpenAI's
  // accepted_prediction_tokens: tokens that appeared in the completion).
  int64_t accepted_tokens = 0;
  bool done() const { return finish != FinishReason::kNone; }
};

struct Request {
  RequestId id = 0;
  std::vector<int64_t> prompt;
  SamplingParams params;
  seq_t seq = -1;                // the prompt's sequence while prefilling
  int32_t prefilled = 0;         // prompt tokens placed (or cloned from the prefix cache)
  int32_t cached_tokens = 0;     // prompt tokens served from the prefix cache
  std::vector<Sample> samples;   // empty until the prompt's last token ran
  bool cancelled = false;
  bool speculate = true;         // whether its samples take proposals (when a proposer is set)
  // Structured output: the caller masks its samples' picks (Engine's
  // StepHooks::masks); its samples take no proposals.
  bool constrained = false;
  // The caller sees each token its samples take, as they take it, and may end
  // the sample there (the scheduler's EmitHook: stop strings, a grammar).
  bool watched = false;
  // The caller's sampling state, one generator per sample (sample_generator);
  // the scheduler never reads it.
  std::vector<std::mt19937_64> rngs;

  // Positions this request may still place: the cells it may still claim in
  // a pool that reclaims nothing (cached: prompt tokens a waiting request
  // would clone instead of prefilling).
  int64_t worst_case_cells(int32_t cached = 0) const;
  bool finished() const;
};

// The step's consumer of one group of logits rows: a decode sample (its
// decode token's row, then one row per proposed token placed right after
// it), or the request whose prompt ends at that token (one row; its n
// samples start there). Exactly one of sample / prompt_end is set.
struct RowConsumer {
  Sample* sample = nullptr;
  Request* prompt_end = nullptr;
  int32_t draft_begin = 0;   // the sample's proposals: plan.drafts[draft_begin, + draft_len)
  int32_t draft_len = 0;
  int64_t probs_begin = -1;  // their distributions: plan.draft_probs[probs_begin, + draft_len *
                             // vocab); -1 = a deterministic proposal (or none)
  // Logits rows of the group: 1 + draft_len.
  int32_t rows() const { return 1 + draft_len; }
  // The most tokens commit() takes for the group: the request's n, or 1 +
  // draft_len (exactly 1 without proposals).
  int32_t width() const { return sample != nullptr ? 1 + draft_len : prompt_end->params.n; }
};

struct StepPlan {
  StepBatch batch;
  std::vector<RowConsumer> consumers;  // per logits group, in row order
  std::vector<int64_t> drafts;         // every group's proposed tokens, group after group
  std::vector<double> draft_probs;     // float64 [sum of sampled drafts' lengths * vocab]
  int32_t n_prefill = 0;
  int32_t n_decode = 0;
  int32_t n_proposed = 0;
  void clear();
};

// Counters of speculative decoding over a scheduler's life (scheduler.py's
// SpeculationStats): proposed and accepted tokens, decode groups verified
// with a proposal, and the tokens those groups gave their samples (accepted
// + the target's own; none past a stop).
struct SpeculationStats {
  int64_t proposed = 0;
  int64_t accepted = 0;
  int64_t verified_groups = 0;
  int64_t emitted = 0;
};

// What happened to a sample: a token was chosen (token >= 0; pick indexes
// the commit's picks, for the caller's logprobs) and/or it finished (finish
// != kNone; a cancelled sample has token -1).
struct SampleEvent {
  Request* request = nullptr;
  int32_t sample = 0;
  int64_t token = -1;
  int32_t pick = -1;
  FinishReason finish = FinishReason::kNone;
  bool stop_token = false;  // token is the stop token that ended the sample
};

// Each pool of `cache` as admission sees it: its capacity, and its window
// when it reclaims (a windowed pool of a pooled cache), nullopt otherwise
// (nothing reclaimed: every cell a request places stays its own).
std::vector<PoolLimit> pool_limits(const CellCache& cache);

// Called as a watched request's sample takes a token (Request::watched),
// after the token is recorded and before any later token of the same
// accepted run: true ends the sample on it (FinishReason::kStop). stop_token:
// the token is a stop token (the sample ends anyway). A runtime error aborts
// the commit (the caller abandons the step).
using EmitHook = std::function<Outcome<bool>(const Sample& sample, int64_t token, bool stop_token)>;

class Scheduler {
 public:
  // prefix: the cached prefixes to serve from and leave finished sequences
  // to (nullptr = free them); proposer: speculative decoding's proposals
  // (nullptr = none; needs max_tokens_per_step >= 2). Both outlive the
  // scheduler.
  Scheduler(CellCache& cache, int32_t max_tokens_per_step, std::vector<int64_t> eos_ids,
            PrefixCache* prefix, Proposer* proposer = nullptr);

  // The checks a request passes before it is queued: a user error naming
  // `label` ("the prompt", "prompt 3") for an empty prompt, a parameter out of
  // range (SamplingParams::validate), or a request that could not run even in
  // an empty cache of these pools (cellcache/admission.h
  // check_request_fits_pools: the message names the pool too small; `pools`
  // from pool_limits, retained_margin the cache's, step_tokens the
  // forward's max_tokens_per_step). Thread-safe: it reads nothing of a
  // scheduler (Engine::submit calls it on any thread).
  static Outcome<> check_request(const std::string& label, int64_t prompt_len,
                                 const SamplingParams& params,
                                 std::span<const PoolLimit> pools, int64_t retained_margin,
                                 int64_t step_tokens);
  // Queues a request (FIFO). User errors: check_request's. The scheduler owns
  // it until take_finished().
  Outcome<Request*> submit(RequestId id, std::vector<int64_t> prompt, SamplingParams params);
  // Ends every unfinished sample ("cancelled", one event each; a waiting
  // request's n samples too) and frees or caches its sequences now. false
  // when no waiting or running request has this id.
  bool cancel(RequestId id);
  // Ends one sample early (a stop string the caller matched).
  Outcome<> finish_sample(Request& request, int32_t sample_index,
                          FinishReason reason = FinishReason::kStop);
  bool idle() const { return waiting_.empty() && running_.empty(); }
  // Admits what fits, then packs the next step into `plan` (its buffers are
  // reused; batch.tokens is empty when nothing runs and nothing fits).
  Outcome<> plan(StepPlan& plan);
  // Applies a step's chosen tokens. picks: flat, group after group: the
  // request's n (sample order) for a prompt end; for a decode sample with
  // proposals d (k >= 0 tokens) what verify returned: d[0, a) and one more
  // token, 1..k+1 tokens (exactly 1 without proposals). A group's length is
  // read off picks: its tokens while they equal d, then one. A sample's
  // rejected proposals are removed from its sequence (seq_rm) before its
  // tokens are emitted; one that stops inside its accepted run takes none
  // of the tokens after the stop. Runtime error (nothing applied): picks
  // does not parse into the plan's groups.
  // Example: consumers [sample a with d = [7, 9], request r with n = 2],
  // picks [7, 4, t0, t1]: a takes [7, 4] (7 accepted, 9 rejected), r's
  // samples t0 and t1.
  Outcome<> commit(const StepPlan& plan, std::span<const int64_t> picks);
  // Ends every running request (after a failed forward): frees its sequences
  // without caching them; each unfinished sample gets a `reason` event.
  // Waiting requests stay queued.
  void abandon(FinishReason reason);

  // Events not yet consumed, in order; the caller clears it after reading.
  std::vector<SampleEvent>& events() { return events_; }
  // Requests that finished (all samples done, or cancelled), in finishing
  // order; ownership passes to the caller.
  std::vector<std::unique_ptr<Request>> take_finished();
  const std::deque<Request*>& waiting() const { return waiting_; }
  const std::vector<Request*>& running() const { return running_; }
  CellCache& cache() { return cache_; }
  const SpeculationStats& speculation() const { return speculation_; }
  // Replaces the proposer (nullptr = none) and the emit hook; only while idle.
  void set_proposer(Proposer* proposer) { proposer_ = proposer; }
  void set_emit_hook(EmitHook hook) { emit_hook_ = std::move(hook); }
  // Tokens decode groups gave their samples (accepted runs included), over
  // the scheduler's life.
  int64_t decode_emitted() const { return decode_emitted_; }

 private:
  Outcome<> admit();
  // (clone, cached): the clone of head's longest cached prefix, or (-1, 0).
  Outcome<PrefixMatch> clone_cached_prefix(const Request& head, int64_t ids);
  // Whether cells[p] free cells in every pool p and `ids` free ids exist
  // (evicting cached entries other than keep when that suffices).
  bool room(std::span<const int64_t> cells, int64_t ids, std::optional<seq_t> keep);
  // cells[p] += what running `request` may still take from pool p (the
  // rule above; runtime/pools.py Pools.reserve).
  void add_reserve(std::vector<int64_t>& cells, const Request& request);
  // cells[p] += waiting `request`'s worst case in pool p, cloning `cached`
  // prompt tokens.
  void add_worst_case(std::vector<int64_t>& cells, const Request& request, int32_t cached) const;
  Outcome<> start_samples(Request& request, std::span<const int64_t> picks, int32_t first_pick);
  Outcome<> emit(Sample& sample, int64_t token, int32_t pick);
  // Asks the proposer for the decode samples' proposals within `left` tokens.
  void propose(std::span<Sample* const> decode, int32_t left);
  // A verified group: rollback, draft_limit, then its tokens one by one.
  Outcome<> emit_run(Sample& sample, int32_t draft_len, std::span<const int64_t> tokens,
                     int32_t first_pick);
  Outcome<> end(Sample& sample, FinishReason reason, bool keep = true);
  Outcome<> leave(std::span<const int64_t> prompt, std::span<const int64_t> generated, seq_t seq);
  void retire();

  CellCache& cache_;
  PrefixCache* prefix_;
  int32_t budget_;
  std::vector<PoolLimit> pools_;  // pool_limits(cache_)
  std::unordered_set<int64_t> eos_;
  std::vector<std::unique_ptr<Request>> owned_;  // waiting + running + finished not yet taken
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::vector<Request*> finished_;
  std::vector<SampleEvent> events_;
  Proposer* proposer_;
  EmitHook emit_hook_;
  SpeculationStats speculation_;
  int64_t decode_emitted_ = 0;
  // plan()'s scratch.
  std::vector<Sample*> active_;
  std::vector<Sample*> decode_;
  std::vector<std::pair<Request*, int32_t>> chunks_;  // (request, prompt tokens this step)
  std::vector<ProposalAsk> asks_;
  std::vector<int32_t> asked_;                         // asks_[i] is decode_[asked_[i]]
  std::vector<Proposal> proposals_;                    // per decode_ sample
  std::vector<Proposal> answers_;                      // the proposer's, per asks_
  std::vector<int32_t> takes_;                         // commit()'s parse: tokens per group
  std::vector<int64_t> cells_;                         // admit()'s: running worst cases per pool
  std::vector<int64_t> head_cells_;                    //   and with the head's added
  std::vector<int64_t> no_cells_;                      // zero per pool
  std::vector<seq_t> live_seqs_;                       // add_reserve's scratch
  int64_t next_decode_ = 0;      // round-robin start when decode tokens exceed the budget
};

}  // namespace cellcache::runner
