#include "cellcache/admission.h"

#include <algorithm>

namespace cellcache {

namespace {

constexpr int64_t kMaxStepOrMargin = int64_t{1} << 24;  // kMaxCells

Status check_in_range(const char* name, int64_t v, int64_t lowest) {
  if (v >= lowest && v <= kMaxStepOrMargin) return Status::ok();
  return Status(StatusCode::kInvalidConfig, std::string(name) + " must lie in [" +
                                                std::to_string(lowest) + ", " +
                                                std::to_string(kMaxStepOrMargin) + "], got " +
                                                std::to_string(v));
}

Status check_sample_count(int64_t n) {
  if (n > kMaxSequences) {
    return Status(StatusCode::kCapacity, "n=" + std::to_string(n) + " samples exceed the " +
                                             std::to_string(kMaxSequences) + " sequence ids");
  }
  return Status::ok();
}

}  // namespace

Status check_request_fits(const std::string& label, int64_t prompt_len, int64_t n,
                          int64_t max_new_tokens, int64_t capacity) {
  if (prompt_len > capacity) {  // fewer samples or new tokens would not help
    return Status(StatusCode::kCapacity,
                  label + "'s prompt alone is " + std::to_string(prompt_len) +
                      " tokens but the cache has " + std::to_string(capacity) +
                      " cells; shorten it, or export with more cells (--cells)");
  }
  const int64_t need = request_worst_case_cells(prompt_len, 0, n, max_new_tokens);
  if (need > capacity) {
    return Status(StatusCode::kCapacity,
                  label + " needs up to " + std::to_string(need) + " cells (" +
                      std::to_string(prompt_len) + " prompt tokens + n=" + std::to_string(n) +
                      " samples x " + std::to_string(max_new_tokens - 1) +
                      " generated tokens fed back) but the cache has " +
                      std::to_string(capacity) +
                      "; lower max_new_tokens (--max-new-tokens) or n (--n), or export with "
                      "more cells (--cells)");
  }
  return check_sample_count(n);
}

int64_t request_worst_case_cells_in_pool(int64_t prompt_len, int64_t cached, int64_t n,
                                         int64_t max_new_tokens, Window window,
                                         int64_t retained_margin, int64_t step_tokens) {
  const int64_t all = request_worst_case_cells(prompt_len, cached, n, max_new_tokens);
  if (!window.has_value()) return all;
  const int64_t per_sequence =
      *window + std::max(retained_margin, step_tokens - 1) + std::max<int64_t>(step_tokens, 1);
  int64_t pooled = 0;
  if (__builtin_mul_overflow(n, per_sequence, &pooled)) return all;
  return std::min(all, pooled);
}

Status check_request_fits_pools(const std::string& label, int64_t prompt_len, int64_t n,
                                int64_t max_new_tokens, std::span<const PoolLimit> pools,
                                int64_t retained_margin, int64_t step_tokens) {
  // First: these bound the products below.
  Status args = check_in_range("retained_margin", retained_margin, 0);
  if (args.is_ok()) args = check_in_range("step_tokens", step_tokens, 1);
  if (!args.is_ok()) return args;
  Status ids = check_sample_count(n);
  if (!ids.is_ok()) return ids;
  for (const PoolLimit& pool : pools) {
    if (!pool.window.has_value()) {
      Status s = check_request_fits(label, prompt_len, n, max_new_tokens, pool.capacity);
      if (!s.is_ok()) return s;
      continue;
    }
    const int64_t need = request_worst_case_cells_in_pool(
        prompt_len, 0, n, max_new_tokens, pool.window, retained_margin, step_tokens);
    if (need > pool.capacity) {
      return Status(StatusCode::kCapacity,
                    label + " needs up to " + std::to_string(need) + " cells of the window-" +
                        std::to_string(*pool.window) + " pool (n=" + std::to_string(n) +
                        " sequences x (window " + std::to_string(*pool.window) +
                        " + retained margin + " + std::to_string(step_tokens) +
                        " step tokens)) but it has " + std::to_string(pool.capacity) +
                        "; lower max_new_tokens (--max-new-tokens) or n (--n), or export "
                        "with more window cells (--window-cells)");
    }
  }
  return Status::ok();
}

}  // namespace cellcache
