#include "batch_runner.h"

#include <chrono>
#include <cmath>

#include "program.h"
#include "scheduler.h"

namespace cellcache::runner {

double GenerateStats::prefill_tokens_per_s() const {
  return prefill_seconds > 0 ? prefill_tokens / prefill_seconds : 0.0;
}

double GenerateStats::decode_tokens_per_s() const {
  return decode_seconds > 0 ? decode_tokens / decode_seconds : 0.0;
}

Outcome<std::unique_ptr<BatchRunner>> BatchRunner::load(const std::string& pte_path) {
  auto program = CellCacheProgram::load(pte_path);
  if (!program.ok()) return program.error();
  return std::unique_ptr<BatchRunner>(new BatchRunner(std::move(program.value())));
}

BatchRunner::BatchRunner(std::unique_ptr<CellCacheProgram> program)
    : program_(std::move(program)) {
  stats_.capacity = program_->info().n_cells;
}

BatchRunner::~BatchRunner() = default;

const ProgramInfo& BatchRunner::info() const { return program_->info(); }

Outcome<> BatchRunner::check(const std::vector<std::vector<int64_t>>& prompts,
                             const GenerateOptions& options) const {
  if (options.n < 1) return user_error("n must be >= 1, got " + std::to_string(options.n));
  if (options.max_new_tokens < 1) {
    return user_error("max_new_tokens must be >= 1, got " +
                      std::to_string(options.max_new_tokens));
  }
  const double t = options.sampling.temperature;
  if (!std::isfinite(t) || t < 0) {
    return user_error("temperature must be a finite number >= 0, got " + std::to_string(t));
  }
  const int64_t vocab = info().vocab_size;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) return user_error("prompt " + std::to_string(i) + " is empty");
    for (int64_t token : prompts[i]) {
      if (token < 0 || token >= vocab) {
        return user_error("prompt " + std::to_string(i) + " has token id " +
                          std::to_string(token) + " outside the vocabulary [0, " +
                          std::to_string(vocab) + ")");
      }
    }
  }
  return {};
}

Outcome<Generations> BatchRunner::generate(const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerateOptions& options) {
  stats_ = GenerateStats{};
  stats_.capacity = program_->info().n_cells;
  if (auto checked = check(prompts, options); !checked.ok()) return checked.error();
  auto result = run(prompts, options);
  program_->cache().clear();  // a failed run may leave sequences behind
  return result;
}

Outcome<Generations> BatchRunner::run(const std::vector<std::vector<int64_t>>& prompts,
                                      const GenerateOptions& options) {
  const ProgramInfo& info = program_->info();
  CellCache& cache = program_->cache();
  Scheduler sched(cache, info.max_tokens_per_step, options.sampling, info.eos_ids,
                  options.stop_on_eos);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto submitted =
        sched.submit(static_cast<int32_t>(i), prompts[i], options.n, options.max_new_tokens);
    if (!submitted.ok()) return submitted.error();
  }
  while (!sched.idle()) {
    auto plan = sched.plan();
    if (!plan.ok()) return plan.error();
    if (plan->batch.tokens.empty()) {
      return runtime_error("no request can be admitted into the free cells (" +
                           std::to_string(cache.free_cells()) + " of " +
                           std::to_string(cache.capacity()) + ")");
    }
    // A step of prompt chunks that end no prompt needs no logits, but a
    // forward returns at least one row: take the last token's and ignore it
    // (commit reads one row per consumer).
    if (plan->batch.logits_for.empty()) {
      plan->batch.logits_for.push_back(static_cast<int64_t>(plan->batch.tokens.size()) - 1);
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto logits = program_->forward(plan->batch);
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!logits.ok()) return logits.error();
    stats_.steps += 1;
    stats_.peak_cells = std::max(stats_.peak_cells, cache.capacity() - cache.free_cells());
    stats_.prefill_tokens += plan->n_prefill;
    stats_.decode_tokens += plan->n_decode;
    (plan->n_prefill ? stats_.prefill_seconds : stats_.decode_seconds) += elapsed;
    auto committed = sched.commit(plan.value(), logits.value(), info.vocab_size);
    if (!committed.ok()) return committed.error();
  }
  Generations results(prompts.size());
  for (const Request* req : sched.finished()) {
    for (const Sample& s : req->samples) results[req->index].push_back(s.tokens);
  }
  return results;
}

}  // namespace cellcache::runner
