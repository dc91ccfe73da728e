// CellPool: one pool of cells of a CellCache (cell_cache.h), with what each
// sequence holds in it and, in a windowed pool that reclaims, what it gave up.
//
// A cache holds one pool (every layer shares it, no reclaim: the default) or,
// when configured with window pools, one pool per distinct window policy of its
// layers (llama.cpp's iSWA keeps a second, window-sized cache for its sliding
// layers; vLLM's hybrid KV cache manager one block pool group per attention
// type). Every step places each token once in every pool; a layer reads the
// cells of its own pool, so a layer's K/V buffers are [capacity of its pool,
// n_kv_heads, head_dim].
//
// Reclaim (windowed pools of a pooled cache only). A pool of window W with
// retained rollback margin R lets a sequence s give up its cells below its
// floor: when a step completes (every layer served), for each of its
// sequences the floor becomes
//     max(floor, min(next_pos(s) - W - R, p_first(s) - W + 1))
// (p_first(s) = the step's first position of s; the second term keeps every
// cell the completed step's own tokens may see, so that the step's last layer
// and a rollback of the whole step stay exact whatever R is), and s stops
// owning its cells below it, oldest first, in O(cells given up). A cell is
// free once its last owner gave it up: its position lies below every owner's
// floor, i.e. below min over owners of (next_pos - W - R) when R covers a
// step's tokens. No query of any owner can see such a cell (a query at
// p >= next_pos sees positions > p - W), so reclaim never changes a mask.
// Reclaim runs as a step completes rather than lazily when a later step
// needs room: the free cells a scheduler reads, how deep a rollback may go
// and the plan's anchor then depend on each sequence's own history, never on
// how full the pool happened to be, for the same O(cells given up).
//
// Per sequence the pool then holds exactly the sequence's positions at or
// above its floor (`floor`, 0 when it gave up none) and counts the positions
// it gave up (`n_reclaimed`). A verb that would need a given-up position back
// is refused with kBelowReclaimed (see check_keeps_window).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cellcache/attend_plan.h"
#include "cellcache/cell_table.h"
#include "cellcache/status.h"
#include "cellcache/window.h"

namespace cellcache {

// What a pool gave up of one sequence.
struct Reclaimed {
  pos_t below = 0;    // the sequence's positions < below were given up (0: none)
  int32_t count = 0;  // how many positions that was
};

class CellPool {
 public:
  // n_cells >= 1; reclaims only when `window` is a sliding window and the
  // cache is pooled (validated by CellCache::create).
  CellPool(Window window, int32_t n_cells, bool reclaims, int32_t retained_margin,
           int32_t n_policies);

  Window window() const { return window_; }
  bool reclaims() const { return reclaims_; }
  const CellTable& table() const { return table_; }
  int32_t capacity() const { return table_.size(); }
  int32_t free_cells() const { return table_.free_count(); }
  cell_t used_end() const { return table_.used_end(); }
  cell_t written_end() const { return written_end_; }
  cell_t planned_used_end() const { return planned_used_end_; }
  // used_end when the current step placed: the row length of its masks.
  cell_t step_used_end() const { return step_used_end_; }
  std::span<const cell_t> step_cells() const { return step_cells_; }
  int32_t held(seq_t s) const { return held_[s]; }
  Reclaimed reclaimed(seq_t s) const { return {floor_[s], n_reclaimed_[s]}; }
  AttendPlanner& planner() { return planner_; }
  std::span<const int32_t> n_reclaimed() const { return n_reclaimed_; }

  // ---- step (the caller checked admission and positions) ----
  // Chooses the n_tok lowest free cells for the declared step (n_tok <= free).
  void choose_cells(int32_t n_tok);
  // Stamps the chosen cells with the step's positions and owners.
  void place(std::span<const seq_t> seqs, std::span<const pos_t> positions);
  // Removes a placed step's tokens again (a step abandoned part-way).
  void unplace(std::span<const seq_t> seqs, std::span<const pos_t> positions);
  // The reclaim of a completed step for sequence s, whose first position in
  // the step was first_pos and whose next position is now next_pos: raises
  // its floor by the rule above and gives up its cells below the floor, in
  // O(cells given up). No-op unless reclaims().
  void reclaim_after_step(seq_t s, pos_t first_pos, pos_t next_pos);

  // ---- sequence verbs (the caller checked ids and check_keeps_window) ----
  // dst (holding nothing) comes to own src's cells with position < limit.
  void clone(seq_t src, seq_t dst, pos_t limit);
  // s stops owning its cells with position in [p0, end).
  void remove(seq_t s, pos_t p0, pos_t end);
  void clear();
  // Highest position s holds here, -1 when none.
  pos_t max_pos(seq_t s) const;

  // kBelowReclaimed when s, ignoring its last `pending` cells (a step placed
  // but not finished, which the verb abandons first), cannot give up its
  // positions in [p0, p1) (p1 = nullopt: to the end) and stay exact:
  //  - a tail (p1 past its highest position) is refused unless p0 == 0 or s
  //    keeps a position in [floor, p0) and its new next position n' has
  //    n' - W + 1 >= floor (a query at n' sees nothing the pool gave up);
  //  - a middle range is refused when it starts in (0, floor) (the pool no
  //    longer knows which of those positions s held).
  // Always ok when the pool gave up none of s. `what` starts the message
  // ("seq_rm of sequence 3 from position 5").
  Status check_keeps_window(seq_t s, int32_t pending, pos_t p0, std::optional<pos_t> p1,
                            const std::string& what) const;

  // Recomputes the per-sequence state from the cells and compares; `live`
  // are the live ids. Ok or kInvalidConfig naming the broken invariant.
  Status check_invariants(const SeqSet& live) const;

 private:
  // s's cells in position order (reclaiming pools only): cells_[s][head_[s]..].
  std::span<const cell_t> ordered(seq_t s) const;
  void compact(seq_t s);

  Window window_;
  bool reclaims_;
  int32_t margin_;
  CellTable table_;
  std::vector<int32_t> held_;         // [kMaxSequences] cells each sequence owns here
  std::vector<pos_t> floor_;          // [kMaxSequences] positions below given up
  std::vector<int32_t> n_reclaimed_;  // [kMaxSequences] how many were given up
  // [kMaxSequences] (reclaiming pools) each sequence's cells, position order.
  std::vector<std::vector<cell_t>> cells_;
  std::vector<size_t> head_;          // [kMaxSequences] first live entry of cells_
  std::vector<cell_t> step_cells_;    // [n_tok] chosen at declare, stamped at place
  cell_t planned_used_end_ = 0;
  cell_t step_used_end_ = 0;
  cell_t written_end_ = 0;
  AttendPlanner planner_;
};

}  // namespace cellcache
