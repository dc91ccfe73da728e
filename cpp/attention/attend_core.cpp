#include "attention/attend_core.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>  // the baseline instance's binary16 loads (attend_kernel.inc)
#endif

namespace cellcache::attention {
namespace {

using detail::error;
using detail::str;

constexpr int32_t kTile = 16;         // cells scored at once: one vector of scores
constexpr int32_t kBlockTokens = 8;   // consecutive tokens of one sequence per block
constexpr int64_t kMinPiece = 256;    // (cell, KV head) pairs a piece spans, at least (piece_cells)
#if defined(__GNUC__)
#define CC_INLINE inline __attribute__((always_inline))
#define CC_INLINE_LAMBDA __attribute__((always_inline))
#else
#define CC_INLINE inline
#define CC_INLINE_LAMBDA
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A block: consecutive tokens of one sequence, scored against the union of
// their ranges [lo, hi) in plan.cells; `base` is where the sequence's
// position-0 cell would be listed there (plan.group_begin less
// plan.group_reclaimed: below the first listed cell when a windowed pool
// reclaimed the oldest), from which pieces and tiles are counted.
struct Block {
  int32_t tok0 = 0;
  int32_t n_tok = 0;
  int32_t lo = 0;
  int32_t hi = 0;
  int64_t base = 0;
};

// A piece: one block, every KV head, a sub-range of the block's cells. Its
// partial softmax state (per row t * n_heads + head: max, sum, acc[head_dim])
// goes to `state`. All heads at once: a cell's K (and V) row, every KV head,
// is contiguous, so the piece reads memory in order; one pass per KV head
// read 1/n_kv of every row and ran at half the bandwidth (measured).
struct Piece {
  int32_t block = 0;
  int32_t lo = 0;
  int32_t hi = 0;
  int64_t state = 0;  // offset into the state buffer
};

struct Work {
  const Query* q;
  const KvBuffers* kv;
  const AttendPlan* plan;
  Params params;
  int64_t group;  // query heads per KV head
  std::vector<Block> blocks;
  std::vector<Piece> pieces;
  mutable std::vector<float> state;  // written by the pieces (disjoint parts) through const Work
};

int64_t state_floats(int64_t rows, int64_t head_dim) { return rows * (head_dim + 2); }

// ---- the kernel

// One instance of the kernel per instruction set; the best the CPU supports
// is chosen at run time (the build targets baseline x86-64). GCC only: clang
// ignores `#pragma GCC target` (and would reject the intrinsics), so a clang
// build has the baseline instance alone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define CC_KERNEL_ISA 512
#include "attention/attend_kernel.inc"
#undef CC_KERNEL_ISA
#pragma GCC pop_options
}  // namespace avx512
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define CC_KERNEL_ISA 256
#include "attention/attend_kernel.inc"
#undef CC_KERNEL_ISA
#pragma GCC pop_options
}  // namespace avx2
#endif
namespace base {
#define CC_KERNEL_ISA 0
#include "attention/attend_kernel.inc"
#undef CC_KERNEL_ISA
}  // namespace base

using RunPieces = void (*)(const Work&, KvDtype, int64_t, int64_t);

