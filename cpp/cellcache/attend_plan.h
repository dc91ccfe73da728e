// AttendPlan: the cells each token of a step may attend, in the compact form
// the cellcache::attend kernel reads (SPEC section 8), instead of a dense
// [n_tok, used_end] mask.
//
// Per sequence of the step (in order of first appearance), `cells` lists the
// cells it owns, ordered by position (so a window is a contiguous run). A
// token attends exactly cells[tok_begin[i] .. tok_end[i]): its own sequence's
// cells with position in (p - W, p] (window W) or [0, p] (full causal), i.e.
// the mask rule of cell_cache.h / window.h. tok_group[i] is the index of the
// token's sequence in that order; tokens of one group index ranges inside
// [group_begin[g], group_begin[g + 1]).
//
// A windowed pool that reclaims (cell_pool.h) lists only the cells a
// sequence still holds: group_reclaimed[g] counts the positions of group g's
// sequence the pool gave up, all below its first listed cell, so the cell at
// index j of a group is the (group_reclaimed[g] + j - group_begin[g])-th of
// every position the sequence ever kept, whether reclaimed or not. A kernel
// that cuts a sequence's cells into fixed pieces counts them from that
// anchor, so its cuts do not move when reclaim drops the oldest cells. 0 in a
// pool that does not reclaim.
//
// Cost: the lists are built once per step, O(used_end * kMaxSequences/64 +
// listed cells), sorting a list only when its cells are not already in
// position order; the ranges once per distinct window per step,
// O(n_tok log(cells of the sequence)). Buffers are reused across steps.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cellcache/cell_table.h"
#include "cellcache/window.h"

namespace cellcache {

struct AttendPlan {
  std::span<const cell_t> cells;        // [n_listed] grouped by sequence, by position
  std::span<const int32_t> group_begin; // [n_groups + 1] offsets into cells
  std::span<const int32_t> tok_group;   // [n_tok] the token's sequence group
  std::span<const int32_t> tok_begin;   // [n_tok] first attended index into cells
  std::span<const int32_t> tok_end;     // [n_tok] one past the last
  std::span<const int32_t> group_reclaimed{};  // [n_groups] positions reclaimed before
                                               // the group's first listed cell
};

// Builds and caches the plans of one step; owned by CellCache.
class AttendPlanner {
 public:
  explicit AttendPlanner(int32_t n_policies);

  // Forgets the current step's lists and ranges (a new or invalidated step).
  void reset();
  // The plan for window `window` (policy index `policy`) of the placed step:
  // step_seqs/step_pos are the step's tokens, already stamped in `table`;
  // n_reclaimed[s] ([kMaxSequences]) the positions of s the pool reclaimed.
  AttendPlan plan(int32_t policy, Window window, const CellTable& table,
                  std::span<const int32_t> n_reclaimed, std::span<const seq_t> step_seqs,
                  std::span<const pos_t> step_pos);

 private:
  void build_lists(const CellTable& table, std::span<const int32_t> n_reclaimed,
                   std::span<const seq_t> step_seqs);
  void build_ranges(int32_t policy, Window window, std::span<const pos_t> step_pos);

  bool lists_built_ = false;
  std::vector<cell_t> cells_;         // [n_listed]
  std::vector<pos_t> cell_pos_;       // [n_listed] position of each listed cell
  std::vector<int32_t> group_begin_;  // [n_groups + 1]
  std::vector<int32_t> tok_group_;    // [n_tok]
  std::vector<int32_t> group_reclaimed_;  // [n_groups]
  std::vector<std::vector<int32_t>> tok_begin_;  // [n_policies][n_tok]
  std::vector<std::vector<int32_t>> tok_end_;    // [n_policies][n_tok]
  std::vector<uint8_t> ranges_built_;            // [n_policies]
  std::vector<std::pair<pos_t, cell_t>> sort_buf_;
};

}  // namespace cellcache
