// The K/V write of cellcache::write: a step's new K (or V) rows go to their
// cells of a layer's cache buffer, converted to the buffer's element type as
// they are copied. Plain C++ (no torch, no ExecuTorch), shared by both shims
// like attend_core.h; tested under ASan + UBSan (cpp/tests/kv_write_test.cpp).
//
// fp32 -> fp16 rounds to nearest, ties to even, as IEEE 754 and torch's
// Tensor.to(torch.float16) do; above the largest half (65504) values round to
// inf at 65520, NaN stays NaN. With F16C (x86-64, GCC) 8 values convert per
// instruction; elsewhere one at a time, bit-exact with the F16C result except
// for NaN payloads. int8 quantizes each (cell, KV head) by kv_int8.h's rule.
#pragma once

#include <cstdint>
#include <span>

#include "attention/attend_core.h"
#include "cellcache/status.h"

namespace cellcache::attention {

// A layer's K or V buffer: [n_cells, n_kv_heads, kv_stored_dim(dtype,
// head_dim)] contiguous elements of `dtype`.
struct KvCache {
  void* data = nullptr;
  KvDtype dtype = KvDtype::kFloat32;
  int64_t n_cells = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
};

// Writes rows[i * row .. (i + 1) * row) (fp32, row = n_kv_heads * head_dim)
// to cell cells[i] of `cache`, for i in [0, cells.size()). Checks everything
// before writing: kInvalidConfig (nothing written) when rows.size() !=
// cells.size() * row, the cache is null or empty, either buffer is not
// aligned to its element size, the rows overlap the cache, or a cell lies
// outside [0, n_cells). Equal cells: the last row wins.
Status write_rows(std::span<const int64_t> cells, std::span<const float> rows,
                  const KvCache& cache);

// IEEE binary32 -> binary16, round to nearest even (the scalar path).
uint16_t float_to_half(float x);

}  // namespace cellcache::attention
