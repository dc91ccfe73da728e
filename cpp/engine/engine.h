// Engine: the on-device serving loop. Requests arrive and leave at any time;
// each step() runs one forward over whatever runs now (continuous batching,
// scheduler.h), tokens stream to each request's Sink as they are chosen, and
// finished conversations stay in a prefix cache (prefix_cache.h), so a
// conversation's next turn (its history plus the new message) prefills only
// the new tokens.
//
// Speculative decoding (EngineOptions::speculative, speculative.h): each step,
// decode samples may carry proposed tokens (prompt lookup, or a draft
// model's) after their decode token; sample_rows verifies them (sampling.h
// verify) and the scheduler keeps the accepted run plus the target's own
// token, so the output is plain decoding's (greedy: the same tokens; seeded
// sampling with prompt lookup: the same tokens too).
//
//   auto program = CellCacheProgram::load("model.pte");      // a Forward
//   auto engine = Engine::create(*program.value(), {});
//   auto id = engine.value()->submit({0, 340, 344}, params, sink);  // any thread
//   while (engine.value()->step().value()) {}                  // one thread
//
// Threads: submit(), cancel() and live_requests() are safe from
// any thread at any time, also from inside a Sink callback, while one thread
// (and only one) calls step(); they queue work that the next step() applies
// before it plans, in the order it was queued. Sink callbacks run on the
// stepping thread, inside step(). Everything else is the stepping thread's.
//
// Pools (issue #25): a cache of one pool per window policy (window_cells) is
// served as is: admission counts each pool's worst case (scheduler.h), the
// prefix cache serves only prefixes every pool still holds (prefix_cache.h),
// and a pooled draft's max_draft stays within its retained margin
// (speculative.h max_draft_within_margin).
//
// Errors never throw or abort: submit refuses a request with a user error
// naming the problem (empty prompt, token outside the vocabulary, a
// parameter out of range, a request that could never fit in the cache); the
// engine's state is unchanged. cancel of an unknown or finished id is a user
// error. A forward that fails makes step() return the runtime error after
// every running request has been ended with FinishReason::kError (their
// sequences freed, not cached); waiting requests stay queued.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "forward.h"
#include "prefix_cache.h"
#include "run_status.h"
#include "sampling.h"
#include "scheduler.h"
#include "speculative.h"

namespace cellcache::runner {

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;      // prompt tokens served from the prefix cache
  int64_t completion_tokens = 0;  // this sample's tokens (a stop token included)
  // Speculative decoding: tokens proposed for this sample and verified, and
  // of those accepted (0 without speculation).
  int64_t proposed_tokens = 0;
  int64_t accepted_tokens = 0;
};

struct TokenEvent {
  RequestId request = 0;
  int32_t sample = 0;
  int64_t token = 0;
  const TokenLogprobs* logprobs = nullptr;  // set when the request asked for logprobs
  bool stop_token = false;                  // this token is the stop token ending the sample
  FinishReason finish = FinishReason::kNone;  // set when this token ended the sample
};

struct FinishEvent {
  RequestId request = 0;
  int32_t sample = 0;
  FinishReason reason = FinishReason::kStop;
  Usage usage;
};

// Receives a request's tokens and finishes, on the stepping thread. Every
// sample of an accepted request gets exactly one on_finish, after its last
// on_token.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void on_token(const TokenEvent& event) = 0;
  virtual void on_finish(const FinishEvent& event) = 0;
};

// One pick a step samples under a constraint: sample `sample` of request
// `request` (a prompt's last row gives one pick per sample).
struct MaskRow {
  RequestId request = 0;
  int32_t sample = 0;
};

// What a caller decides per token, beside the engine's own rules
// (EngineOptions::hooks). Called on the stepping thread inside step(), never
// with the engine's lock held; a hook may not call step().
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  // Structured output: before the step's tokens are chosen, once per step in
  // which some pick belongs to a constrained request (SubmitOptions), fills
  // allowed (uint8 [rows.size() x vocab], zeroed) with 1 at the tokens each
  // row's sample may take next. The pick is then chosen from the logits with
  // the others at -infinity (greedy: the first highest allowed logit;
  // sampling: renormalized over the allowed tokens); its logprobs stay the
  // model's own. A runtime error (or a row allowing nothing) ends the step
  // as a failed forward does.
  virtual Outcome<> masks(std::span<const MaskRow> rows, std::span<uint8_t> allowed) = 0;
  // A watched request's sample took `token` (SubmitOptions::watched), before
  // any later token of the same accepted run: true ends the sample on it with
  // FinishReason::kStop (a stop string, a complete grammar). stop_token: the
  // token is a stop token (the sample ends anyway). A runtime error ends the
  // step as a failed forward does.
  virtual Outcome<bool> ends_sample(RequestId request, int32_t sample, int64_t token,
                                    bool stop_token) = 0;
};

