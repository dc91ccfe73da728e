// Admission arithmetic: the cells a request can still claim, and whether a
// request could ever run in a cache. One home for the rule, used by the C++
// engine (cpp/engine/scheduler.cpp) and, through the binding, by the Python
// scheduler (executorch_cellcache/runtime/scheduler.py).
//
// A request of a P-token prompt with n samples of up to M new tokens claims
// at most P - C + n * (M - 1) cells, C being the prompt tokens served from a
// cached prefix (cloned, not placed): the prompt is placed once into one
// sequence, the n samples share it (seq_clone), and each sample feeds back
// all of its tokens but the last, whose K/V is never computed.
//
// A windowed pool that reclaims (cell_pool.h; window W, retained margin R)
// holds of each sequence, after a step, what lies at or above its floor:
// at most W + max(R, T - 1) cells when a step carries at most T of its
// tokens at consecutive positions, plus the T of the step being placed. A request's n sequences (the prompt's sequence is
// its first sample) then claim at most min(the full count above,
// n * (W + max(R, T - 1) + T)) cells of that pool, however long they grow.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "cellcache/cell_table.h"
#include "cellcache/status.h"
#include "cellcache/window.h"

namespace cellcache {

// Worst-case cells of a request not yet started: prompt_len - cached +
// n * (max_new_tokens - 1). Arguments as validated by check_request_fits.
// Saturates at INT64_MAX (more than any cache holds) instead of overflowing:
// max_new_tokens and n come from clients unbounded above.
inline int64_t request_worst_case_cells(int64_t prompt_len, int64_t cached, int64_t n,
                                        int64_t max_new_tokens) {
  int64_t fed_back = 0, own = 0, total = 0;
  if (__builtin_sub_overflow(max_new_tokens, 1, &fed_back) ||
      __builtin_mul_overflow(n, fed_back, &fed_back) ||
      __builtin_sub_overflow(prompt_len, cached, &own) ||
      __builtin_add_overflow(own, fed_back, &total)) {
    return INT64_MAX;
  }
  return total;
}

// kCapacity when a request of prompt_len tokens, n samples and
// max_new_tokens could not run even in an empty cache of `capacity` cells
// (too many cells or more than kMaxSequences samples); ok otherwise. `label`
// names the request in the message ("prompt 3", "the request").
Status check_request_fits(const std::string& label, int64_t prompt_len, int64_t n,
                          int64_t max_new_tokens, int64_t capacity);

// One pool as admission sees it (CellCache::pool_state).
struct PoolLimit {
  Window window;         // nullopt = full causal: nothing reclaimed
  int64_t capacity = 0;  // cells
};

// Worst-case cells of a request not yet started in a pool of `window`:
// request_worst_case_cells for a full pool; for a window W, at most
// n * (W + max(retained_margin, step_tokens - 1) + step_tokens) besides
// (see above). step_tokens: the most tokens of one sequence a step carries
// (>= 1).
int64_t request_worst_case_cells_in_pool(int64_t prompt_len, int64_t cached, int64_t n,
                                         int64_t max_new_tokens, Window window,
                                         int64_t retained_margin, int64_t step_tokens);

// check_request_fits for every pool of a pooled cache: kCapacity for n beyond
// the sequence ids (checked first), or naming the first pool whose worst case
// exceeds its capacity; ok otherwise.
Status check_request_fits_pools(const std::string& label, int64_t prompt_len, int64_t n,
                                int64_t max_new_tokens, std::span<const PoolLimit> pools,
                                int64_t retained_margin, int64_t step_tokens);

}  // namespace cellcache
