// Scheduler: continuous batching over the cell cache (a port of
// executorch_cellcache/runtime/scheduler.py; the two must plan identical steps, so
// greedy output matches the Python runner token for token).
//
// Each step packs, up to max_tokens_per_step tokens: first one decode token
// of every running sample (round-robin from where the last step stopped when
// they exceed the budget), then chunks of admitted prompts in admission
// order, so a new prompt's prefill shares forwards with other sequences'
// decoding. A prompt is prefilled once into one sequence; its n samples are
// seq_clones of it (sample 0 is the prompt's sequence itself).
//
// Admission: a waiting request is admitted (FIFO) only when the cells it can
// still need in the worst case (prompt + n * (max_new_tokens - 1); a sample's
// last token is never fed back) fit in the free cells left after the running
// requests' worst cases, and its n sequence ids fit. So a running request
// never runs out of cells; a request that could not fit even in an empty
// cache is refused at submit.
//
// A sample stops at max_new_tokens or at an EOS (included in its tokens);
// its sequence is freed then.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <random>
#include <span>
#include <unordered_set>
#include <vector>

#include "cellcache/cell_cache.h"
#include "program.h"
#include "run_status.h"
#include "sampling.h"

namespace cellcache::runner {

struct Request;

struct Sample {
  int32_t index = 0;             // within its request
  seq_t seq = -1;
  std::mt19937_64 rng;
  Request* request = nullptr;
  std::vector<int64_t> tokens;   // generated so far
  bool done = false;
};

struct Request {
  int32_t index = 0;             // prompt index
  std::vector<int64_t> prompt;
  int32_t n = 1;
  int32_t max_new_tokens = 1;
  seq_t seq = -1;                // the prompt's sequence while prefilling
  int32_t prefilled = 0;         // prompt tokens placed
  std::vector<Sample> samples;   // empty until the prompt's last token ran

  // Cells this request may still claim.
  int64_t worst_case_cells() const;
  bool finished() const;
};

// The step's consumer of one logits row: the decode sample, or the request
// whose prompt ends at that token. Exactly one is set.
struct RowConsumer {
  Sample* sample = nullptr;
  Request* prompt_end = nullptr;
};

struct StepPlan {
  StepBatch batch;
  std::vector<RowConsumer> consumers;  // consumers[i] takes logits row i
  int32_t n_prefill = 0;
  int32_t n_decode = 0;
};

class Scheduler {
 public:
  Scheduler(CellCache& cache, int32_t max_tokens_per_step, Sampling sampling,
            const std::vector<int64_t>& eos_ids, bool stop_on_eos);

  // Queues a request. User error when it can never fit in
  // the cache or needs more sequence ids than exist.
  Outcome<> submit(int32_t index, std::vector<int64_t> prompt, int32_t n,
                   int32_t max_new_tokens);
  bool idle() const { return waiting_.empty() && running_.empty(); }
  // Admits what fits, then packs the next step (batch.tokens may be empty
  // when nothing runs and nothing fits).
  Outcome<StepPlan> plan();
  // Applies a step's results. logits: float32 [>= consumers.size() rows * vocab];
  // rows past the consumers are ignored.
  Outcome<> commit(const StepPlan& plan, std::span<const float> logits, int64_t vocab);
  // Requests in the order they finished.
  const std::vector<Request*>& finished() const { return finished_; }

 private:
  Outcome<> admit();
  Outcome<> start_samples(Request& request, std::span<const float> row);
  Outcome<> emit(Sample& sample, std::span<const float> row);

  CellCache& cache_;
  int32_t budget_;
  Sampling sampling_;
  std::unordered_set<int64_t> eos_;
  std::vector<std::unique_ptr<Request>> requests_;  // owns every request
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::vector<Request*> finished_;
  int64_t next_decode_ = 0;  // round-robin start when decode tokens exceed the budget
};

}  // namespace cellcache::runner
