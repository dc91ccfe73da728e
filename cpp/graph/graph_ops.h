// The logic of the graph ops (cellcache::place, mask, attend, write and rope),
// written once and called by both shims: the ExecuTorch kernels
// (cpp/kernels/) and the PyTorch CPU kernels (through the Python binding).
// Schemas: ops/cellcache_ops.yaml.
#pragma once

#include <cstdint>
#include <span>

#include "attention/attend_core.h"
#include "attention/kv_write.h"
#include "attention/rope.h"
#include "cellcache/status.h"

namespace cellcache {

// cellcache::place: serves `layer` of the step declared on the cache named by
// `handle` (see CellCache::place_step) and writes each token's cell.
//   positions: [n_tok] int64 token positions, graph order
//   cells_out: [n_tok] int64 the cell of each token (K/V write index)
// Errors: kUnknownCache and every error of CellCache::place_step.
Status place_op(int64_t handle, std::span<const int64_t> positions, int64_t layer,
                std::span<int64_t> cells_out);

// cellcache::mask: the additive attention mask of a layer already placed.
//   cells:    [n_tok] int64, the output of place for this step (checked)
//   extent:   number of cells attention reads, used_end <= extent <=
//             written_end of the layer's pool (CellCache::pool_state)
//   mask_out: [n_tok, extent] float32 row-major; 0 = attend, -inf = masked
//             (columns >= used_end are masked)
// Errors: kUnknownCache, kLayerOutOfRange, kStepNotDeclared, kStepInvalidated,
// kPositionConflict (cells differ from the placement), kInvalidConfig (extent
// outside [used_end, written_end]).
Status mask_op(int64_t handle, std::span<const int64_t> cells, int64_t layer, int64_t extent,
               std::span<float> mask_out);

// cellcache::attend: attention of a layer already placed, reading only each
// token's own cells (attend_plan.h, attention/attend_core.h).
//   cells:  [n_tok] int64, the output of place for this step (checked)
//   query:  [n_tok, n_heads, head_dim] fp32
//   kv:     the layer's K/V buffers [n_cells, n_kv_heads, head_dim], fp32 or
//           fp16 (int8: head_dim + 4, attention/kv_int8.h); n_cells must
//           equal the capacity of the layer's pool (CellCache::pool_of;
//           a cache of one pool: its capacity)
//   out:    [n_tok, n_heads, head_dim] fp32
// Errors: kUnknownCache, kLayerOutOfRange, kStepNotDeclared, kStepInvalidated,
// kPositionConflict (cells differ from the placement, or n_tok differs from
// the step's), kInvalidConfig (shapes, dtype, a K/V buffer whose cell count
// is not the layer's pool's).
Status attend_op(int64_t handle, std::span<const int64_t> cells, int64_t layer,
                 const attention::Query& query, const attention::KvBuffers& kv,
                 const attention::Params& params, std::span<float> out,
                 const attention::Threads& threads = {});

// cellcache::write: a layer's K or V write, in place (attention/kv_write.h).
//   cells: [n_tok] int64, the output of place for this step
//   rows:  [n_tok, n_kv_heads * head_dim] fp32, the step's new K (or V)
//   cache: the layer's K (or V) buffer, fp32, fp16 or int8, converted on copy
//          (int8: quantized per cell and KV head, attention/kv_int8.h)
// Errors: kInvalidConfig (sizes, dtype, alignment, rows overlapping the
// cache, a cell outside the buffer: attention::write_rows); nothing is
// written then.
Status write_op(std::span<const int64_t> cells, std::span<const float> rows,
                const attention::KvCache& cache);

// cellcache::rope: RoPE of a layer's q or k (attention/rope.h), out = x
// rotated by each token's cos/sin rows.
//   x, out:   [n_tok, n_heads, head_dim] fp32 (out may be x)
//   cos, sin: [n_tok, head_dim] fp32
// Errors: kInvalidConfig (sizes, overlap: attention::apply_rope); nothing is
// written then.
Status rope_op(const attention::RopeShape& shape, std::span<const float> x,
               std::span<const float> cos, std::span<const float> sin, std::span<float> out);

// The Status of the last failed place_op/mask_op/attend_op/write_op/rope_op on this thread (ok when
// none), so a runner can report why a program's execute() failed. Cleared by
// clear_last_op_error().
const Status& last_op_error();
void clear_last_op_error();

}  // namespace cellcache