// The best instance the CPU runs, or a lower one named by the environment
// variable CELLCACHE_ATTEND_ISA (avx512, avx2, base) so tests cover every
// instance on one machine; one the CPU lacks is not taken.
RunPieces pick_run_pieces() {
  const char* env = std::getenv("CELLCACHE_ATTEND_ISA");
  const std::string want = env ? env : "";
  if (!want.empty() && want != "avx512" && want != "avx2" && want != "base") {
    std::fprintf(stderr, "cellcache: CELLCACHE_ATTEND_ISA=%s is not one of avx512, avx2, base; "
                 "ignored\n", env);
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (want == "base") return base::run_pieces;
  if (avx512 && want != "avx2") return avx512::run_pieces;
  if (avx2) return avx2::run_pieces;
#endif
  return base::run_pieces;
}

// ---- checks, blocks and pieces

Status check_inputs(const Query& q, const KvBuffers& kv, const AttendPlan& plan,
                    std::span<float> out) {
  auto bad = [](const std::string& what) {
    return error(StatusCode::kInvalidConfig, "attend: " + what);
  };
  if (q.data == nullptr || kv.k == nullptr || kv.v == nullptr) return bad("null buffer");
  if (q.n_tok < 1 || q.n_heads < 1 || q.head_dim < 1) {
    return bad("query shape [" + str(q.n_tok) + ", " + str(q.n_heads) + ", " +
               str(q.head_dim) + "] must have no zero dimension");
  }
  if (kv.n_kv_heads < 1 || q.n_heads % kv.n_kv_heads != 0) {
    return bad(str(q.n_heads) + " query heads are not a multiple of " + str(kv.n_kv_heads) +
               " KV heads");
  }
  if (kv.head_dim != q.head_dim) {
    return bad("K/V head_dim " + str(kv.head_dim) + " differs from the query's " +
               str(q.head_dim));
  }
  if (kv.dtype != KvDtype::kFloat32 && kv.dtype != KvDtype::kFloat16 &&
      kv.dtype != KvDtype::kInt8) {
    return bad("unsupported K/V dtype");
  }
  if (out.size() != static_cast<size_t>(q.n_tok * q.n_heads * q.head_dim)) {
    return bad("output holds " + str(static_cast<int64_t>(out.size())) + " floats, expected " +
               str(q.n_tok * q.n_heads * q.head_dim));
  }
  const int64_t n_tok = q.n_tok;
  if (static_cast<int64_t>(plan.tok_begin.size()) != n_tok ||
      static_cast<int64_t>(plan.tok_end.size()) != n_tok ||
      static_cast<int64_t>(plan.tok_group.size()) != n_tok) {
    return error(StatusCode::kPositionConflict,
                 "attend: the step holds " + str(static_cast<int64_t>(plan.tok_begin.size())) +
                     " tokens but the query has " + str(n_tok));
  }
  if (plan.group_begin.empty() || plan.group_begin.front() != 0 ||
      plan.group_begin.back() != static_cast<int32_t>(plan.cells.size())) {
    return bad("malformed attention plan (group offsets)");
  }
  const int64_t n_groups = static_cast<int64_t>(plan.group_begin.size()) - 1;
  for (int64_t g = 0; g < n_groups; ++g) {
    if (plan.group_begin[g] > plan.group_begin[g + 1]) return bad("malformed attention plan");
  }
  for (cell_t c : plan.cells) {
    if (c < 0 || c >= kv.n_cells) {
      return bad("cell " + str(c) + " lies outside the K/V buffers of " + str(kv.n_cells) +
                 " cells");
    }
  }
  if (!plan.group_reclaimed.empty()) {
    if (static_cast<int64_t>(plan.group_reclaimed.size()) != n_groups) {
      return bad("malformed attention plan (reclaimed counts)");
    }
    for (int32_t r : plan.group_reclaimed) {
      if (r < 0) return bad("malformed attention plan (a negative reclaimed count)");
    }
  }
  for (int64_t i = 0; i < n_tok; ++i) {
    const int32_t g = plan.tok_group[i];
    if (g < 0 || g >= n_groups || plan.tok_begin[i] < plan.group_begin[g] ||
        plan.tok_begin[i] > plan.tok_end[i] || plan.tok_end[i] > plan.group_begin[g + 1]) {
      return bad("token " + str(i) + " has a range outside its sequence's cells");
    }
  }
  return Status::ok();
}

void make_blocks(Work& w) {
  const AttendPlan& plan = *w.plan;
  const int32_t n_tok = static_cast<int32_t>(w.q->n_tok);
  for (int32_t i = 0; i < n_tok; ++i) {
    if (!w.blocks.empty()) {
      Block& b = w.blocks.back();
      if (b.n_tok < kBlockTokens && plan.tok_group[b.tok0] == plan.tok_group[i]) {
        ++b.n_tok;
        b.lo = std::min(b.lo, plan.tok_begin[i]);
        b.hi = std::max(b.hi, plan.tok_end[i]);
        continue;
      }
    }
    const int32_t g = plan.tok_group[i];
    const int64_t reclaimed = plan.group_reclaimed.empty() ? 0 : plan.group_reclaimed[g];
    w.blocks.push_back({i, 1, plan.tok_begin[i], plan.tok_end[i],
                        plan.group_begin[g] - reclaimed});
  }
}

// Cells a piece spans: at least kMinPiece (cell, KV head) pairs, a whole
// number of tiles.
int64_t piece_cells(int64_t n_kv_heads) {
  const int64_t cells = (kMinPiece + n_kv_heads - 1) / n_kv_heads;
  return (cells + kTile - 1) / kTile * kTile;
}

// Each block's cells are cut every piece_cells() cells counted from its
// sequence's position 0 (Block::base; the list holds every cell of the
// sequence a pool keeps, by position, on every layer, and a windowed pool's
// reclaimed count stands for the rest), whatever else the step holds, what
// a pool has reclaimed so far and
// however many threads run it, and tiles are counted from there too
// (run_piece). A token's scores are then reduced in the same tiles and pieces,
// and its pieces combined in the same order, whether it is decoded alone,
// beside its sequence's proposed tokens, or beside other sequences: its
// output is the same to the bit, on full-attention and sliding-window layers
// (greedy speculative decoding emits exactly plain decoding's tokens, also
// where int8 activation rounding would turn an ulp into another argmax).
void make_pieces(Work& w) {
  const int64_t piece = piece_cells(w.kv->n_kv_heads);
  int64_t state = 0;
  for (int32_t bi = 0; bi < static_cast<int32_t>(w.blocks.size()); ++bi) {
    const Block& b = w.blocks[bi];
    const int64_t rows = b.n_tok * w.q->n_heads;
    int32_t lo = b.lo;
    do {  // at least one piece, even for an empty range (its output is 0)
      const int64_t next = b.base + ((lo - b.base) / piece + 1) * piece;  // the next cut
      const int32_t hi = static_cast<int32_t>(std::min<int64_t>(next, b.hi));
      w.pieces.push_back({bi, lo, hi, state});
      state += state_floats(rows, w.q->head_dim);
      lo = hi;
    } while (lo < b.hi);
  }
  w.state.resize(static_cast<size_t>(state));
}

// Merges each block's pieces (consecutive in w.pieces) into out.
void combine(const Work& w, float* out) {
  const Query& q = *w.q;
  const int64_t hd = q.head_dim;
  std::vector<float> acc(hd);
  size_t i = 0;
  while (i < w.pieces.size()) {
    size_t j = i;
    while (j < w.pieces.size() && w.pieces[j].block == w.pieces[i].block) ++j;
    const Block& block = w.blocks[w.pieces[i].block];
    const int64_t rows = block.n_tok * q.n_heads;
    for (int64_t r = 0; r < rows; ++r) {
      float m = kNegInf;
      for (size_t p = i; p < j; ++p) m = std::max(m, w.state[w.pieces[p].state + r]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (m != kNegInf) {
        for (size_t p = i; p < j; ++p) {
          const float* s = w.state.data() + w.pieces[p].state;
          if (s[r] == kNegInf) continue;
          const float scale = std::exp(s[r] - m);
          l += s[rows + r] * scale;
          const float* a = s + 2 * rows + r * hd;
          for (int64_t d = 0; d < hd; ++d) acc[d] += a[d] * scale;
        }
      }
      float* o = out + (block.tok0 * q.n_heads + r) * hd;  // rows are t * n_heads + head
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < hd; ++d) o[d] = acc[d] * inv;
    }
    i = j;
  }
}

}  // namespace

