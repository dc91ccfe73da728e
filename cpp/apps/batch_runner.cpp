#include "batch_runner.h"

#include <algorithm>

#include "program.h"

namespace cellcache::runner {

namespace {

// Collects one prompt's samples.
class PromptSink final : public Sink {
 public:
  explicit PromptSink(int32_t n) : samples(static_cast<size_t>(n)) {}
  void on_token(const TokenEvent& e) override { samples[e.sample].push_back(e.token); }
  void on_finish(const FinishEvent& e) override {
    cached_tokens = e.usage.cached_tokens;
    if (e.reason == FinishReason::kError) failed = true;
  }
  std::vector<std::vector<int64_t>> samples;
  int64_t cached_tokens = 0;
  bool failed = false;
};

}  // namespace

Outcome<std::unique_ptr<CellCacheProgram>> load_draft(const std::string& path,
                                                      EngineOptions& options) {
  auto draft = CellCacheProgram::load(path);
  if (!draft.ok()) {
    RunError error = draft.error();
    error.message = "draft model: " + error.message;
    return error;
  }
  options.draft = draft.value().get();
  options.draft_name = "the draft model " + path;
  return std::move(draft.value());
}

Outcome<std::unique_ptr<BatchRunner>> BatchRunner::load(const std::string& pte_path,
                                                        EngineOptions options,
                                                        const std::string& draft_pte_path) {
  auto program = CellCacheProgram::load(pte_path);
  if (!program.ok()) return program.error();
  std::unique_ptr<CellCacheProgram> draft;
  if (!draft_pte_path.empty()) {
    auto loaded = load_draft(draft_pte_path, options);
    if (!loaded.ok()) return loaded.error();
    draft = std::move(loaded.value());
  }
  auto engine = Engine::create(*program.value(), options);
  if (!engine.ok()) return engine.error();
  return std::unique_ptr<BatchRunner>(new BatchRunner(
      std::move(program.value()), std::move(draft), std::move(engine.value())));
}

BatchRunner::BatchRunner(std::unique_ptr<CellCacheProgram> program,
                         std::unique_ptr<CellCacheProgram> draft, std::unique_ptr<Engine> engine)
    : program_(std::move(program)), draft_(std::move(draft)), engine_(std::move(engine)) {
  stats_.capacity = engine_->cache().capacity();  // pool 0's, as peak_cells (engine.h)
}

BatchRunner::~BatchRunner() = default;

const ProgramInfo& BatchRunner::info() const { return program_->info(); }

Outcome<Generations> BatchRunner::generate(const std::vector<std::vector<int64_t>>& prompts,
                                           const SamplingParams& params) {
  stats_ = GenerateStats{};
  stats_.capacity = engine_->cache().capacity();  // pool 0's, as peak_cells (engine.h)
  engine_->reset_stats();
  std::vector<std::shared_ptr<PromptSink>> sinks;
  std::vector<RequestId> ids;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto sink = std::make_shared<PromptSink>(std::max(params.n, 1));
    auto id = engine_->submit(prompts[i], params, sink, {.label = "prompt " + std::to_string(i)});
    if (!id.ok()) {
      for (RequestId queued : ids) (void)engine_->cancel(queued);
      while (true) {  // applies the cancels; nothing of this call runs
        auto stepped = engine_->step();
        if (!stepped.ok() || !stepped.value()) break;
      }
      return id.error();
    }
    ids.push_back(id.value());
    sinks.push_back(std::move(sink));
  }
  RunError failure;
  bool failed = false;
  while (true) {
    auto stepped = engine_->step();
    if (stepped.ok() && stepped.value()) continue;
    if (!stepped.ok() && !failed) {
      // The failed step ended the running requests; drop those still waiting.
      failure = stepped.error();
      failed = true;
      for (RequestId id : ids) (void)engine_->cancel(id);
      continue;
    }
    break;
  }
  static_cast<EngineStats&>(stats_) = engine_->stats();
  if (engine_->prefix_cache() != nullptr) {
    stats_.prefix_cache_cells = engine_->prefix_cache()->reclaimable_cells();
  }
  if (failed) return failure;
  Generations results;
  results.reserve(sinks.size());
  for (auto& sink : sinks) {
    stats_.cached_tokens.push_back(sink->cached_tokens);
    results.push_back(std::move(sink->samples));
  }
  return results;
}

}  // namespace cellcache::runner
