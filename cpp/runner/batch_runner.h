// BatchRunner: batched generation from a cell-cache .pte, in C++ with no
// Python (the on-device counterpart of executorch_cellcache.Runner).
//
//   auto loaded = cellcache::runner::BatchRunner::load("model.pte");
//   if (!loaded.ok()) { report(loaded.error().message); return; }
//   auto& runner = *loaded.value();
//   auto out = runner.generate({{256, 72, 105}, {256, 79}}, {.n = 2, .max_new_tokens = 16});
//   // out.value()[prompt][sample] = new token ids (an EOS that stopped a
//   // sample is included)
//
// Continuous batching, forking (n samples share the prompt's cells) and
// admission follow the Python runner exactly (scheduler.h), so greedy output
// is identical to Runner.generate's. Link the CMake target cellcache_runner_lib.
// Not thread-safe: one thread drives a runner.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "program_info.h"
#include "run_status.h"
#include "sampling.h"

namespace cellcache::runner {

class CellCacheProgram;

struct GenerateOptions {
  int32_t n = 1;                // samples per prompt, >= 1
  int32_t max_new_tokens = 32;  // per sample, >= 1
  Sampling sampling;            // greedy by default
  bool stop_on_eos = true;
};

struct GenerateStats {
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;
  int64_t steps = 0;
  double prefill_seconds = 0;   // forwards that carried prompt tokens
  double decode_seconds = 0;    // forwards that carried only decode tokens
  int32_t peak_cells = 0;
  int32_t capacity = 0;

  double prefill_tokens_per_s() const;
  double decode_tokens_per_s() const;
};

// [prompt][sample] -> new token ids
using Generations = std::vector<std::vector<std::vector<int64_t>>>;

class BatchRunner {
 public:
  // User errors: see CellCacheProgram::load (missing file, not a cell-cache
  // program, ...).
  static Outcome<std::unique_ptr<BatchRunner>> load(const std::string& pte_path);
  ~BatchRunner();

  const ProgramInfo& info() const;

  // prompts: non-empty token-id lists. User errors: bad options, an empty
  // prompt, a token outside the vocabulary, a request that can never fit in
  // the cache. The cache is empty again afterwards, also after an error.
  Outcome<Generations> generate(const std::vector<std::vector<int64_t>>& prompts,
                                const GenerateOptions& options);
  // Statistics of the last generate().
  const GenerateStats& last_stats() const { return stats_; }

 private:
  explicit BatchRunner(std::unique_ptr<CellCacheProgram> program);
  Outcome<> check(const std::vector<std::vector<int64_t>>& prompts,
                  const GenerateOptions& options) const;
  Outcome<Generations> run(const std::vector<std::vector<int64_t>>& prompts,
                           const GenerateOptions& options);

  std::unique_ptr<CellCacheProgram> program_;
  GenerateStats stats_;
};

}  // namespace cellcache::runner