int64_t kv_stored_dim(KvDtype dtype, int64_t head_dim) {
  return dtype == KvDtype::kInt8 ? head_dim + kInt8ScaleBytes : head_dim;
}

int64_t kv_head_dim(KvDtype dtype, int64_t stored_dim) {
  return dtype == KvDtype::kInt8 ? stored_dim - kInt8ScaleBytes : stored_dim;
}

int64_t kv_head_bytes(KvDtype dtype, int64_t head_dim) {
  switch (dtype) {
    case KvDtype::kFloat32: return head_dim * 4;
    case KvDtype::kFloat16: return head_dim * 2;
    case KvDtype::kInt8: return head_dim + kInt8ScaleBytes;
  }
  return 0;
}

Status attend(const Query& query, const KvBuffers& kv, const AttendPlan& plan,
              const Params& params, std::span<float> out, const Threads& threads) {
  Status s = check_inputs(query, kv, plan, out);
  if (!s.is_ok()) return s;
  Work w{&query, &kv, &plan, params, query.n_heads / kv.n_kv_heads, {}, {}, {}};
  make_blocks(w);
  const int64_t n_threads = threads.run ? std::max<int64_t>(1, threads.count) : 1;
  make_pieces(w);
  static const RunPieces run_pieces = pick_run_pieces();
  const int64_t n = static_cast<int64_t>(w.pieces.size());
  if (n_threads > 1 && n > 1) {
    threads.run(n, [&](int64_t begin, int64_t end) { run_pieces(w, kv.dtype, begin, end); });
  } else {
    run_pieces(w, kv.dtype, 0, n);
  }
  combine(w, out.data());
  return Status::ok();
}

}  // namespace cellcache::attention
