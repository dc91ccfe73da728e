// The cell table: a pool of n_cells KV-cache cells, each holding one token.
//
// A cell holds `pos` (the token position stored there, -1 = empty) and
// `owners` (the set of sequence ids that own it). A cell is empty iff it has no
// owner; it frees itself when its last owner leaves (llama.cpp seq_cp/seq_rm
// semantics, vLLM block refcounts). Cells are addressed absolutely; nothing
// here knows about steps, windows or masks (cell_cache.h does).
//
// Derived state (free bitmap, free count, used_end) is updated by the
// mutators below and recomputed from scratch by check_invariants().
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "cellcache/status.h"
#include "cellcache/window.h"

namespace cellcache {

using cell_t = int32_t;  // absolute cell index in [0, n_cells)
using seq_t = int32_t;   // sequence id in [0, kMaxSequences)

constexpr int32_t kMaxSequences = 256;

// A fixed-size bitset of sequence ids; operator[] style access, no bounds
// checks (callers validate ids at the API edge).
class SeqSet {
 public:
  bool test(seq_t s) const { return (words_[s >> 6] >> (s & 63)) & 1u; }
  void set(seq_t s) { words_[s >> 6] |= uint64_t{1} << (s & 63); }
  void reset(seq_t s) { words_[s >> 6] &= ~(uint64_t{1} << (s & 63)); }
  bool none() const {
    for (uint64_t w : words_) {
      if (w != 0) return false;
    }
    return true;
  }
  void clear() { words_.fill(0); }
  // Every member of this set is in `other`.
  bool subset_of(const SeqSet& other) const {
    for (size_t i = 0; i < words_.size(); ++i) {
      if ((words_[i] & ~other.words_[i]) != 0) return false;
    }
    return true;
  }

 private:
  std::array<uint64_t, kMaxSequences / 64> words_{};
};

class CellTable {
 public:
  // n_cells >= 1 (validated by CellCache::create).
  explicit CellTable(int32_t n_cells);

  int32_t size() const { return static_cast<int32_t>(pos_.size()); }
  pos_t pos(cell_t c) const { return pos_[c]; }
  bool owned_by(cell_t c, seq_t s) const { return owners_[c].test(s); }
  const SeqSet& owners(cell_t c) const { return owners_[c]; }
  bool is_empty(cell_t c) const { return pos_[c] < 0; }

  // [n_cells] the position held by each cell, -1 = empty.
  const std::vector<pos_t>& positions() const { return pos_; }
  int32_t free_count() const { return free_count_; }
  // One past the highest occupied cell index; 0 when every cell is empty.
  cell_t used_end() const { return used_end_; }

  // Appends the `n` lowest-indexed empty cells to `out`, scanning the free
  // bitmap from the lowest free word (cost O(n + words scanned)). Lowest-first
  // keeps used_end, and with it the attention extent, small.
  // Precondition: n <= free_count() (checked by the caller's admission gate).
  void lowest_free(int32_t n, std::vector<cell_t>& out) const;

  // Empty cell `c` now holds position `p` owned by `s` alone.
  void claim(cell_t c, pos_t p, seq_t s);
  // Non-empty cell `c` gains owner `s` (a fork sharing the cell).
  void add_owner(cell_t c, seq_t s);
  // `s` leaves cell `c`; the cell empties when its last owner leaves.
  void remove_owner(cell_t c, seq_t s);
  void clear();

  // Recomputes the derived state from pos/owners and compares; also checks
  // that a cell is empty iff it has no owner. Ok or kInvalidConfig naming
  // the first broken invariant (tests only; O(n_cells)).
  Status check_invariants() const;

 private:
  void mark_free(cell_t c);
  void mark_used(cell_t c);

  std::vector<pos_t> pos_;     // [n_cells] position held, -1 = empty
  std::vector<SeqSet> owners_; // [n_cells] owning sequences, none() iff empty

  // Derived from pos_: bit c of free_bits_ is set iff cell c is empty.
  std::vector<uint64_t> free_bits_;
  int32_t free_count_ = 0;
  cell_t used_end_ = 0;
  // Lower bound on the index of the first word with a free bit.
  int32_t first_free_word_ = 0;
};

}  // namespace cellcache
