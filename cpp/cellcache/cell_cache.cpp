#include "cellcache/cell_cache.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>

namespace cellcache {

using detail::error;
using detail::str;

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "Ok";
    case StatusCode::kUnknownSequence: return "UnknownSequence";
    case StatusCode::kPositionConflict: return "PositionConflict";
    case StatusCode::kStepNotDeclared: return "StepNotDeclared";
    case StatusCode::kStepInvalidated: return "StepInvalidated";
    case StatusCode::kLayerOutOfRange: return "LayerOutOfRange";
    case StatusCode::kInvalidConfig: return "InvalidConfig";
    case StatusCode::kCapacity: return "Capacity";
    case StatusCode::kUnknownCache: return "UnknownCache";
  }
  return "Unknown";
}

Status validate(const CacheConfig& config) {
  if (config.n_cells < 1 || config.n_cells > kMaxCells) {
    return error(StatusCode::kInvalidConfig, "n_cells must lie in [1, " + str(kMaxCells) +
                                                 "], got " + str(config.n_cells));
  }
  if (config.n_layers < 1 || config.n_layers > kMaxLayers) {
    return error(StatusCode::kInvalidConfig, "n_layers must lie in [1, " + str(kMaxLayers) +
                                                 "], got " + str(config.n_layers));
  }
  const auto n_windows = static_cast<int64_t>(config.windows.size());
  if (n_windows != 1 && n_windows != config.n_layers) {
    return error(StatusCode::kInvalidConfig,
                 "windows must have 1 entry or n_layers (" + str(config.n_layers) +
                     ") entries, got " + str(n_windows));
  }
  for (int64_t i = 0; i < n_windows; ++i) {
    const Window& w = config.windows[i];
    if (w.has_value() && *w < 1) {
      return error(StatusCode::kInvalidConfig, "window of entry " + str(i) +
                                                   " must be >= 1 or full causal, got " +
                                                   str(*w));
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<CellCache>> CellCache::create(const CacheConfig& config) {
  Status s = validate(config);
  if (!s.is_ok()) return s;
  return std::unique_ptr<CellCache>(new CellCache(config));
}

CellCache::CellCache(const CacheConfig& config)
    : table_(config.n_cells),
      seq_count_(kMaxSequences, 0),
      seq_max_pos_(kMaxSequences, -1),
      seq_serial_(kMaxSequences, 0),
      layer_served_(config.n_layers, 0) {
  for (int32_t l = 0; l < config.n_layers; ++l) {
    const Window& w = config.windows.size() == 1 ? config.windows[0] : config.windows[l];
    auto it = std::find(policies_.begin(), policies_.end(), w);
    if (it == policies_.end()) {
      policies_.push_back(w);
      it = policies_.end() - 1;
    }
    layer_policy_.push_back(static_cast<int32_t>(it - policies_.begin()));
  }
  policy_mask_.resize(policies_.size());
  policy_built_.assign(policies_.size(), 0);
}

// ---------------------------------------------------------------- checks

Status CellCache::check_live(seq_t seq) const {
  if (seq < 0 || seq >= kMaxSequences || !live_.test(seq)) {
    return error(StatusCode::kUnknownSequence,
                 "unknown sequence id " + str(seq) +
                     " (not handed out by seq_new/seq_clone, or already freed)");
  }
  return Status::ok();
}

Status CellCache::check_layer(int32_t layer) const {
  if (layer < 0 || layer >= n_layers()) {
    return error(StatusCode::kLayerOutOfRange,
                 "layer " + str(layer) + " is out of range [0, " + str(n_layers()) + ")");
  }
  return Status::ok();
}

Result<Window> CellCache::window(int32_t layer) const {
  Status s = check_layer(layer);
  if (!s.is_ok()) return s;
  return policies_[layer_policy_[layer]];
}

// ---------------------------------------------------------------- verbs

void CellCache::abandon_partial_step() {
  if (step_state_ != StepState::kDeclared || !step_placed_ || n_served_ == n_layers()) return;
  for (size_t i = 0; i < step_cells_.size(); ++i) {
    const cell_t c = step_cells_[i];
    if (table_.owned_by(c, step_seqs_[i]) && table_.pos(c) == step_pos_[i]) {
      table_.remove_owner(c, step_seqs_[i]);
    }
  }
  SeqSet rescanned;
  for (seq_t seq : step_seqs_) {
    if (rescanned.test(seq)) continue;  // one scan per sequence, not per token
    rescanned.set(seq);
    rescan_sequence(seq);
  }
}

void CellCache::invalidate_step() {
  abandon_partial_step();
  if (step_state_ == StepState::kDeclared) step_state_ = StepState::kInvalidated;
  std::fill(layer_served_.begin(), layer_served_.end(), 0);
  std::fill(policy_built_.begin(), policy_built_.end(), 0);
}

Result<seq_t> CellCache::lowest_unused_id() const {
  for (seq_t s = 0; s < kMaxSequences; ++s) {
    if (!live_.test(s)) return s;
  }
  return error(StatusCode::kCapacity, "all " + str(kMaxSequences) +
                                          " sequence ids are in use; free one first");
}

int32_t CellCache::n_sequences() const {
  int32_t n = 0;
  for (seq_t s = 0; s < kMaxSequences; ++s) n += live_.test(s) ? 1 : 0;
  return n;
}

Result<seq_t> CellCache::seq_new() {
  Result<seq_t> id = lowest_unused_id();
  if (!id.is_ok()) return id;
  invalidate_step();
  live_.set(id.value());
  seq_serial_[id.value()] = ++last_serial_;
  seq_count_[id.value()] = 0;
  seq_max_pos_[id.value()] = -1;
  return id;
}

Result<seq_t> CellCache::seq_clone(seq_t src, std::optional<pos_t> upto) {
  Status s = check_live(src);
  if (!s.is_ok()) return s;
  if (upto.has_value() && *upto < 0) {
    return error(StatusCode::kPositionConflict, "seq_clone upto must be >= 0, got " + str(*upto));
  }
  Result<seq_t> dst = seq_new();  // invalidates (and abandons a partial step) first
  if (!dst.is_ok()) return dst;
  const pos_t limit = upto.value_or(std::numeric_limits<pos_t>::max());
  for (cell_t c = 0; c < table_.used_end(); ++c) {
    if (table_.owned_by(c, src) && table_.pos(c) < limit) table_.add_owner(c, dst.value());
  }
  rescan_sequence(dst.value());
  return dst;
}

Status CellCache::seq_rm(seq_t seq, pos_t p0, std::optional<pos_t> p1) {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  if (p0 < 0) {
    return error(StatusCode::kPositionConflict, "seq_rm p0 must be >= 0, got " + str(p0));
  }
  if (p1.has_value() && *p1 < p0) {
    return error(StatusCode::kPositionConflict,
                 "seq_rm range [" + str(p0) + ", " + str(*p1) + ") goes backwards");
  }
  invalidate_step();
  const pos_t end = p1.value_or(std::numeric_limits<pos_t>::max());
  // Scan downwards: freeing the top cells shrinks used_end as we go.
  for (cell_t c = table_.used_end() - 1; c >= 0; --c) {
    const pos_t p = table_.pos(c);
    if (p >= p0 && p < end && table_.owned_by(c, seq)) table_.remove_owner(c, seq);
  }
  rescan_sequence(seq);
  return Status::ok();
}

Status CellCache::seq_free(seq_t seq) {
  Status s = seq_rm(seq, 0, std::nullopt);
  if (!s.is_ok()) return s;
  live_.reset(seq);
  return Status::ok();
}

void CellCache::clear() {
  invalidate_step();
  table_.clear();
  live_.clear();
  std::fill(seq_count_.begin(), seq_count_.end(), 0);
  std::fill(seq_max_pos_.begin(), seq_max_pos_.end(), -1);
}

void CellCache::rescan_sequence(seq_t seq) {
  int32_t count = 0;
  pos_t max_pos = -1;
  for (cell_t c = 0; c < table_.used_end(); ++c) {
    if (table_.owned_by(c, seq)) {
      ++count;
      max_pos = std::max(max_pos, table_.pos(c));
    }
  }
  seq_count_[seq] = count;
  seq_max_pos_[seq] = max_pos;
}

Result<pos_t> CellCache::next_pos(seq_t seq) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  return seq_max_pos_[seq] + 1;
}

Result<int32_t> CellCache::seq_len(seq_t seq) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  return seq_count_[seq];
}

Result<int32_t> CellCache::cells_owned_only_by(std::span<const seq_t> seqs) const {
  SeqSet set;
  for (seq_t seq : seqs) {
    Status s = check_live(seq);
    if (!s.is_ok()) return s;
    set.set(seq);
  }
  int32_t n = 0;
  for (cell_t c = 0; c < table_.used_end(); ++c) {
    if (!table_.is_empty(c) && table_.owners(c).subset_of(set)) ++n;
  }
  return n;
}

Result<uint64_t> CellCache::seq_serial(seq_t seq) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  return seq_serial_[seq];
}

