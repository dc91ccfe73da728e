// BatchRunner: batched generation from a cell-cache .pte, in C++ with no
// Python (the on-device counterpart of executorch_cellcache.Runner.generate).
// A loop over Engine (engine.h): submit every prompt, step until all are done.
//
//   auto loaded = cellcache::runner::BatchRunner::load("model.pte");
//   if (!loaded.ok()) { report(loaded.error().message); return; }
//   auto& runner = *loaded.value();
//   SamplingParams params;
//   params.n = 2;
//   params.max_new_tokens = 16;
//   auto out = runner.generate({{256, 72, 105}, {256, 79}}, params);
//   // out.value()[prompt][sample] = new token ids (a stop token that ended a
//   // sample is included)
//
// Continuous batching, forking (n samples share the prompt's cells),
// admission and the prefix cache follow the Python runner exactly
// (scheduler.h), so greedy output is identical to Runner.generate's.
// Finished samples stay in the prefix cache (EngineOptions), so a later
// generate() whose prompts start with earlier prompts and outputs prefills
// only the rest. Link the CMake target cellcache_runner_lib. Not thread-safe:
// one thread drives a runner; for live requests use Engine directly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "program_info.h"
#include "run_status.h"
#include "sampling.h"

namespace cellcache::runner {

class CellCacheProgram;

// A generate() call's figures: the engine's (steps, tokens, forward times,
// peak cells) plus what the call's prompts got from the prefix cache.
struct GenerateStats : EngineStats {
  std::vector<int64_t> cached_tokens;  // per prompt: tokens served from the prefix cache
  int32_t prefix_cache_cells = 0;      // cells only the prefix cache holds afterwards
};

// [prompt][sample] -> new token ids
using Generations = std::vector<std::vector<std::vector<int64_t>>>;

class BatchRunner {
 public:
  // User errors: see CellCacheProgram::load (missing file, not a cell-cache
  // program, ...) and a bad prefix_cache_cells.
  static Outcome<std::unique_ptr<BatchRunner>> load(const std::string& pte_path,
                                                    EngineOptions options = {});
  ~BatchRunner();

  const ProgramInfo& info() const;

  // prompts: non-empty token-id lists; every prompt gets `params`. User
  // errors (nothing runs): bad params, an empty prompt, a token outside the
  // vocabulary, a request that can never fit in the cache. Runtime errors: a
  // forward failed (the call's sequences are freed).
  Outcome<Generations> generate(const std::vector<std::vector<int64_t>>& prompts,
                                const SamplingParams& params);
  // Statistics of the last generate().
  const GenerateStats& last_stats() const { return stats_; }
  Engine& engine() { return *engine_; }

 private:
  BatchRunner(std::unique_ptr<CellCacheProgram> program, std::unique_ptr<Engine> engine);

  std::unique_ptr<CellCacheProgram> program_;
  std::unique_ptr<Engine> engine_;
  GenerateStats stats_;
};

}  // namespace cellcache::runner
