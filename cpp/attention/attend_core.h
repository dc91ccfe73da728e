// The attention math of cellcache::attend (SPEC section 8), in plain C++: no
// torch, no ExecuTorch. Compiled into both shims (the ExecuTorch kernel in
// cpp/kernels/ and the PyTorch CPU kernel through the Python binding) and
// tested on its own under ASan + UBSan (cpp/tests/attend_test.cpp).
//
// For every query token i and query head h, attention reads only the cells
// plan.cells[plan.tok_begin[i] .. plan.tok_end[i]) (attend_plan.h: the
// token's own sequence's cells within its layer's window, by position):
//   s_j   = scaling * (q[i, h] . k[cell_j, h / group])           group = n_heads / n_kv_heads
//   s_j   = softcap * tanh(s_j / softcap)          when softcap > 0 (Gemma 2)
//   out   = sum_j softmax(s)_j * v[cell_j, h / group]
// (transformers' eager attention with its mask; the softcap order is Gemma 2's).
//
// How: online softmax (flash-attention style) over tiles of 16 gathered cells
// (one vector of scores), accumulated in fp32 whatever the K/V dtype (fp16 is
// converted as it is loaded; int8 too, its per-head scale folded into each
// score and each probability: kv_int8.h). A work piece covers every KV head of a run of a
// block's cells, so each cell's K and V rows are read whole and in order; the
// query heads that share a KV head (GQA) are scored from one load (and
// conversion) of each K element and accumulate each V element loaded once,
// up to three heads a pass (attend_kernel.inc kHeadsPerPass), and up to
// kBlockTokens consecutive tokens of one sequence (a prefill chunk) reuse
// each tile. Cell lists are
// cut into pieces of a fixed number of cells, run on different threads; their
// partial softmax states are combined at the end, in order. Pieces and tiles
// are counted from the sequence's first cell, whatever the step or thread
// count, so a token's output does not depend on what else the step holds: it
// is the same to the bit alone, beside its sequence's proposed tokens or
// beside other sequences, at any thread count (attend_core.cpp make_pieces).
// The kernel body (attend_kernel.inc) is compiled once per instruction set
// (AVX-512, AVX2 + F16C, baseline) and the best the CPU has runs; the
// environment variable CELLCACHE_ATTEND_ISA=avx2 or =base picks a lower one
// (the C++ tests run each).
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "cellcache/attend_plan.h"
#include "attention/kv_int8.h"
#include "cellcache/status.h"

namespace cellcache::attention {

enum class KvDtype { kFloat32, kFloat16, kInt8 };

// The last dimension of a K/V buffer of `dtype` holding heads of head_dim
// values: head_dim, or head_dim + kInt8ScaleBytes for int8 (kv_int8.h).
int64_t kv_stored_dim(KvDtype dtype, int64_t head_dim);
// Its inverse: head_dim of a buffer whose last dimension is stored_dim (< 1
// when it cannot hold one value a head).
int64_t kv_head_dim(KvDtype dtype, int64_t stored_dim);

// Bytes one (cell, KV head) takes in a K (or V) buffer of `dtype`.
int64_t kv_head_bytes(KvDtype dtype, int64_t head_dim);

// The layer's K/V buffers, each [n_cells, n_kv_heads, kv_stored_dim(dtype,
// head_dim)] contiguous, elements of `dtype` (fp16 = IEEE binary16; int8:
// kv_int8.h's layout, head_dim int8 values and a scale per head).
struct KvBuffers {
  const void* k = nullptr;
  const void* v = nullptr;
  KvDtype dtype = KvDtype::kFloat32;
  int64_t n_cells = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
};

// query: [n_tok, n_heads, head_dim] fp32 contiguous.
struct Query {
  const float* data = nullptr;
  int64_t n_tok = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;
};

struct Params {
  float scaling = 1.0f;
  float softcap = 0.0f;  // <= 0: no softcap
};

// How to run work items [0, n) on several threads: run(n, body) calls
// body(begin, end) over disjoint ranges covering [0, n), possibly in
// parallel, and returns when all are done. `count` is how many threads it
// uses (the pieces are the same for any count: only who runs them changes). An
// empty `run` runs serially.
struct Threads {
  int64_t count = 1;
  std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)> run;
};

// Writes out [n_tok, n_heads, head_dim] fp32. Errors (nothing read outside
// the buffers, out untouched): kInvalidConfig for mismatched shapes (K/V
// head_dim or n_kv_heads differing from the query's, n_heads not a multiple
// of n_kv_heads, out of the wrong size, null buffers) and for a plan whose
// cells or ranges fall outside the K/V buffers or the plan's lists;
// kPositionConflict when the plan's token count differs from the query's.
Status attend(const Query& query, const KvBuffers& kv, const AttendPlan& plan,
              const Params& params, std::span<float> out, const Threads& threads = {});

}  // namespace cellcache::attention