// ---------------------------------------------------------------- steps

// ---------------------------------------------------------------- invariants

Status CellCache::check_invariants() const {
  Status s = table_.check_invariants();
  if (!s.is_ok()) return s;
  auto broken = [](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "cell cache invariant broken: " + what);
  };
  std::vector<int32_t> count(kMaxSequences, 0);
  std::vector<pos_t> max_pos(kMaxSequences, -1);
  std::vector<std::vector<pos_t>> held(kMaxSequences);
  for (cell_t c = 0; c < table_.size(); ++c) {
    if (table_.is_empty(c)) continue;
    for (seq_t q = 0; q < kMaxSequences; ++q) {
      if (!table_.owned_by(c, q)) continue;
      if (!live_.test(q)) return broken("cell " + str(c) + " owned by dead id " + str(q));
      ++count[q];
      max_pos[q] = std::max(max_pos[q], table_.pos(c));
      held[q].push_back(table_.pos(c));
    }
  }
  std::vector<uint64_t> serials;
  for (seq_t q = 0; q < kMaxSequences; ++q) {
    if (!live_.test(q)) continue;
    if (seq_serial_[q] == 0 || seq_serial_[q] > last_serial_) {
      return broken("serial of " + str(q));
    }
    serials.push_back(seq_serial_[q]);
    if (count[q] != seq_count_[q]) return broken("seq_len of " + str(q));
    if (max_pos[q] != seq_max_pos_[q]) return broken("next_pos of " + str(q));
    std::sort(held[q].begin(), held[q].end());
    if (std::adjacent_find(held[q].begin(), held[q].end()) != held[q].end()) {
      return broken("sequence " + str(q) + " owns two cells for one position");
    }
  }
  if (step_state_ == StepState::kDeclared) {
    if (step_cells_.size() != step_seqs_.size()) return broken("step cells/seqs sizes");
    std::vector<cell_t> cells(step_cells_.begin(), step_cells_.end());
    std::sort(cells.begin(), cells.end());
    if (std::adjacent_find(cells.begin(), cells.end()) != cells.end()) {
      return broken("a step chose one cell twice");
    }
    for (cell_t c : step_cells_) {
      if (c < 0 || c >= table_.size()) return broken("step cell out of range");
      if (!step_placed_ && !table_.is_empty(c)) return broken("chosen cell not empty");
    }
  }
  std::sort(serials.begin(), serials.end());
  if (std::adjacent_find(serials.begin(), serials.end()) != serials.end()) {
    return broken("two live ids share a serial");
  }
  if (written_end_ < table_.used_end()) return broken("written_end below used_end");
  int32_t served = 0;
  for (uint8_t v : layer_served_) served += v;
  if (step_state_ == StepState::kDeclared && served != n_served_) return broken("n_served");
  return Status::ok();
}

}  // namespace cellcache