struct SubmitOptions {
  std::string label = "the prompt";  // names the request in errors
  bool speculate = true;             // its samples take proposals (when the engine speculates)
  bool constrained = false;          // StepHooks::masks chooses its picks; no proposals
  bool watched = false;              // StepHooks::ends_sample sees each token it takes
};

struct EngineOptions {
  bool prefix_cache = true;
  std::optional<int32_t> prefix_cache_cells;  // bound on cells only the cache holds
  // Speculative decoding: nullopt = off. Method kDraft needs `draft`: the
  // draft program, with the target's vocabulary (and tokenizer) and a cache of
  // its own (emptied at create); it outlives the engine. `draft_name` names it
  // in errors ("the draft model d.pte").
  std::optional<SpeculativeOptions> speculative;
  Forward* draft = nullptr;
  std::string draft_name = "the draft model";
  // Masks and early ends (StepHooks); outlives the engine. A request that is
  // constrained or watched needs it.
  StepHooks* hooks = nullptr;
};

struct EngineStats {
  int64_t prefill_tokens = 0;
  // Tokens generated by decode groups (accepted proposals included; none past
  // a stop), in every step, and in steps without prompt tokens (what
  // decode_seconds timed).
  int64_t decode_tokens = 0;
  int64_t decode_step_tokens = 0;
  int64_t decode_groups = 0;  // (sample, forward) pairs: a sample's turn in a forward
  // Speculative decoding (0 when off): tokens proposed and verified, and of
  // those accepted; why proposing stopped early (a draft that failed), or "".
  int64_t proposed_tokens = 0;
  int64_t accepted_tokens = 0;
  int32_t max_draft = 0;  // k the proposers use (given, or chosen: draft_length.h)
  std::string speculation_failure;
  int64_t steps = 0;
  double prefill_seconds = 0;   // forwards that carried prompt tokens
  double decode_seconds = 0;    // forwards that carried only decode tokens
  double overhead_seconds = 0;  // step() time outside the forward, of which:
  double plan_seconds = 0;      //   queued work applied, admission, packing the step
  double sample_seconds = 0;    //   choosing tokens (and logprobs) from the logits
  double commit_seconds = 0;    //   commit, prefix-cache inserts, sink callbacks
  // Cells of pool 0 (the pool of layer 0; the only one of an unpooled cache).
  int32_t peak_cells = 0;
  int32_t capacity = 0;
  // Per pool (CellCache::pool_state order): peak occupied cells after a
  // step, and capacity.
  std::vector<int32_t> pool_peak_cells;
  std::vector<int32_t> pool_capacities;
  std::vector<int32_t> pool_windows;  // W of a reclaiming pool, 0 for one that keeps all

  double prefill_tokens_per_s() const;
  double decode_tokens_per_s() const;  // decode_step_tokens / decode_seconds
  // Tokens a sample gained per forward it took part in while decoding:
  // decode_tokens / decode_groups (1 without speculation; 0 before any).
  double tokens_per_forward() const;
  // " (window-6 pool: 90 of 168, full-attention pool: 105 of 384)": each
  // pool's peak cells for a cache of several pools; "" for one pool (the
  // Python CLI's summary words).
  std::string pool_summary() const;
  double acceptance_rate() const;  // accepted_tokens / proposed_tokens (0 before any)
};

class Engine {
 public:
  // forward (and its cache) must outlive the engine, and the engine owns the
  // cache: admission counts only this engine's requests, so no other engine or
  // caller may hold cells in it meanwhile. User errors: a bad
  // prefix_cache_cells, a forward with max_tokens_per_step or vocab_size < 1
  // or an EOS id outside its vocabulary;
  // with speculative: SpeculativeOptions::validate's (max_tokens_per_step < 2,
  // max_draft outside [1, max_tokens_per_step - 1], ...) and check_draft's (a
  // draft with another vocabulary size or tokenizer), a max_draft beyond a
  // pooled draft's max_draft_within_margin (an auto one is capped to it
  // instead); a draft without speculative.
  static Outcome<std::unique_ptr<Engine>> create(Forward& forward, EngineOptions options);
  // Ends every request still waiting or running (kCancelled to its sink) and
  // frees every cell and id the engine holds, prefix cache included.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Any thread. Queues a request; its id, or a user error naming
  // options.label (nothing queued): an empty prompt, a token or stop token
  // outside the vocabulary, a parameter out of range, a request that could
  // never fit in the cache (Scheduler::check_request), a null sink, a
  // constrained or watched request on an engine without hooks.
  Outcome<RequestId> submit(std::vector<int64_t> prompt, SamplingParams params,
                            std::shared_ptr<Sink> sink, SubmitOptions options = {});
  // Any thread. Queues the cancel of a waiting or running request: the next
  // step() ends its unfinished samples (FinishReason::kCancelled) and frees
  // its cells (or leaves them to the prefix cache) before it plans. User
  // error: no such request, it has finished, or its cancel is already queued.
  Outcome<> cancel(RequestId id);
  // Stepping thread. Applies queued submits and cancels, then runs one
  // forward. true = there was work (a forward ran, or queued work was
  // applied); false = idle. User error when called from inside a sink
  // callback (nothing happens). A sink that throws: the exception leaves
  // step() with the engine consistent (every event of the step was taken out
  // before the callbacks; the events after the throwing one are not delivered).
  Outcome<bool> step();
  // Any thread. Requests submitted and not yet finished.
  int64_t live_requests() const;
  // Any thread. Requests submitted and not yet admitted (queued, or waiting
  // for cells as of the last step).
  int64_t waiting_requests() const;
  // Stepping thread, between steps. Ends every queued, waiting and running
  // request (`reason` to each unfinished sample) and frees their sequences
  // without caching them: what a caller does when its loop stops on an
  // error. User error from inside a sink callback or while another thread
  // steps (nothing happens).
  Outcome<> abort(FinishReason reason = FinishReason::kCancelled);
  // Stepping thread, while no request is live: speculative decoding from now
  // on (nullopt = off), checked as create() checks it (a draft model: `draft`,
  // named draft_name, outliving the engine). On an error nothing changes.
  Outcome<> set_speculative(std::optional<SpeculativeOptions> speculative, Forward* draft = nullptr,
                            const std::string& draft_name = "the draft model");
  // Stepping thread: no request waits or runs and nothing is queued.
  bool idle() const;

