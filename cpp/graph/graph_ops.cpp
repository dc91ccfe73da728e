#include "graph/graph_ops.h"

#include <algorithm>
#include <limits>
#include <string>

#include "cellcache/cell_cache.h"
#include "graph/registry.h"

namespace cellcache {

namespace {

thread_local Status last_error;

Status remember(Status s) {
  if (!s.is_ok()) last_error = s;
  return s;
}

// A layer beyond int32 is out of range of every cache; say so with its value.
Status check_layer_fits(int64_t layer) {
  if (layer < std::numeric_limits<int32_t>::min() || layer > std::numeric_limits<int32_t>::max()) {
    return Status(StatusCode::kLayerOutOfRange, "layer " + std::to_string(layer) +
                                                    " is out of range");
  }
  return Status::ok();
}

}  // namespace

// The pool of `layer` in the cache behind `handle`: its placement, K/V
// extent and capacity are what a layer's op reads (one pool, or one per window
// policy with window_cells; issue #25).
static Result<PoolState> layer_pool(CellCache& cache, int64_t layer) {
  Result<int32_t> pool = cache.pool_of(static_cast<int32_t>(layer));
  if (!pool.is_ok()) return pool.status();
  return cache.pool_state(pool.value());
}

const Status& last_op_error() { return last_error; }
void clear_last_op_error() { last_error = Status::ok(); }

static Status place_impl(int64_t handle, std::span<const int64_t> positions, int64_t layer,
                         std::span<int64_t> cells_out) {
  Result<CellCache*> cache = lookup_cache(handle);
  if (!cache.is_ok()) return cache.status();
  Status fits = check_layer_fits(layer);
  if (!fits.is_ok()) return fits;
  Result<std::span<const cell_t>> cells =
      cache.value()->serve_layer(positions, static_cast<int32_t>(layer));
  if (!cells.is_ok()) return cells.status();
  if (cells_out.size() != cells.value().size()) {
    return Status(StatusCode::kPositionConflict,
                  "place output holds " + std::to_string(cells_out.size()) + " cells for " +
                      std::to_string(cells.value().size()) + " tokens");
  }
  std::copy(cells.value().begin(), cells.value().end(), cells_out.begin());
  return Status::ok();
}

static Status mask_impl(int64_t handle, std::span<const int64_t> cells, int64_t layer,
                        int64_t extent, std::span<float> mask_out) {
  Result<CellCache*> cache = lookup_cache(handle);
  if (!cache.is_ok()) return cache.status();
  Status fits = check_layer_fits(layer);
  if (!fits.is_ok()) return fits;
  Result<LayerStep> step = cache.value()->served_layer(static_cast<int32_t>(layer));
  if (!step.is_ok()) return step.status();
  const LayerStep& s = step.value();
  if (!std::equal(cells.begin(), cells.end(), s.cells.begin(), s.cells.end())) {
    return Status(StatusCode::kPositionConflict,
                  "mask of layer " + std::to_string(layer) +
                      " got cells that differ from the step's placement");
  }
  // Above written_end the K/V buffers hold memory no forward wrote.
  Result<PoolState> pool = layer_pool(*cache.value(), layer);
  if (!pool.is_ok()) return pool.status();
  const int64_t written_end = pool.value().written_end;
  if (extent < s.used_end || extent > written_end) {
    return Status(StatusCode::kInvalidConfig,
                  "attention extent " + std::to_string(extent) + " must lie in [used_end " +
                      std::to_string(s.used_end) + ", written_end " +
                      std::to_string(written_end) + "] (pass CellCache.planned_used_end)");
  }
  const size_t n_tok = s.cells.size();
  if (mask_out.size() != n_tok * static_cast<size_t>(extent)) {
    return Status(StatusCode::kInvalidConfig, "mask output has the wrong size");
  }
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n_tok; ++i) {
    const uint8_t* src = s.mask.data() + i * s.used_end;
    float* row = mask_out.data() + i * extent;
    for (int32_t c = 0; c < s.used_end; ++c) row[c] = src[c] ? 0.0f : kMasked;
    std::fill(row + s.used_end, row + extent, kMasked);
  }
  return Status::ok();
}

static Status attend_impl(int64_t handle, std::span<const int64_t> cells, int64_t layer,
                          const attention::Query& query, const attention::KvBuffers& kv,
                          const attention::Params& params, std::span<float> out,
                          const attention::Threads& threads) {
  Result<CellCache*> cache = lookup_cache(handle);
  if (!cache.is_ok()) return cache.status();
  Status fits = check_layer_fits(layer);
  if (!fits.is_ok()) return fits;
  CellCache& c = *cache.value();
  Result<AttendPlan> plan = c.attend_plan(static_cast<int32_t>(layer));
  if (!plan.is_ok()) return plan.status();
  Result<PoolState> pool = layer_pool(c, layer);
  if (!pool.is_ok()) return pool.status();
  const std::span<const cell_t> placed = pool.value().step_cells;
  if (!std::equal(cells.begin(), cells.end(), placed.begin(), placed.end())) {
    return Status(StatusCode::kPositionConflict,
                  "attend of layer " + std::to_string(layer) +
                      " got cells that differ from the step's placement");
  }
  if (query.n_tok != static_cast<int64_t>(placed.size())) {
    return Status(StatusCode::kPositionConflict,
                  "attend of layer " + std::to_string(layer) + " got " +
                      std::to_string(query.n_tok) + " query tokens for a step of " +
                      std::to_string(placed.size()));
  }
  if (kv.n_cells != pool.value().capacity) {
    return Status(StatusCode::kInvalidConfig,
                  "attend of layer " + std::to_string(layer) + ": the K/V buffers hold " +
                      std::to_string(kv.n_cells) + " cells but the layer's pool has " +
                      std::to_string(pool.value().capacity));
  }
  return attention::attend(query, kv, plan.value(), params, out, threads);
}

Status attend_op(int64_t handle, std::span<const int64_t> cells, int64_t layer,
                 const attention::Query& query, const attention::KvBuffers& kv,
                 const attention::Params& params, std::span<float> out,
                 const attention::Threads& threads) {
  return remember(attend_impl(handle, cells, layer, query, kv, params, out, threads));
}

Status write_op(std::span<const int64_t> cells, std::span<const float> rows,
                const attention::KvCache& cache) {
  return remember(attention::write_rows(cells, rows, cache));
}

Status place_op(int64_t handle, std::span<const int64_t> positions, int64_t layer,
                std::span<int64_t> cells_out) {
  return remember(place_impl(handle, positions, layer, cells_out));
}

Status mask_op(int64_t handle, std::span<const int64_t> cells, int64_t layer, int64_t extent,
               std::span<float> mask_out) {
  return remember(mask_impl(handle, cells, layer, extent, mask_out));
}

Status rope_op(const attention::RopeShape& shape, std::span<const float> x,
               std::span<const float> cos, std::span<const float> sin, std::span<float> out) {
  return remember(attention::apply_rope(shape, x, cos, sin, out));
}

}  // namespace cellcache
