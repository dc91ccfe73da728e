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
    case StatusCode::kBelowReclaimed: return "BelowReclaimed";
  }
  return "Unknown";
}

namespace {

Status validate_window_pools(const CacheConfig& config) {
  const int64_t margin = config.retained_margin;  // in range: validate checked it
  auto in_layers = [&](int32_t w) {
    return std::find(config.windows.begin(), config.windows.end(), Window(w)) !=
           config.windows.end();
  };
  for (size_t i = 0; i < config.window_pools.size(); ++i) {
    const WindowPool& p = config.window_pools[i];
    const std::string what = "window_cells for window " + str(p.window);
    if (!in_layers(p.window)) {
      return error(StatusCode::kInvalidConfig,
                   what + ": no layer has that window (windows must name it), got " +
                       str(p.n_cells) + " cells for it");
    }
    for (size_t j = 0; j < i; ++j) {
      if (config.window_pools[j].window == p.window) {
        return error(StatusCode::kInvalidConfig, what + " given twice, got " +
                                                     str(config.window_pools[j].n_cells) +
                                                     " and " + str(p.n_cells));
      }
    }
    const int64_t least = static_cast<int64_t>(p.window) + margin + 1;
    if (p.n_cells < least || p.n_cells > kMaxCells) {
      return error(StatusCode::kInvalidConfig,
                   what + " must lie in [" + str(least) + ", " + str(kMaxCells) +
                       "] (one sequence's window " + str(p.window) + " + retained_margin " +
                       str(margin) + " + one new token), got " + str(p.n_cells));
    }
  }
  for (const Window& w : config.windows) {
    if (!w.has_value()) continue;
    auto named = [&](const WindowPool& p) { return p.window == *w; };
    if (std::none_of(config.window_pools.begin(), config.window_pools.end(), named)) {
      return error(StatusCode::kInvalidConfig,
                   "window_cells must size the pool of every sliding window of the layers; "
                   "window " + str(*w) + " has none, got " +
                       str(static_cast<int64_t>(config.window_pools.size())) + " pools");
    }
  }
  return Status::ok();
}

}  // namespace

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
  if (config.retained_margin < 0 || config.retained_margin > kMaxCells) {
    return error(StatusCode::kInvalidConfig, "retained_margin must lie in [0, " +
                                                 str(kMaxCells) + "], got " +
                                                 str(config.retained_margin));
  }
  if (config.window_pools.empty()) return Status::ok();
  return validate_window_pools(config);
}

Result<std::unique_ptr<CellCache>> CellCache::create(const CacheConfig& config) {
  Status s = validate(config);
  if (!s.is_ok()) return s;
  return std::unique_ptr<CellCache>(new CellCache(config));
}

CellCache::CellCache(const CacheConfig& config)
    : retained_margin_(config.retained_margin),
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
  const auto n_policies = static_cast<int32_t>(policies_.size());
  const bool pooled = !config.window_pools.empty();
  if (!pooled) {
    const Window shared = n_policies == 1 ? policies_[0] : std::nullopt;
    pools_.emplace_back(shared, config.n_cells, false, retained_margin_, n_policies);
    policy_pool_.assign(policies_.size(), 0);
  } else {
    for (int32_t p = 0; p < n_policies; ++p) {
      int32_t n_cells = config.n_cells;
      for (const WindowPool& wp : config.window_pools) {
        if (Window(wp.window) == policies_[p]) n_cells = wp.n_cells;
      }
      pools_.emplace_back(policies_[p], n_cells, true, retained_margin_, n_policies);
      policy_pool_.push_back(p);
    }
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

Status CellCache::check_pool(int32_t pool) const {
  if (pool < 0 || pool >= n_pools()) {
    return error(StatusCode::kInvalidConfig,
                 "pool " + str(pool) + " is out of range [0, " + str(n_pools()) + "), got " +
                     str(pool));
  }
  return Status::ok();
}

Result<Window> CellCache::window(int32_t layer) const {
  Status s = check_layer(layer);
  if (!s.is_ok()) return s;
  return policies_[layer_policy_[layer]];
}

Result<int32_t> CellCache::pool_of(int32_t layer) const {
  Status s = check_layer(layer);
  if (!s.is_ok()) return s;
  return policy_pool_[layer_policy_[layer]];
}

Result<PoolState> CellCache::pool_state(int32_t pool) const {
  Status s = check_pool(pool);
  if (!s.is_ok()) return s;
  const CellPool& p = pools_[pool];
  return PoolState{p.window(),     p.reclaims(),         p.capacity(),
                   p.free_cells(), p.used_end(),         p.written_end(),
                   p.planned_used_end(), p.table().positions(), p.step_cells()};
}

Result<Reclaimed> CellCache::reclaimed(seq_t seq, int32_t pool) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  s = check_pool(pool);
  if (!s.is_ok()) return s;
  return pools_[pool].reclaimed(seq);
}

