// The attention window rule: which key positions a query position may see.
//
// A layer attends either with full causal attention or with a sliding window of
// W positions. Windows are measured in token positions, never in cells: the
// cells of a sequence are scattered and its positions may have gaps.
//
// Rule (transformers' sliding_window_overlay, Mistral/Gemma: q - k < W):
//   a query at position p sees a key at position k  iff  k <= p  and
//   (full causal, or p - k < W).
// Worked example, W = 4, p = 5: keys 2, 3, 4, 5 are visible; 1 is not (5-1=4).
#pragma once

#include <cstdint>
#include <optional>

namespace cellcache {

using pos_t = int32_t;  // token position within a sequence, >= 0; -1 = none

// std::nullopt = full causal; otherwise W >= 1 (validated by CacheConfig).
using Window = std::optional<int32_t>;

inline bool window_sees(Window window, pos_t key_pos, pos_t query_pos) {
  if (key_pos > query_pos) return false;
  if (!window.has_value()) return true;
  return static_cast<int64_t>(query_pos) - key_pos < *window;
}

}  // namespace cellcache
