#include "draft_length.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "cellcache/admission.h"
#include "scheduler.h"

namespace cellcache::runner {

namespace {

bool positive_finite(double x) { return std::isfinite(x) && x > 0.0; }

RunError cache_error(const char* verb, const Status& status) {
  return runtime_error(std::string("measuring step costs: ") + verb + " failed: [" +
                       status_code_name(status.code()) + "] " + status.message());
}

}  // namespace

Outcome<int32_t> choose_max_draft(std::span<const double> step_seconds, double proposal_seconds,
                                  double acceptance) {
  if (step_seconds.size() < 2) {
    return user_error("choosing max_draft needs the cost of steps of 1 and 2 tokens at least, "
                      "got " + std::to_string(step_seconds.size()) + " step size(s)");
  }
  for (size_t i = 0; i < step_seconds.size(); ++i) {
    if (!positive_finite(step_seconds[i])) {
      return user_error("step_seconds[" + std::to_string(i) + "] must be a positive number, got " +
                        std::to_string(step_seconds[i]));
    }
  }
  if (!std::isfinite(proposal_seconds) || proposal_seconds < 0.0) {
    return user_error("proposal_seconds must be a number >= 0, got " +
                      std::to_string(proposal_seconds));
  }
  if (!(acceptance > 0.0 && acceptance < 1.0)) {
    return user_error("acceptance must be in (0, 1), got " + std::to_string(acceptance));
  }
  std::vector<double> rates(step_seconds.size() + 1, 0.0);
  double best = -1.0;
  for (size_t n = 2; n <= step_seconds.size(); ++n) {
    const double expected = (1.0 - std::pow(acceptance, static_cast<double>(n))) /
                            (1.0 - acceptance);
    rates[n] = expected / (step_seconds[n - 1] + static_cast<double>(n - 1) * proposal_seconds);
    best = std::max(best, rates[n]);
  }
  // Free proposals: the largest n within the tolerance of the best; a draft
  // model's: the smallest n that reaches the best.
  const double floor = proposal_seconds == 0.0 ? best * (1.0 - kAutoDraftLookupTolerance) : best;
  int32_t chosen = 2;
  for (size_t n = 2; n <= step_seconds.size(); ++n) {
    if (rates[n] >= floor) {
      chosen = static_cast<int32_t>(n);
      if (proposal_seconds != 0.0) break;
    }
  }
  return chosen - 1;
}

Outcome<std::vector<double>> measure_step_seconds(Forward& forward, int32_t max_tokens,
                                                  int32_t rounds) {
  const int32_t budget = forward.max_tokens_per_step();
  if (max_tokens < 1 || max_tokens > budget) {
    return user_error("measuring step costs: max_tokens must be in [1, " +
                      std::to_string(budget) + "] (the program's max_tokens_per_step), got " +
                      std::to_string(max_tokens));
  }
  if (rounds < 1) {
    return user_error("measuring step costs: rounds must be >= 1, got " + std::to_string(rounds));
  }
  CellCache& cache = forward.cache();
  // In every pool (a pooled cache places each token in each; a reclaiming
  // pool needs at most one sequence's worst case there: cellcache/admission.h).
  const std::vector<PoolLimit> pools = pool_limits(cache);
  for (size_t p = 0; p < pools.size(); ++p) {
    const int64_t need = request_worst_case_cells_in_pool(
        0, 0, 1, kStepCostContext + max_tokens + 1, pools[p].window, cache.retained_margin(),
        budget);
    const int32_t free = cache.pool_state(static_cast<int32_t>(p)).value().free_cells;
    if (free < need) {
      return user_error("measuring step costs needs " + std::to_string(need) +
                        " free cells; the cache has " + std::to_string(free) +
                        (pools.size() > 1 ? " in pool " + std::to_string(p) : ""));
    }
  }
  auto seq = cache.seq_new();
  if (!seq.is_ok()) return user_error("measuring step costs needs a free sequence id: " +
                                   seq.status().message());
  const seq_t s = seq.value();
  const int64_t vocab = forward.vocab_size();
  StepBatch batch;
  auto fill = [&](int32_t n, int64_t start, bool all_logits) {
    batch.clear();
    for (int32_t i = 0; i < n; ++i) {
      batch.seq_ids.push_back(s);
      batch.tokens.push_back((start + i) % vocab);
      batch.positions.push_back(start + i);
      if (all_logits || i == n - 1) batch.logits_for.push_back(i);
    }
  };
  auto fail = [&](RunError error) -> Outcome<std::vector<double>> {
    (void)cache.seq_free(s);
    return error;
  };
  for (int64_t at = 0; at < kStepCostContext;) {
    const int32_t n = static_cast<int32_t>(std::min<int64_t>(budget, kStepCostContext - at));
    fill(n, at, false);
    if (auto out = forward.forward(batch); !out.ok()) return fail(out.error());
    at += n;
  }
  std::vector<std::vector<double>> seconds(static_cast<size_t>(max_tokens));
  for (int32_t r = 0; r <= rounds; ++r) {  // round 0 warms up
    for (int32_t n = 1; n <= max_tokens; ++n) {
      fill(n, kStepCostContext, true);
      const auto t0 = std::chrono::steady_clock::now();
      auto out = forward.forward(batch);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                            .count();
      if (!out.ok()) return fail(out.error());
      if (Status rm = cache.seq_rm(s, kStepCostContext); !rm.is_ok()) {
        return fail(cache_error("seq_rm", rm));
      }
      if (r > 0) seconds[static_cast<size_t>(n - 1)].push_back(dt);
    }
  }
  if (Status freed = cache.seq_free(s); !freed.is_ok()) return cache_error("seq_free", freed);
  std::vector<double> medians;
  for (auto& times : seconds) {
    std::sort(times.begin(), times.end());
    const size_t m = times.size();
    medians.push_back(m % 2 ? times[m / 2] : 0.5 * (times[m / 2 - 1] + times[m / 2]));
  }
  return medians;
}

}  // namespace cellcache::runner