bool CellCache::can_extend(int32_t n_tok) const {
  if (n_tok < 0) return false;
  for (const CellPool& p : pools_) {
    if (n_tok > p.free_cells()) return false;
  }
  return true;
}

int32_t CellCache::pending_tokens(seq_t seq) const {
  if (step_state_ != StepState::kDeclared || !step_placed_ || n_served_ == n_layers()) return 0;
  return static_cast<int32_t>(std::count(step_seqs_.begin(), step_seqs_.end(), seq));
}

Status CellCache::check_keeps_windows(seq_t seq, pos_t p0, std::optional<pos_t> p1,
                                      const std::string& what) const {
  const int32_t pending = pending_tokens(seq);
  for (const CellPool& p : pools_) {
    Status s = p.check_keeps_window(seq, pending, p0, p1, what);
    if (!s.is_ok()) return s;
  }
  return Status::ok();
}

// ---------------------------------------------------------------- verbs

void CellCache::abandon_partial_step() {
  if (step_state_ != StepState::kDeclared || !step_placed_ || n_served_ == n_layers()) return;
  for (CellPool& p : pools_) p.unplace(step_seqs_, step_pos_);
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
  for (CellPool& p : pools_) p.planner().reset();
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
  seq_max_pos_[id.value()] = -1;
  return id;
}

Result<seq_t> CellCache::seq_clone(seq_t src, std::optional<pos_t> upto) {
  Status s = check_live(src);
  if (!s.is_ok()) return s;
  if (upto.has_value() && *upto < 0) {
    return error(StatusCode::kPositionConflict, "seq_clone upto must be >= 0, got " + str(*upto));
  }
  if (upto.has_value()) {
    s = check_keeps_windows(src, *upto, std::nullopt,
                            "seq_clone of sequence " + str(src) + " upto " + str(*upto));
    if (!s.is_ok()) return s;
  }
  Result<seq_t> dst = seq_new();  // invalidates (and abandons a partial step) first
  if (!dst.is_ok()) return dst;
  const pos_t limit = upto.value_or(std::numeric_limits<pos_t>::max());
  for (CellPool& p : pools_) p.clone(src, dst.value(), limit);
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
  if (!(p1.has_value() && *p1 == p0)) {  // an empty range removes nothing: never refused
    s = check_keeps_windows(seq, p0, p1,
                            "seq_rm of sequence " + str(seq) + " from position " + str(p0));
    if (!s.is_ok()) return s;
  }
  invalidate_step();
  const pos_t end = p1.value_or(std::numeric_limits<pos_t>::max());
  for (CellPool& p : pools_) p.remove(seq, p0, end);
  rescan_sequence(seq);
  return Status::ok();
}

Status CellCache::seq_free(seq_t seq) {
  Status s = seq_rm(seq, 0, std::nullopt);  // from 0: never below a pool's floor
  if (!s.is_ok()) return s;
  live_.reset(seq);
  return Status::ok();
}

void CellCache::clear() {
  invalidate_step();
  for (CellPool& p : pools_) p.clear();
  live_.clear();
  std::fill(seq_max_pos_.begin(), seq_max_pos_.end(), -1);
}

void CellCache::rescan_sequence(seq_t seq) { seq_max_pos_[seq] = pools_[0].max_pos(seq); }

Result<pos_t> CellCache::next_pos(seq_t seq) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  return seq_max_pos_[seq] + 1;
}

Result<int32_t> CellCache::seq_len(seq_t seq) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  return pools_[0].held(seq) + pools_[0].reclaimed(seq).count;
}

Result<bool> CellCache::holds_prefix(seq_t seq, pos_t upto) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  if (upto < 0) {
    return error(StatusCode::kPositionConflict, "holds_prefix upto must be >= 0, got " + str(upto));
  }
  return check_keeps_windows(seq, upto, std::nullopt, "holds_prefix").is_ok();
}

Result<int32_t> CellCache::cells_owned_only_by(std::span<const seq_t> seqs,
                                               int32_t pool) const {
  SeqSet set;
  for (seq_t seq : seqs) {
    Status s = check_live(seq);
    if (!s.is_ok()) return s;
    set.set(seq);
  }
  Status s = check_pool(pool);
  if (!s.is_ok()) return s;
  const CellTable& table = pools_[pool].table();
  int32_t n = 0;
  for (cell_t c = 0; c < table.used_end(); ++c) {
    if (!table.is_empty(c) && table.owners(c).subset_of(set)) ++n;
  }
  return n;
}

Result<uint64_t> CellCache::seq_serial(seq_t seq) const {
  Status s = check_live(seq);
  if (!s.is_ok()) return s;
  return seq_serial_[seq];
}

// ---------------------------------------------------------------- invariants

