#include "cellcache/cell_pool.h"

#include <algorithm>
#include <limits>

namespace cellcache {

using detail::error;
using detail::str;

CellPool::CellPool(Window window, int32_t n_cells, bool reclaims, int32_t retained_margin,
                   int32_t n_policies)
    : window_(window),
      reclaims_(reclaims && window.has_value()),
      margin_(retained_margin),
      table_(n_cells),
      held_(kMaxSequences, 0),
      floor_(kMaxSequences, 0),
      n_reclaimed_(kMaxSequences, 0),
      cells_(reclaims_ ? kMaxSequences : 0),
      head_(reclaims_ ? kMaxSequences : 0, 0),
      planner_(n_policies) {}

std::span<const cell_t> CellPool::ordered(seq_t s) const {
  return std::span<const cell_t>(cells_[s]).subspan(head_[s]);
}

// Drops the given-up entries at the front once they are the larger half, so a
// sequence's list costs O(cells held) memory and each entry moves O(1) times
// on average.
void CellPool::compact(seq_t s) {
  std::vector<cell_t>& list = cells_[s];
  if (head_[s] < 64 || head_[s] * 2 < list.size()) return;
  list.erase(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(head_[s]));
  head_[s] = 0;
}

// ---------------------------------------------------------------- step

void CellPool::choose_cells(int32_t n_tok) {
  step_cells_.clear();
  table_.lowest_free(n_tok, step_cells_);
  planned_used_end_ = table_.used_end();
  for (cell_t c : step_cells_) planned_used_end_ = std::max(planned_used_end_, c + 1);
}

void CellPool::place(std::span<const seq_t> seqs, std::span<const pos_t> positions) {
  for (size_t i = 0; i < step_cells_.size(); ++i) {
    const seq_t s = seqs[i];
    table_.claim(step_cells_[i], positions[i], s);
    ++held_[s];
    // Positions only grow within a sequence, so appending keeps the order.
    if (reclaims_) cells_[s].push_back(step_cells_[i]);
  }
  step_used_end_ = table_.used_end();
  written_end_ = std::max(written_end_, table_.used_end());
}

void CellPool::unplace(std::span<const seq_t> seqs, std::span<const pos_t> positions) {
  // Backwards: each sequence's step tokens are the last entries of its list.
  for (size_t i = step_cells_.size(); i-- > 0;) {
    const cell_t c = step_cells_[i];
    const seq_t s = seqs[i];
    if (!table_.owned_by(c, s) || table_.pos(c) != positions[i]) continue;
    table_.remove_owner(c, s);
    --held_[s];
    if (!reclaims_) continue;
    std::vector<cell_t>& list = cells_[s];
    auto it = std::find(list.begin() + static_cast<std::ptrdiff_t>(head_[s]), list.end(), c);
    if (it != list.end()) list.erase(it);
  }
}

void CellPool::reclaim_after_step(seq_t s, pos_t first_pos, pos_t next_pos) {
  if (!reclaims_) return;
  const int64_t w = *window_;
  const int64_t floor = std::min<int64_t>(static_cast<int64_t>(next_pos) - w - margin_,
                                          static_cast<int64_t>(first_pos) - w + 1);
  const std::vector<cell_t>& list = cells_[s];
  size_t& head = head_[s];
  bool gave_up = false;
  while (head < list.size() && table_.pos(list[head]) < floor) {
    table_.remove_owner(list[head], s);
    --held_[s];
    ++n_reclaimed_[s];
    ++head;
    gave_up = true;
  }
  // floor > every given-up position >= the old floor, and floor < next_pos.
  if (gave_up) floor_[s] = static_cast<pos_t>(floor);
  compact(s);
}

// ---------------------------------------------------------------- verbs

void CellPool::clone(seq_t src, seq_t dst, pos_t limit) {
  if (reclaims_) {
    for (cell_t c : ordered(src)) {
      if (table_.pos(c) >= limit) break;
      table_.add_owner(c, dst);
      cells_[dst].push_back(c);
    }
    held_[dst] = static_cast<int32_t>(cells_[dst].size());
    // A clone that keeps any of src's held cells keeps every position src gave
    // up (check_keeps_window refused the others).
    if (held_[dst] > 0) {
      floor_[dst] = floor_[src];
      n_reclaimed_[dst] = n_reclaimed_[src];
    }
    return;
  }
  int32_t n = 0;
  for (cell_t c = 0; c < table_.used_end(); ++c) {
    if (table_.owned_by(c, src) && table_.pos(c) < limit) {
      table_.add_owner(c, dst);
      ++n;
    }
  }
  held_[dst] = n;
}

void CellPool::remove(seq_t s, pos_t p0, pos_t end) {
  if (reclaims_) {
    std::vector<cell_t>& list = cells_[s];
    size_t kept = 0;
    for (size_t i = head_[s]; i < list.size(); ++i) {
      const cell_t c = list[i];
      const pos_t p = table_.pos(c);
      if (p >= p0 && p < end) {
        table_.remove_owner(c, s);
        --held_[s];
      } else {
        list[kept++] = c;
      }
    }
    list.resize(kept);
    head_[s] = 0;
    // A range from 0 past the floor takes every given-up position with it.
    if (p0 == 0 && end >= floor_[s]) {
      floor_[s] = 0;
      n_reclaimed_[s] = 0;
    }
    return;
  }
  // Scan downwards: freeing the top cells shrinks used_end as we go.
  for (cell_t c = table_.used_end() - 1; c >= 0; --c) {
    const pos_t p = table_.pos(c);
    if (p >= p0 && p < end && table_.owned_by(c, s)) {
      table_.remove_owner(c, s);
      --held_[s];
    }
  }
}

void CellPool::clear() {
  table_.clear();
  std::fill(held_.begin(), held_.end(), 0);
  std::fill(floor_.begin(), floor_.end(), 0);
  std::fill(n_reclaimed_.begin(), n_reclaimed_.end(), 0);
  for (auto& list : cells_) list.clear();
  std::fill(head_.begin(), head_.end(), 0);
}

pos_t CellPool::max_pos(seq_t s) const {
  if (reclaims_) {
    const auto list = ordered(s);
    return list.empty() ? -1 : table_.pos(list.back());
  }
  pos_t max_pos = -1;
  for (cell_t c = 0; c < table_.used_end(); ++c) {
    if (table_.owned_by(c, s)) max_pos = std::max(max_pos, table_.pos(c));
  }
  return max_pos;
}

Status CellPool::check_keeps_window(seq_t s, int32_t pending, pos_t p0,
                                    std::optional<pos_t> p1, const std::string& what) const {
  if (!reclaims_ || n_reclaimed_[s] == 0) return Status::ok();
  auto list = ordered(s);
  list = list.first(list.size() - std::min<size_t>(list.size(), static_cast<size_t>(pending)));
  const pos_t floor = floor_[s];
  const int32_t w = *window_;
  const pos_t top = list.empty() ? -1 : table_.pos(list.back());
  const std::string held = what + ": the window-" + str(w) + " pool has reclaimed sequence " +
                           str(s) + "'s " + str(n_reclaimed_[s]) + " positions below " +
                           str(floor);
  if (p1.has_value() && *p1 <= top) {  // a middle range: next_pos stays
    if (p0 >= floor || (p0 == 0 && *p1 >= floor)) return Status::ok();
    return error(StatusCode::kBelowReclaimed,
                 held + "; a range starting below " + str(floor) +
                     " must start at 0 and reach " + str(floor));
  }
  if (p0 == 0) return Status::ok();  // the sequence empties: nothing left to see
  // The highest position kept below p0 (list is in position order, >= floor).
  auto it = std::partition_point(list.begin(), list.end(),
                                 [&](cell_t c) { return table_.pos(c) < p0; });
  const int64_t lowest_next = static_cast<int64_t>(floor) + std::max(1, w - 1);
  if (it != list.begin()) {
    const int64_t next = static_cast<int64_t>(table_.pos(*(it - 1))) + 1;
    if (next - w + 1 >= floor) return Status::ok();
  }
  return error(StatusCode::kBelowReclaimed,
               held + "; a query at the new next position could need them (keep the "
                      "sequence's next position >= " + str(lowest_next) +
                   ", or remove from position 0)");
}

// ---------------------------------------------------------------- invariants

Status CellPool::check_invariants(const SeqSet& live) const {
  Status s = table_.check_invariants();
  if (!s.is_ok()) return s;
  auto broken = [&](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "cell pool (window " +
                                                  (window_ ? str(*window_) : std::string("full")) +
                                                  ") invariant broken: " + what);
  };
  std::vector<int32_t> held(kMaxSequences, 0);
  for (cell_t c = 0; c < table_.size(); ++c) {
    if (table_.is_empty(c)) continue;
    for (seq_t q = 0; q < kMaxSequences; ++q) held[q] += table_.owned_by(c, q) ? 1 : 0;
  }
  for (seq_t q = 0; q < kMaxSequences; ++q) {
    if (held[q] != held_[q]) return broken("cells held by " + str(q));
    if ((n_reclaimed_[q] == 0) != (floor_[q] == 0)) return broken("floor of " + str(q));
    if (!live.test(q) && n_reclaimed_[q] != 0) return broken("dead id " + str(q) + " reclaimed");
    if (!reclaims_) {
      if (n_reclaimed_[q] != 0) return broken("a pool that does not reclaim reclaimed");
      continue;
    }
    const auto list = ordered(q);
    if (static_cast<int32_t>(list.size()) != held_[q]) return broken("list size of " + str(q));
    pos_t prev = -1;
    for (cell_t c : list) {
      if (c < 0 || c >= table_.size() || !table_.owned_by(c, q)) {
        return broken("list of " + str(q) + " names a cell it does not own");
      }
      if (table_.pos(c) <= prev) return broken("list of " + str(q) + " out of position order");
      if (table_.pos(c) < floor_[q]) return broken("sequence " + str(q) + " holds below floor");
      prev = table_.pos(c);
    }
    if (n_reclaimed_[q] > 0 && list.empty()) {
      return broken("sequence " + str(q) + " reclaimed positions but holds none");
    }
  }
  if (written_end_ < table_.used_end()) return broken("written_end below used_end");
  return Status::ok();
}

}  // namespace cellcache
