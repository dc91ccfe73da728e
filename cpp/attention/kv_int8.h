// int8 K/V cells (kv_dtype "int8", SPEC section 12): the storage scheme, its
// rule, and why. cellcache::write quantizes by this rule as it stores a row
// (kv_write.cpp); cellcache::attend dequantizes as its tiles load
// (attend_kernel.inc), accumulating in fp32. Tested under ASan + UBSan against
// a reference written from the rule below (cpp/tests/kv_int8_test.cpp).
//
// Layout. A layer's K (or V) buffer is int8 [n_cells, n_kv_heads, head_dim +
// kInt8ScaleBytes]: each (cell, KV head) holds its head_dim int8 values q[0..hd)
// and then its scale, an IEEE binary32 in native byte order (read and written
// with memcpy: it need not be 4-byte aligned). One buffer per K and V per
// layer, as for fp32 and fp16, so the graph ops' schemas do not change; the
// tensor's last dimension is head_dim + 4.
// Bytes per cell and layer: 2 * n_kv_heads * (head_dim + 4), against fp16's
// 2 * n_kv_heads * head_dim * 2: 0.531x fp16 at head_dim 64 (the 135M bench
// model), 0.5625x at head_dim 32 (the default model).
//
// Rule (symmetric absmax per (cell, KV head)), for one head's values x[0..hd):
//   amax  = max_i |x_i|
//   any x_i inf or NaN:  scale = NaN (the quiet NaN), q_i = 0
//   else scale = fl(amax / 127)   (binary32 division, round to nearest even)
//   scale == 0 (all zeros, or amax < ~127 * 2^-150):  q_i = 0
//   else q_i = clamp(round_half_even(fl(x_i / scale)), -127, 127)
// and the stored value reads back as x'_i = fl(q_i * scale). -128 is never
// stored. The rule assumes the default floating-point environment (round to
// nearest even).
// Non-finite input: the head is stored with a NaN scale. attend gives NaN in
// every output element of each query head that reads that (cell, KV head)
// through K or V (its score counts as 0 in the softmax's running max, so
// nothing else overflows), and changes nothing for queries that do not see
// the cell, for other KV heads of the cell, or for other cells. fp32 and fp16
// storage keep the inf/NaN themselves; int8 cannot, so it marks the head.
//
// Why this scheme (measured 2026-12-02, scripts as in the session report:
// the default model's held-out perplexity in transformers eager, fp32 weights,
// windows of 256 tokens stride 128, 12,526 tokens, K/V fake-quantized as each
// scheme stores them; error = mean over (token, head) of
// ||x' - x|| / ||x||, K and V):
//   fp32 K/V                                  5.27041
//   fp16                                      5.27043 (+0.000%)  error 2.0e-4
//   symmetric, per head, fp32 scale (this)    5.26775 (-0.050%)  error 5.3e-3 (K), 5.0e-3 (V)
//   symmetric, blocks of 16, fp32 scales      5.26770 (-0.051%)  error 4.5e-3, 4.5e-3
//   q8_0 (blocks of 32, fp16 scale, round     5.26801 (-0.046%)  error 5.3e-3, 5.0e-3
//     half away; = per head at head_dim 32)
//   asymmetric per head (uint8 + min)         5.27112 (+0.013%)  error 4.6e-3, 4.8e-3
// Every int8 scheme moves perplexity by under 0.06%, noise next to the +0.5%
// budget; finer blocks cut the value error by ~15% for twice the scale
// bytes, and a zero point costs a subtraction per element. One scale per head
// folds into the kernel's math instead: a score is scale_k * (q . k_int8) and
// a probability is multiplied by scale_v before it weights the int8 V row, so
// dequantizing costs one multiply per cell, not one per element.
#pragma once

#include <cstdint>
#include <cstring>

namespace cellcache::attention {

constexpr int64_t kInt8ScaleBytes = 4;  // the binary32 scale after each head's int8 values

// Quantizes one head, x[0..head_dim), by the rule above into
// out[0..head_dim + kInt8ScaleBytes): the int8 values, then the scale.
void quantize_int8_head(const float* x, int64_t head_dim, int8_t* out);

// The scale stored after a head's head_dim int8 values.
inline float int8_head_scale(const int8_t* head, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, head + head_dim, sizeof(scale));
  return scale;
}

}  // namespace cellcache::attention
