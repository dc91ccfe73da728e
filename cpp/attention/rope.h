// RoPE (rotary position embedding, Su et al. 2021, "RoFormer") as transformers
// applies it (apply_rotary_pos_emb with rotate_half, e.g. models/llama): the
// kernel of cellcache::rope, which runs a layer's q and k rotation between its
// projections (an XNNPACK delegate call) and the K/V write / attend, so RoPE's
// six elementwise ops and two rotate_half GEMMs a layer leave the delegate
// (exporting/xnnpack_rewrites.py rope_as_op rewrites the graph). Plain C++ (no torch, no
// ExecuTorch), shared by both shims like attend_core.h; tested under ASan +
// UBSan (cpp/tests/rope_test.cpp) and against transformers (tests/test_rope_op.py).
//
// For token t, head h and i < half = head_dim / 2 (x, out: [n_tok, n_heads,
// head_dim] fp32; cos, sin: [n_tok, head_dim] fp32):
//   out[t, h, i]        = x[t, h, i]        * cos[t, i]        - x[t, h, i + half] * sin[t, i]
//   out[t, h, i + half] = x[t, h, i + half] * cos[t, i + half] + x[t, h, i]        * sin[t, i + half]
// Each product is rounded to fp32 before the sum (no fused multiply-add: this
// file is compiled with -ffp-contract=off), the rounding of transformers'
// q * cos + rotate_half(q) * sin in eager torch, so the values are the same bits.
#pragma once

#include <cstdint>
#include <span>

#include "cellcache/status.h"

namespace cellcache::attention {

struct RopeShape {
  int64_t n_tok = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;  // even
};

// The RopeShape of tensors laid out as cellcache::rope takes them (their
// sizes, outermost first): x [*tokens, n_heads, head_dim] and cos, sin
// [*tokens, head_dim] or [*tokens, 1, head_dim], a row per token, laid out as
// x's token dims (the second is eager broadcasting's form; n_tok is the
// product of the token dims). Both shims read a tensor's shape through it, and
// graph/ops.py _check_rope refuses the same at export. Errors
// (kInvalidConfig): x of fewer than 2 dims, a table of any other shape (x [2,
// 3, 2, 8] with cos [3, 2, 8] holds 6 rows, per-head tables to eager
// broadcasting), a negative size, sizes whose product overflows int64.
Result<RopeShape> rope_shape(std::span<const int64_t> x, std::span<const int64_t> cos,
                             std::span<const int64_t> sin);

// Rotates x into out (out may be x itself, not a partial overlap of it).
// Errors (kInvalidConfig, nothing written): n_heads < 1, head_dim < 2 or odd,
// n_tok < 0, x or out not n_tok * n_heads * head_dim values, cos or sin not
// n_tok * head_dim values, out partly overlapping x, cos or sin.
Status apply_rope(const RopeShape& shape, std::span<const float> x, std::span<const float> cos,
                  std::span<const float> sin, std::span<float> out);

}  // namespace cellcache::attention
