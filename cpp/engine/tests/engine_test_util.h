// Helpers the engine's test files share: step an engine until it is idle, and
// greedy SamplingParams.
#pragma once

#include <cstdint>

#include "check.h"
#include "engine.h"

namespace cellcache::runner::testing {

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