// Every pool holds seq's positions at or above its floor, and they agree on
// its next position and on its length (held + reclaimed).
Status CellCache::check_pools_agree(seq_t seq) const {
  auto broken = [&](const std::string& what) {
    return Status(StatusCode::kInvalidConfig,
                  "cell cache invariant broken: pools disagree on sequence " + str(seq) + ": " +
                      what);
  };
  std::vector<std::vector<pos_t>> held(pools_.size());
  for (size_t i = 0; i < pools_.size(); ++i) {
    const CellTable& t = pools_[i].table();
    for (cell_t c = 0; c < t.size(); ++c) {
      if (!t.is_empty(c) && t.owned_by(c, seq)) held[i].push_back(t.pos(c));
    }
    std::sort(held[i].begin(), held[i].end());
    if (std::adjacent_find(held[i].begin(), held[i].end()) != held[i].end()) {
      return broken("it owns two cells for one position");
    }
    const pos_t top = held[i].empty() ? -1 : held[i].back();
    if (top != seq_max_pos_[seq]) return broken("next_pos in pool " + str(i));
    const int32_t len = pools_[i].held(seq) + pools_[i].reclaimed(seq).count;
    if (len != pools_[0].held(seq) + pools_[0].reclaimed(seq).count) {
      return broken("seq_len in pool " + str(i));
    }
  }
  // The union of what the pools hold is what the sequence holds at or above
  // the lowest floor; each pool holds exactly the part above its own floor.
  std::vector<pos_t> all;
  for (const auto& h : held) all.insert(all.end(), h.begin(), h.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  for (size_t i = 0; i < pools_.size(); ++i) {
    const pos_t floor = pools_[i].reclaimed(seq).below;
    std::vector<pos_t> want;
    for (pos_t p : all) {
      if (p >= floor) want.push_back(p);
    }
    if (want != held[i]) return broken("pool " + str(i) + " lost a position above its floor");
  }
  return Status::ok();
}

// A windowed pool keeps what a query of seq at its next position sees (once a
// partly served step is set aside: it raised next_pos only for now).
Status CellCache::check_window_kept(seq_t seq) const {
  const auto pending = static_cast<size_t>(pending_tokens(seq));
  for (const CellPool& p : pools_) {
    const Reclaimed r = p.reclaimed(seq);
    if (r.count == 0) continue;
    std::vector<pos_t> mine;
    const CellTable& t = p.table();
    for (cell_t c = 0; c < t.size(); ++c) {
      if (!t.is_empty(c) && t.owned_by(c, seq)) mine.push_back(t.pos(c));
    }
    std::sort(mine.begin(), mine.end());
    if (pending >= mine.size() || int64_t{mine[mine.size() - pending - 1]} + 1 -
                                          *p.window() + 1 < r.below) {
      return Status(StatusCode::kInvalidConfig,
                    "cell cache invariant broken: sequence " + str(seq) +
                        " needs positions its window-" + str(*p.window()) +
                        " pool reclaimed");
    }
  }
  return Status::ok();
}

Status CellCache::check_invariants() const {
  auto broken = [](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "cell cache invariant broken: " + what);
  };
  for (const CellPool& p : pools_) {
    Status s = p.check_invariants(live_);
    if (!s.is_ok()) return s;
    const CellTable& t = p.table();
    for (cell_t c = 0; c < t.size(); ++c) {
      if (t.is_empty(c)) continue;
      for (seq_t q = 0; q < kMaxSequences; ++q) {
        if (t.owned_by(c, q) && !live_.test(q)) {
          return broken("cell " + str(c) + " owned by dead id " + str(q));
        }
      }
    }
  }
  std::vector<uint64_t> serials;
  for (seq_t q = 0; q < kMaxSequences; ++q) {
    if (!live_.test(q)) continue;
    if (seq_serial_[q] == 0 || seq_serial_[q] > last_serial_) {
      return broken("serial of " + str(q));
    }
    serials.push_back(seq_serial_[q]);
    Status s = check_pools_agree(q);
    if (!s.is_ok()) return s;
    s = check_window_kept(q);
    if (!s.is_ok()) return s;
  }
  if (step_state_ == StepState::kDeclared) {
    for (const CellPool& p : pools_) {
      const auto step_cells = p.step_cells();
      if (step_cells.size() != step_seqs_.size()) return broken("step cells/seqs sizes");
      std::vector<cell_t> cells(step_cells.begin(), step_cells.end());
      std::sort(cells.begin(), cells.end());
      if (std::adjacent_find(cells.begin(), cells.end()) != cells.end()) {
        return broken("a step chose one cell twice");
      }
      for (cell_t c : step_cells) {
        if (c < 0 || c >= p.capacity()) return broken("step cell out of range");
        if (!step_placed_ && !p.table().is_empty(c)) return broken("chosen cell not empty");
      }
    }
  }
  std::sort(serials.begin(), serials.end());
  if (std::adjacent_find(serials.begin(), serials.end()) != serials.end()) {
    return broken("two live ids share a serial");
  }
  int32_t served = 0;
  for (uint8_t v : layer_served_) served += v;
  if (step_state_ == StepState::kDeclared && served != n_served_) return broken("n_served");
  return Status::ok();
}

}  // namespace cellcache
