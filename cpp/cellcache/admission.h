// Admission arithmetic: the cells a request can still claim, and whether a
// request could ever run in a cache. One home for the rule, used by the C++
// engine (cpp/runner/scheduler.cpp) and, through the binding, by the Python
// scheduler (executorch_cellcache/runtime/scheduler.py).
//
// A request of a P-token prompt with n samples of up to M new tokens claims
// at most P - C + n * (M - 1) cells, C being the prompt tokens served from a
// cached prefix (cloned, not placed): the prompt is placed once into one
// sequence, the n samples share it (seq_clone), and each sample feeds back
// all of its tokens but the last, whose K/V is never computed.
#pragma once

#include <cstdint>
#include <string>

#include "cellcache/cell_table.h"
#include "cellcache/status.h"

namespace cellcache {

// Worst-case cells of a request not yet started: prompt_len - cached +
// n * (max_new_tokens - 1). Arguments as validated by check_request_fits.
inline int64_t request_worst_case_cells(int64_t prompt_len, int64_t cached, int64_t n,
                                        int64_t max_new_tokens) {
  return prompt_len - cached + n * (max_new_tokens - 1);
}

// kCapacity when a request of prompt_len tokens, n samples and
// max_new_tokens could not run even in an empty cache of `capacity` cells
// (too many cells or more than kMaxSequences samples); ok otherwise. `label`
// names the request in the message ("prompt 3", "the request").
Status check_request_fits(const std::string& label, int64_t prompt_len, int64_t n,
                          int64_t max_new_tokens, int64_t capacity);

}  // namespace cellcache
