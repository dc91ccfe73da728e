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
// only the rest. With EngineOptions::speculative, decode steps verify
// proposed tokens (prompt lookup, or a draft model loaded from draft_pte_path)
// with the same greedy output. Link the CMake target cellcache_runner_lib. Not thread-safe:
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

// Loads the draft .pte of speculative method kDraft and points options.draft
// at it (options.draft_name becomes "the draft model <path>"); the program
// must outlive the engine created with options. Errors: CellCacheProgram::load's,
// prefixed "draft model: ".
Outcome<std::unique_ptr<CellCacheProgram>> load_draft(const std::string& path,
                                                      EngineOptions& options);

class BatchRunner {
 public:
  // User errors: see CellCacheProgram::load (missing file, not a cell-cache
  // program, ...; for the draft: "draft model: ..."), a bad
  // prefix_cache_cells, and Engine::create's speculative checks.
  // draft_pte_path: the draft .pte for speculative method kDraft ("" = none;
  // options.draft is set to it).
  static Outcome<std::unique_ptr<BatchRunner>> load(const std::string& pte_path,
                                                    EngineOptions options = {},
                                                    const std::string& draft_pte_path = "");
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
  BatchRunner(std::unique_ptr<CellCacheProgram> program, std::unique_ptr<CellCacheProgram> draft,
              std::unique_ptr<Engine> engine);

  std::unique_ptr<CellCacheProgram> program_;
  std::unique_ptr<CellCacheProgram> draft_;  // the draft model, or nullptr
  std::unique_ptr<Engine> engine_;           // last: it drives the programs above
  GenerateStats stats_;
};

}  // namespace cellcache::runner
