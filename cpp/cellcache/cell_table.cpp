#include "cellcache/cell_table.h"

#include <algorithm>
#include <string>

namespace cellcache {

namespace {
constexpr int32_t kWordBits = 64;
}  // namespace

CellTable::CellTable(int32_t n_cells)
    : pos_(n_cells, -1),
      owners_(n_cells),
      free_bits_((n_cells + kWordBits - 1) / kWordBits, 0) {
  clear();
}

void CellTable::clear() {
  const int32_t n = size();
  std::fill(pos_.begin(), pos_.end(), -1);
  for (SeqSet& o : owners_) o.clear();
  std::fill(free_bits_.begin(), free_bits_.end(), ~uint64_t{0});
  // Bits past n_cells in the last word stay clear so they are never handed out.
  if (n % kWordBits != 0) free_bits_.back() = (uint64_t{1} << (n % kWordBits)) - 1;
  free_count_ = n;
  used_end_ = 0;
  first_free_word_ = 0;
}

void CellTable::lowest_free(int32_t n, std::vector<cell_t>& out) const {
  const int32_t n_words = static_cast<int32_t>(free_bits_.size());
  for (int32_t w = first_free_word_; w < n_words && n > 0; ++w) {
    uint64_t bits = free_bits_[w];
    while (bits != 0 && n > 0) {
      const int bit = __builtin_ctzll(bits);
      out.push_back(w * kWordBits + bit);
      bits &= bits - 1;
      --n;
    }
  }
}

void CellTable::mark_used(cell_t c) {
  const int32_t w = c / kWordBits;
  free_bits_[w] &= ~(uint64_t{1} << (c % kWordBits));
  --free_count_;
  if (c + 1 > used_end_) used_end_ = c + 1;
  while (first_free_word_ < static_cast<int32_t>(free_bits_.size()) &&
         free_bits_[first_free_word_] == 0) {
    ++first_free_word_;
  }
}

void CellTable::mark_free(cell_t c) {
  const int32_t w = c / kWordBits;
  free_bits_[w] |= uint64_t{1} << (c % kWordBits);
  ++free_count_;
  if (w < first_free_word_) first_free_word_ = w;
  while (used_end_ > 0 && pos_[used_end_ - 1] < 0) --used_end_;
}

void CellTable::claim(cell_t c, pos_t p, seq_t s) {
  pos_[c] = p;
  owners_[c].set(s);
  mark_used(c);
}

void CellTable::add_owner(cell_t c, seq_t s) { owners_[c].set(s); }

void CellTable::remove_owner(cell_t c, seq_t s) {
  owners_[c].reset(s);
  if (owners_[c].none()) {
    pos_[c] = -1;
    mark_free(c);
  }
}

Status CellTable::check_invariants() const {
  auto broken = [](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "cell table invariant broken: " + what);
  };
  int32_t n_free = 0;
  cell_t end = 0;
  for (cell_t c = 0; c < size(); ++c) {
    const bool empty = pos_[c] < 0;
    if (pos_[c] < -1) return broken("cell " + std::to_string(c) + " has pos < -1");
    if (empty != owners_[c].none()) {
      return broken("cell " + std::to_string(c) + " empty/owner mismatch");
    }
    const bool bit = (free_bits_[c / kWordBits] >> (c % kWordBits)) & 1u;
    if (bit != empty) return broken("free bit of cell " + std::to_string(c));
    if (empty) {
      ++n_free;
    } else {
      end = c + 1;
    }
  }
  if (size() % kWordBits != 0 && (free_bits_.back() >> (size() % kWordBits)) != 0) {
    return broken("free bits set past n_cells");
  }
  if (n_free != free_count_) return broken("free_count");
  if (end != used_end_) return broken("used_end");
  for (int32_t w = 0; w < first_free_word_; ++w) {
    if (free_bits_[w] != 0) return broken("first_free_word skips a free cell");
  }
  return Status::ok();
}

}  // namespace cellcache