  // Whether decode steps carry proposals (EngineOptions::speculative). Any thread.
  bool speculative() const { return proposer_ != nullptr; }
  // Stepping thread.
  const EngineStats& stats() const { return stats_; }
  void reset_stats();
  PrefixCache* prefix_cache() { return prefix_.get(); }
  // Drops every cached prefix (running requests keep their cells).
  void clear_prefix_cache();
  // The step just run (tests, the Python binding's differential).
  const StepPlan& last_plan() const { return plan_; }
  CellCache& cache() { return forward_.cache(); }

 private:
  struct QueuedSubmit {
    RequestId id;
    std::vector<int64_t> prompt;
    SamplingParams params;
    std::shared_ptr<Sink> sink;
    SubmitOptions options;
  };
  struct QueuedCancel {
    RequestId id;
  };
  using Queued = std::variant<QueuedSubmit, QueuedCancel>;

  Engine(Forward& forward, std::unique_ptr<PrefixCache> prefix,
         std::unique_ptr<Proposer> proposer, StepHooks* hooks);
  void apply_queued();
  // Chooses picks_ (and pick_logprobs_) for plan_'s rows from the logits;
  // a runtime error from the masks hook.
  Outcome<> sample_rows(std::span<const float> logits);
  // The constrained picks' masks (StepHooks::masks) into allowed_; mask_at_[c]
  // = the first mask row of plan_.consumers[c], -1 for an unconstrained one.
  Outcome<> fill_masks();
  // Ends the step after a failure: every running request ends with kError.
  RunError fail_step(RunError error);
  void note_waiting();  // scheduler_waiting_ from the scheduler
  void deliver_events();

  Forward& forward_;
  std::unique_ptr<PrefixCache> prefix_;
  std::unique_ptr<Proposer> proposer_;  // nullptr = no speculation
  StepHooks* hooks_;
  Scheduler scheduler_;

  mutable std::mutex mutex_;  // guards the members below it
  std::vector<Queued> queue_;
  std::unordered_set<RequestId> live_;
  std::unordered_set<RequestId> cancelling_;  // live ids whose cancel is queued
  RequestId next_id_ = 1;
  int64_t queued_submits_ = 0;     // in queue_
  int64_t scheduler_waiting_ = 0;  // the scheduler's waiting requests after the last step

  // Immutable after create (read by submit on any thread).
  const int64_t vocab_;
  const int32_t capacity_;                // pool 0's cells (stats)
  const std::vector<PoolLimit> pools_;    // admission's view of every pool (pool_limits)
  const int64_t retained_margin_;         // the cache's R
  const int64_t step_tokens_;             // max_tokens_per_step: a step's most tokens of a sequence

  // Stepping thread only.
  std::vector<Queued> applying_;
  std::unordered_map<RequestId, std::shared_ptr<Sink>> sinks_;
  std::unordered_map<RequestId, std::shared_ptr<Sink>> ending_;  // finished, being delivered
  std::vector<SampleEvent> delivering_;
  bool stepping_ = false;
  StepPlan plan_;
  std::vector<int64_t> picks_;
  std::vector<int64_t> verified_;  // sample_rows' scratch: one group's verified tokens
  std::vector<TokenLogprobs> pick_logprobs_;  // [picks]; filled for requests asking for logprobs
  std::vector<double> scratch_;
  std::vector<MaskRow> mask_rows_;
  std::vector<uint8_t> allowed_;   // [mask_rows_ x vocab]
  std::vector<int32_t> mask_at_;   // per consumer
  std::vector<float> masked_;      // one masked logits row
  EngineStats stats_;
};

}  // namespace cellcache::runner
