// The step protocol of CellCache (cell_cache.h): declare_step, placement,
// masks and the served-layer checks. The sequence verbs are in cell_cache.cpp.
#include "cellcache/cell_cache.h"

#include <algorithm>
#include <limits>
#include <string>

namespace cellcache {

using detail::error;
using detail::str;

Result<bool> CellCache::declare_step(std::span<const seq_t> seq_ids) {
  for (seq_t seq : seq_ids) {
    Status s = check_live(seq);
    if (!s.is_ok()) return s;
  }
  const auto n_tok = static_cast<int64_t>(seq_ids.size());
  for (const CellPool& p : pools_) {
    if (n_tok > p.free_cells()) return false;
  }

  abandon_partial_step();  // replaces a step that has not finished
  step_seqs_.assign(seq_ids.begin(), seq_ids.end());
  for (CellPool& p : pools_) {
    p.choose_cells(static_cast<int32_t>(n_tok));
    p.planner().reset();
  }
  step_pos_.clear();
  step_placed_ = false;
  step_state_ = StepState::kDeclared;
  std::fill(layer_served_.begin(), layer_served_.end(), 0);
  std::fill(policy_built_.begin(), policy_built_.end(), 0);
  n_served_ = 0;
  return true;
}

Status CellCache::check_step_positions(std::span<const int64_t> positions) const {
  if (positions.size() != step_seqs_.size()) {
    return error(StatusCode::kPositionConflict,
                 "got " + str(static_cast<int64_t>(positions.size())) +
                     " positions for a step declared with " +
                     str(static_cast<int64_t>(step_seqs_.size())) + " tokens");
  }
  if (step_placed_) {
    for (size_t i = 0; i < positions.size(); ++i) {
      if (positions[i] != step_pos_[i]) {
        return error(StatusCode::kPositionConflict,
                     "token " + str(static_cast<int64_t>(i)) + " has position " +
                         str(positions[i]) + " but the step was placed with " +
                         str(step_pos_[i]));
      }
    }
    return Status::ok();
  }
  // Highest position per sequence so far: held positions, then this step's.
  std::array<int64_t, kMaxSequences> last{};
  for (seq_t s : step_seqs_) last[s] = seq_max_pos_[s];
  for (size_t i = 0; i < positions.size(); ++i) {
    const int64_t p = positions[i];
    const seq_t s = step_seqs_[i];
    const std::string where = "token " + str(static_cast<int64_t>(i)) + " (sequence " +
                              str(s) + ") at position " + str(p);
    if (p < 0 || p >= std::numeric_limits<pos_t>::max()) {
      return error(StatusCode::kPositionConflict, where + ": position out of range");
    }
    if (p <= last[s]) {
      const bool held = p <= seq_max_pos_[s];
      return error(StatusCode::kPositionConflict,
                   where + (held ? ": not after position " + str(seq_max_pos_[s]) +
                                       " that the sequence already holds"
                                 : ": positions of a sequence must strictly increase "
                                   "within a step (previous " + str(last[s]) + ")"));
    }
    last[s] = p;
  }
  return Status::ok();
}

void CellCache::place_declared(std::span<const int64_t> positions) {
  step_pos_.assign(positions.begin(), positions.end());
  for (CellPool& p : pools_) p.place(step_seqs_, step_pos_);
  for (size_t i = 0; i < step_seqs_.size(); ++i) {
    const seq_t s = step_seqs_[i];
    seq_max_pos_[s] = std::max(seq_max_pos_[s], step_pos_[i]);
  }
  step_placed_ = true;
}

void CellCache::finish_step() {
  // Each sequence's first position in the step comes first (positions
  // increase within a step).
  SeqSet done;
  for (size_t i = 0; i < step_seqs_.size(); ++i) {
    const seq_t s = step_seqs_[i];
    if (done.test(s)) continue;
    done.set(s);
    for (CellPool& p : pools_) p.reclaim_after_step(s, step_pos_[i], seq_max_pos_[s] + 1);
  }
}

void CellCache::build_mask(int32_t policy) {
  const Window window = policies_[policy];
  const CellTable& table = pools_[policy_pool_[policy]].table();
  const int32_t n_tok = static_cast<int32_t>(step_seqs_.size());
  // The width fixed at placement: reclaim at the step's end frees cells no
  // token of the step sees, and must not reshape a mask already handed out.
  const cell_t end = pools_[policy_pool_[policy]].step_used_end();
  std::vector<uint8_t>& mask = policy_mask_[policy];
  mask.resize(static_cast<size_t>(n_tok) * end);  // keeps capacity when shapes repeat
  for (int32_t i = 0; i < n_tok; ++i) {
    const seq_t s = step_seqs_[i];
    const pos_t p = step_pos_[i];
    uint8_t* row = mask.data() + static_cast<size_t>(i) * end;
    for (cell_t c = 0; c < end; ++c) {
      row[c] = static_cast<uint8_t>(table.owned_by(c, s) && window_sees(window, table.pos(c), p));
    }
  }
  policy_built_[policy] = 1;
}

LayerStep CellCache::layer_step(int32_t layer) const {
  const std::vector<uint8_t>& mask = policy_mask_[layer_policy_[layer]];
  const CellPool& pool = pools_[policy_pool_[layer_policy_[layer]]];
  LayerStep step;
  step.cells = pool.step_cells();
  step.mask = mask;
  step.n_tok = static_cast<int32_t>(step_seqs_.size());
  step.used_end = pool.step_used_end();
  return step;
}

Result<std::span<const cell_t>> CellCache::serve_layer(std::span<const int64_t> positions,
                                                       int32_t layer) {
  Status s = check_layer(layer);
  if (!s.is_ok()) return s;
  if (step_state_ == StepState::kInvalidated) {
    return error(StatusCode::kStepInvalidated,
                 "the declared step was invalidated by a sequence verb; declare it again");
  }
  if (step_state_ == StepState::kNone) {
    return error(StatusCode::kStepNotDeclared,
                 "layer " + str(layer) +
                     " ran a forward with no declared step (declare_step before each "
                     "forward; the previous step already ran all its layers)");
  }
  if (layer_served_[layer]) {
    return error(StatusCode::kStepNotDeclared,
                 "layer " + str(layer) +
                     " was already served in this step: a forward that was not declared");
  }
  s = check_step_positions(positions);
  if (!s.is_ok()) return s;

  if (!step_placed_) place_declared(positions);
  layer_served_[layer] = 1;
  ++n_served_;
  if (n_served_ == n_layers()) {  // forward complete
    step_state_ = StepState::kNone;
    finish_step();
  }
  return layer_pool(layer).step_cells();
}

Result<LayerStep> CellCache::place_step(std::span<const int64_t> positions, int32_t layer) {
  Result<std::span<const cell_t>> cells = serve_layer(positions, layer);
  if (!cells.is_ok()) return cells.status();
  return served_layer(layer);
}

Status CellCache::check_served(int32_t layer) const {
  Status s = check_layer(layer);
  if (!s.is_ok()) return s;
  if (step_state_ == StepState::kInvalidated) {
    return error(StatusCode::kStepInvalidated,
                 "the declared step was invalidated by a sequence verb; declare it again");
  }
  if (!layer_served_[layer]) {
    return error(StatusCode::kStepNotDeclared,
                 "layer " + str(layer) + " has not been placed in the current step");
  }
  return Status::ok();
}

Result<LayerStep> CellCache::served_layer(int32_t layer) {
  Status s = check_served(layer);
  if (!s.is_ok()) return s;
  const int32_t policy = layer_policy_[layer];
  if (!policy_built_[policy]) build_mask(policy);
  return layer_step(layer);
}

Result<AttendPlan> CellCache::attend_plan(int32_t layer) {
  Status s = check_served(layer);
  if (!s.is_ok()) return s;
  const int32_t policy = layer_policy_[layer];
  CellPool& pool = pools_[policy_pool_[policy]];
  return pool.planner().plan(policy, policies_[policy], pool.table(), pool.n_reclaimed(),
                             step_seqs_, step_pos_);
}

}  // namespace cellcache
