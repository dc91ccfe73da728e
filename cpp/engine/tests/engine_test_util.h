// Helpers the engine's test files share: step an engine until it is idle,
// greedy SamplingParams, and a sink that keeps every event per sample.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "check.h"
#include "engine.h"

namespace cellcache::runner::testing {

// Per sample: its tokens, each token's finish reason and logprob (when asked),
// and its FinishEvent.
struct SampleSink final : Sink {
  std::map<int32_t, std::vector<int64_t>> tokens;
  std::map<int32_t, std::vector<FinishReason>> token_finishes;
  std::map<int32_t, std::vector<double>> logprobs;
  std::map<int32_t, FinishEvent> finishes;
  void on_token(const TokenEvent& e) override {
    tokens[e.sample].push_back(e.token);
    token_finishes[e.sample].push_back(e.finish);
    if (e.logprobs != nullptr) logprobs[e.sample].push_back(e.logprobs->logprob);
  }
  void on_finish(const FinishEvent& e) override { finishes[e.sample] = e; }
};

// Steps `e` until a step has nothing to run; a step error or 100,000 steps fail the test.
inline void run_all(Engine& e) {
  for (int guard = 0; guard < 100000; ++guard) {
    auto stepped = e.step();
    CHECK(stepped.ok());
    if (!stepped.ok() || !stepped.value()) return;
  }
  CHECK(false);  // never idle
}

inline SamplingParams greedy(int32_t max_new, int32_t n = 1) {
  SamplingParams p;
  p.max_new_tokens = max_new;
  p.n = n;
  return p;
}

}  // namespace cellcache::runner::testing
