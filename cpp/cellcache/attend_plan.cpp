#include "cellcache/attend_plan.h"

#include <algorithm>
#include <array>
#include <limits>

namespace cellcache {

AttendPlanner::AttendPlanner(int32_t n_policies)
    : tok_begin_(n_policies), tok_end_(n_policies), ranges_built_(n_policies, 0) {}

void AttendPlanner::reset() {
  lists_built_ = false;
  std::fill(ranges_built_.begin(), ranges_built_.end(), 0);
}

void AttendPlanner::build_lists(const CellTable& table, std::span<const int32_t> n_reclaimed,
                                std::span<const seq_t> step_seqs) {
  // Group index of each sequence of the step, in order of first appearance.
  std::array<int32_t, kMaxSequences> group;
  group.fill(-1);
  SeqSet in_step;
  int32_t n_groups = 0;
  tok_group_.resize(step_seqs.size());
  group_reclaimed_.clear();
  for (size_t i = 0; i < step_seqs.size(); ++i) {
    const seq_t s = step_seqs[i];
    if (group[s] < 0) {
      group[s] = n_groups++;
      in_step.set(s);
      group_reclaimed_.push_back(n_reclaimed[s]);
    }
    tok_group_[i] = group[s];
  }
  // Two passes over the occupied cells: count per group, then fill. A cell
  // shared by several sequences of the step is listed once per sequence.
  group_begin_.assign(static_cast<size_t>(n_groups) + 1, 0);
  const cell_t end = table.used_end();
  auto for_each_owner = [&](cell_t c, auto&& fn) {
    const SeqSet& owners = table.owners(c);
    for (int32_t w = 0; w < SeqSet::kWords; ++w) {
      uint64_t bits = owners.word(w) & in_step.word(w);
      while (bits != 0) {
        fn(group[w * 64 + __builtin_ctzll(bits)]);
        bits &= bits - 1;
      }
    }
  };
  for (cell_t c = 0; c < end; ++c) {
    if (!table.is_empty(c)) for_each_owner(c, [&](int32_t g) { ++group_begin_[g + 1]; });
  }
  for (int32_t g = 0; g < n_groups; ++g) group_begin_[g + 1] += group_begin_[g];
  const int32_t n_listed = group_begin_[n_groups];
  cells_.resize(n_listed);
  cell_pos_.resize(n_listed);
  std::vector<int32_t> fill(group_begin_.begin(), group_begin_.end() - 1);
  for (cell_t c = 0; c < end; ++c) {
    if (table.is_empty(c)) continue;
    for_each_owner(c, [&](int32_t g) {
      cells_[fill[g]] = c;
      cell_pos_[fill[g]] = table.pos(c);
      ++fill[g];
    });
  }
  // Lowest-free placement usually leaves a sequence's cells in position
  // order already; holes refilled later do not.
  for (int32_t g = 0; g < n_groups; ++g) {
    const int32_t b = group_begin_[g], e = group_begin_[g + 1];
    if (std::is_sorted(cell_pos_.begin() + b, cell_pos_.begin() + e)) continue;
    sort_buf_.clear();
    for (int32_t j = b; j < e; ++j) sort_buf_.emplace_back(cell_pos_[j], cells_[j]);
    std::sort(sort_buf_.begin(), sort_buf_.end());
    for (int32_t j = b; j < e; ++j) {
      cell_pos_[j] = sort_buf_[j - b].first;
      cells_[j] = sort_buf_[j - b].second;
    }
  }
  lists_built_ = true;
}

void AttendPlanner::build_ranges(int32_t policy, Window window,
                                 std::span<const pos_t> step_pos) {
  std::vector<int32_t>& begin = tok_begin_[policy];
  std::vector<int32_t>& end = tok_end_[policy];
  begin.resize(step_pos.size());
  end.resize(step_pos.size());
  for (size_t i = 0; i < step_pos.size(); ++i) {
    const int32_t g = tok_group_[i];
    const auto first = cell_pos_.begin() + group_begin_[g];
    const auto last = cell_pos_.begin() + group_begin_[g + 1];
    const pos_t p = step_pos[i];
    // window_sees: key position k with k <= p and p - k < W, i.e. k >= p - W + 1.
    const auto hi = std::upper_bound(first, last, p);
    auto lo = first;
    if (window.has_value()) {
      const int64_t lowest = static_cast<int64_t>(p) - *window + 1;
      if (lowest > 0) lo = std::lower_bound(first, hi, static_cast<pos_t>(lowest));
    }
    begin[i] = static_cast<int32_t>(lo - cell_pos_.begin());
    end[i] = static_cast<int32_t>(hi - cell_pos_.begin());
  }
  ranges_built_[policy] = 1;
}

AttendPlan AttendPlanner::plan(int32_t policy, Window window, const CellTable& table,
                               std::span<const int32_t> n_reclaimed,
                               std::span<const seq_t> step_seqs,
                               std::span<const pos_t> step_pos) {
  if (!lists_built_) build_lists(table, n_reclaimed, step_seqs);
  if (!ranges_built_[policy]) build_ranges(policy, window, step_pos);
  return AttendPlan{cells_,          group_begin_,      tok_group_,
                    tok_begin_[policy], tok_end_[policy], group_reclaimed_};
}

}  // namespace cellcache
