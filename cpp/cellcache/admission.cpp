#include "cellcache/admission.h"

namespace cellcache {

Status check_request_fits(const std::string& label, int64_t prompt_len, int64_t n,
                          int64_t max_new_tokens, int64_t capacity) {
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
  if (n > kMaxSequences) {
    return Status(StatusCode::kCapacity, "n=" + std::to_string(n) + " samples exceed the " +
                                             std::to_string(kMaxSequences) + " sequence ids");
  }
  return Status::ok();
}

}  // namespace cellcache
