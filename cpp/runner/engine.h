// Engine: the on-device serving loop. Requests arrive and leave at any time;
// each step() runs one forward over whatever runs now (continuous batching,
// scheduler.h), tokens stream to each request's Sink as they are chosen, and
// finished conversations stay in a prefix cache (prefix_cache.h), so a
// conversation's next turn (its history plus the new message) prefills only
// the new tokens.
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

namespace cellcache::runner {

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;      // prompt tokens served from the prefix cache
  int64_t completion_tokens = 0;  // this sample's tokens (a stop token included)
};

struct TokenEvent {
  RequestId request = 0;
  int32_t sample = 0;
  int64_t token = 0;
  const TokenLogprobs* logprobs = nullptr;  // set when the request asked for logprobs
  bool stop_token = false;                  // this token is the stop token ending the sample
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

struct EngineOptions {
  bool prefix_cache = true;
  std::optional<int32_t> prefix_cache_cells;  // bound on cells only the cache holds
};

struct EngineStats {
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;       // in every step
  int64_t decode_step_tokens = 0;  // in steps without prompt tokens (what decode_seconds timed)
  int64_t steps = 0;
  double prefill_seconds = 0;   // forwards that carried prompt tokens
  double decode_seconds = 0;    // forwards that carried only decode tokens
  double overhead_seconds = 0;  // step() time outside the forward, of which:
  double plan_seconds = 0;      //   queued work applied, admission, packing the step
  double sample_seconds = 0;    //   choosing tokens (and logprobs) from the logits
  double commit_seconds = 0;    //   commit, prefix-cache inserts, sink callbacks
  int32_t peak_cells = 0;
  int32_t capacity = 0;

  double prefill_tokens_per_s() const;
  double decode_tokens_per_s() const;  // decode_step_tokens / decode_seconds
};

class Engine {
 public:
  // forward (and its cache) must outlive the engine, and the engine owns the
  // cache: admission counts only this engine's requests, so no other engine or
  // caller may hold cells in it meanwhile. User errors: a bad
  // prefix_cache_cells, a forward with max_tokens_per_step or vocab_size < 1.
  static Outcome<std::unique_ptr<Engine>> create(Forward& forward, EngineOptions options);
  // Ends every request still waiting or running (kCancelled to its sink) and
  // frees every cell and id the engine holds, prefix cache included.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Any thread. Queues a request; its id, or a user error naming `label`
  // (nothing queued): an empty prompt, a token or stop token outside the
  // vocabulary, a parameter out of range, a request that could never fit in
  // the cache (Scheduler::check_request), a null sink.
  Outcome<RequestId> submit(std::vector<int64_t> prompt, SamplingParams params,
                            std::shared_ptr<Sink> sink, const std::string& label = "the prompt");
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
  // Stepping thread: no request waits or runs and nothing is queued.
  bool idle() const;

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
  };
  struct QueuedCancel {
    RequestId id;
  };
  using Queued = std::variant<QueuedSubmit, QueuedCancel>;

  Engine(Forward& forward, std::unique_ptr<PrefixCache> prefix);
  void apply_queued();
  // Chooses picks_ (and pick_logprobs_) for plan_'s rows from the logits.
  void sample_rows(std::span<const float> logits);
  void deliver_events();

  Forward& forward_;
  std::unique_ptr<PrefixCache> prefix_;
  Scheduler scheduler_;

  mutable std::mutex mutex_;  // guards the members below it
  std::vector<Queued> queue_;
  std::unordered_set<RequestId> live_;
  std::unordered_set<RequestId> cancelling_;  // live ids whose cancel is queued
  RequestId next_id_ = 1;

  // Immutable after create (read by submit on any thread).
  const int64_t vocab_;
  const int32_t capacity_;

  // Stepping thread only.
  std::vector<Queued> applying_;
  std::unordered_map<RequestId, std::shared_ptr<Sink>> sinks_;
  std::unordered_map<RequestId, std::shared_ptr<Sink>> ending_;  // finished, being delivered
  std::vector<SampleEvent> delivering_;
  bool stepping_ = false;
  StepPlan plan_;
  std::vector<int64_t> picks_;
  std::vector<TokenLogprobs> pick_logprobs_;  // [picks]; filled for requests asking for logprobs
  std::vector<double> scratch_;
  EngineStats stats_;
};

}  // namespace cellcache::runner
