#include "attention/attend_core.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace cellcache::attention {
namespace {

using detail::error;
using detail::str;

constexpr int32_t kTile = 64;         // cells scored at once
constexpr int32_t kBlockTokens = 8;   // consecutive tokens of one sequence per block
constexpr int64_t kMinPiece = 256;    // fewest cells a split piece holds
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__GNUC__)
#define CC_INLINE inline __attribute__((always_inline))
#else
#define CC_INLINE inline
#endif

// A block: consecutive tokens of one sequence, scored against the union of
// their ranges [lo, hi) in plan.cells.
struct Block {
  int32_t tok0 = 0;
  int32_t n_tok = 0;
  int32_t lo = 0;
  int32_t hi = 0;
};

// A piece: one block, one KV head, a sub-range of the block's cells. Its
// partial softmax state (per row: max, sum, acc[head_dim]) goes to `state`.
struct Piece {
  int32_t block = 0;
  int32_t kv_head = 0;
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
  std::vector<float> state;
  float* state_data = nullptr;  // state.data(); pieces write disjoint parts
};

int64_t state_floats(int64_t rows, int64_t head_dim) { return rows * (head_dim + 2); }

// ---- vectorizable primitives (compiled per target below)
//
// 16-float vectors (GCC/Clang vector extensions): one AVX-512 register, two
// AVX2 ones, four SSE ones, whatever the instance's target.
typedef float f16x __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

CC_INLINE f16x load(const float* p) {
  f16x v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

CC_INLINE void store(float* p, f16x v) { std::memcpy(p, &v, sizeof(v)); }

typedef float f8x __attribute__((vector_size(32)));
typedef float f4x __attribute__((vector_size(16)));

CC_INLINE float reduce(f16x v) {  // halving tree: a short dependency chain
  const f8x h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4x q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

CC_INLINE float dot(const float* a, const float* b, int64_t n) {
  f16x acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = reduce(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The dot products of q with four rows at once: four independent FMA chains
// (one dot alone is a chain of dependent FMAs, latency-bound).
CC_INLINE void dot4(const float* q, const float* const* k, int64_t n, float* out) {
  f16x a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const f16x qv = load(q + i);
    a0 += qv * load(k[0] + i);
    a1 += qv * load(k[1] + i);
    a2 += qv * load(k[2] + i);
    a3 += qv * load(k[3] + i);
  }
  out[0] = reduce(a0);
  out[1] = reduce(a1);
  out[2] = reduce(a2);
  out[3] = reduce(a3);
  for (; i < n; ++i) {
    out[0] += q[i] * k[0][i];
    out[1] += q[i] * k[1][i];
    out[2] += q[i] * k[2][i];
    out[3] += q[i] * k[3][i];
  }
}

// y = alpha * y + sum_j p[j] * x[j], x[j] rows of n floats: 64 floats of y
// stay in registers over all j (eight independent FMA chains: two rows of x
// at a time).
CC_INLINE void scale_accumulate(float* y, float alpha, const float* p, const float* const* x,
                                int32_t count, int64_t n) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= n; d += 4 * kLanes) {
    f16x a0 = load(y + d) * alpha, a1 = load(y + d + 16) * alpha;
    f16x a2 = load(y + d + 32) * alpha, a3 = load(y + d + 48) * alpha;
    f16x b0 = {}, b1 = {}, b2 = {}, b3 = {};
    int32_t j = 0;
    for (; j + 2 <= count; j += 2) {
      const float* xj = x[j] + d;
      const float* xk = x[j + 1] + d;
      const float pj = p[j], pk = p[j + 1];
      a0 += pj * load(xj);
      a1 += pj * load(xj + 16);
      a2 += pj * load(xj + 32);
      a3 += pj * load(xj + 48);
      b0 += pk * load(xk);
      b1 += pk * load(xk + 16);
      b2 += pk * load(xk + 32);
      b3 += pk * load(xk + 48);
    }
    if (j < count) {
      const float* xj = x[j] + d;
      const float pj = p[j];
      a0 += pj * load(xj);
      a1 += pj * load(xj + 16);
      a2 += pj * load(xj + 32);
      a3 += pj * load(xj + 48);
    }
    store(y + d, a0 + b0);
    store(y + d + 16, a1 + b1);
    store(y + d + 32, a2 + b2);
    store(y + d + 48, a3 + b3);
  }
  for (; d + kLanes <= n; d += kLanes) {
    f16x a = load(y + d) * alpha;
    for (int32_t j = 0; j < count; ++j) a += p[j] * load(x[j] + d);
    store(y + d, a);
  }
  for (; d < n; ++d) {
    float a = y[d] * alpha;
    for (int32_t j = 0; j < count; ++j) a += p[j] * x[j][d];
    y[d] = a;
  }
}

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp); x below -87 gives 0.
CC_INLINE f16x exp_nonpositive(f16x in) {
  const f16x lo = in < -87.0f ? f16x{} - 87.0f : in;  // lanes: -87 where below
  f16x v = lo;
  const f16x z0 = v * 1.44269504088896341f + 0.5f;
  i16x n = __builtin_convertvector(z0, i16x);         // truncates toward zero
  const f16x nf0 = __builtin_convertvector(n, f16x);
  const f16x fx = nf0 - (z0 < nf0 ? 1.0f : 0.0f);      // floor
  n = __builtin_convertvector(fx, i16x);
  v = v - fx * 0.693359375f - fx * -2.12194440e-4f;
  const f16x z = v * v;
  f16x y = v * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * v + 8.3334519073e-3f;
  y = y * v + 4.1665795894e-2f;
  y = y * v + 1.6666665459e-1f;
  y = y * v + 5.0000001201e-1f;
  y = y * z + v + 1.0f;
  const i16x bits = (n + 127) << 23;
  f16x pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  const f16x r = y * pow2;
  return in < -87.0f ? f16x{} : r;
}

CC_INLINE void exp_nonpositive(float* x, int32_t n) {
  float buf[kLanes];
  for (int32_t i = 0; i < n; i += kLanes) {
    const int32_t m = std::min<int32_t>(kLanes, n - i);
    for (int32_t k = 0; k < kLanes; ++k) buf[k] = k < m ? x[i + k] : 0.0f;
    store(buf, exp_nonpositive(load(buf)));
    for (int32_t k = 0; k < m; ++k) x[i + k] = buf[k];
  }
}

CC_INLINE void to_float(const uint16_t* src, float* dst, int64_t n) {
#if defined(__FLT16_MAX__)
  typedef _Float16 h16x __attribute__((vector_size(32)));
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    h16x h;
    std::memcpy(&h, src + i, sizeof(h));
    store(dst + i, __builtin_convertvector(h, f16x));
  }
  const auto* h = reinterpret_cast<const _Float16*>(src);
  for (; i < n; ++i) dst[i] = static_cast<float>(h[i]);
#else
  for (int64_t i = 0; i < n; ++i) {  // IEEE binary16 -> binary32
    const uint32_t x = src[i];
    const uint32_t sign = (x & 0x8000u) << 16;
    const uint32_t exp = (x >> 10) & 0x1f;
    uint32_t man = x & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
      bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
      bits = sign;
    } else {
      int32_t e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      bits = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    dst[i] = std::bit_cast<float>(bits);
  }
#endif
}

// ---- one piece

template <bool kHalf>
CC_INLINE void run_piece(const Work& w, const Piece& piece, float* scratch) {
  const Query& q = *w.q;
  const KvBuffers& kv = *w.kv;
  const AttendPlan& plan = *w.plan;
  const Block& block = w.blocks[piece.block];
  const int64_t hd = q.head_dim;
  const int64_t group = w.group;
  const int64_t rows = block.n_tok * group;
  const int64_t row_stride = kv.n_kv_heads * hd;
  float* state = w.state_data + piece.state;
  float* m = state;            // [rows]
  float* l = state + rows;     // [rows]
  float* acc = state + 2 * rows;  // [rows, hd]
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + rows * hd, 0.0f);

  float* scores = scratch;                 // [kTile]
  float* kbuf = scratch + kTile;           // [kTile, hd] fp16 -> fp32
  float* vbuf = kbuf + kTile * hd;         // [kTile, hd]
  const float* krow[kTile];
  const float* vrow[kTile];
  const float scaling = w.params.scaling;
  const float softcap = w.params.softcap;

  for (int32_t j0 = piece.lo; j0 < piece.hi; j0 += kTile) {
    const int32_t n = std::min<int32_t>(kTile, piece.hi - j0);
    for (int32_t jj = 0; jj < n; ++jj) {
      const int64_t off = static_cast<int64_t>(plan.cells[j0 + jj]) * row_stride +
                          piece.kv_head * hd;
      if constexpr (kHalf) {
        to_float(static_cast<const uint16_t*>(kv.k) + off, kbuf + jj * hd, hd);
        to_float(static_cast<const uint16_t*>(kv.v) + off, vbuf + jj * hd, hd);
        krow[jj] = kbuf + jj * hd;
        vrow[jj] = vbuf + jj * hd;
      } else {
        krow[jj] = static_cast<const float*>(kv.k) + off;
        vrow[jj] = static_cast<const float*>(kv.v) + off;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t tok = block.tok0 + r / group;
      const int64_t head = piece.kv_head * group + r % group;
      const int32_t b = std::max(plan.tok_begin[tok] - j0, 0);
      const int32_t e = std::min(plan.tok_end[tok] - j0, n);
      if (b >= e) continue;  // this row sees none of the tile
      const float* qr = q.data + (tok * q.n_heads + head) * hd;
      float tile_max = kNegInf;
      int32_t jj = b;
      for (; jj + 4 <= e; jj += 4) dot4(qr, krow + jj, hd, scores + jj);
      for (; jj < e; ++jj) scores[jj] = dot(qr, krow[jj], hd);
      for (jj = b; jj < e; ++jj) {
        float s = scores[jj] * scaling;
        if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
        scores[jj] = s;
        tile_max = std::max(tile_max, s);
      }
      const float m_new = std::max(m[r], tile_max);
      const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
      for (int32_t jj = b; jj < e; ++jj) scores[jj] -= m_new;
      exp_nonpositive(scores + b, e - b);
      float sum = 0.0f;
      for (int32_t jj = b; jj < e; ++jj) sum += scores[jj];
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      scale_accumulate(acc + r * hd, alpha, scores + b, vrow + b, e - b, hd);
    }
  }
}

template <bool kHalf>
CC_INLINE void run_pieces_body(const Work& w, int64_t begin, int64_t end) {
  std::vector<float> scratch(kTile + 2 * static_cast<size_t>(kTile) * w.q->head_dim);
  for (int64_t i = begin; i < end; ++i) run_piece<kHalf>(w, w.pieces[i], scratch.data());
}

// One instance per instruction set; the best the CPU supports is chosen at
// run time (the build targets baseline x86-64).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma,f16c,bmi2")))
void run_pieces_avx512(const Work& w, bool half, int64_t begin, int64_t end) {
  half ? run_pieces_body<true>(w, begin, end) : run_pieces_body<false>(w, begin, end);
}
__attribute__((target("avx2,fma,f16c,bmi2")))
void run_pieces_avx2(const Work& w, bool half, int64_t begin, int64_t end) {
  half ? run_pieces_body<true>(w, begin, end) : run_pieces_body<false>(w, begin, end);
}
#endif
void run_pieces_base(const Work& w, bool half, int64_t begin, int64_t end) {
  half ? run_pieces_body<true>(w, begin, end) : run_pieces_body<false>(w, begin, end);
}

using RunPieces = void (*)(const Work&, bool, int64_t, int64_t);

RunPieces pick_run_pieces() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return run_pieces_avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")) {
    return run_pieces_avx2;
  }
#endif
  return run_pieces_base;
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
  if (kv.dtype != KvDtype::kFloat32 && kv.dtype != KvDtype::kFloat16) {
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
    w.blocks.push_back({i, 1, plan.tok_begin[i], plan.tok_end[i]});
  }
}

void make_pieces(Work& w, int64_t threads) {
  const int64_t n_kv = w.kv->n_kv_heads;
  int64_t total = 0;
  for (const Block& b : w.blocks) total += static_cast<int64_t>(b.hi - b.lo) * n_kv;
  // Split only when there are threads to share the work; aim at ~4 pieces a
  // thread so one long sequence among short ones is spread too.
  int64_t piece = std::numeric_limits<int32_t>::max();
  if (threads > 1) {
    piece = std::max<int64_t>(kMinPiece, (total + 4 * threads - 1) / (4 * threads));
    piece = (piece + kTile - 1) / kTile * kTile;
  }
  int64_t state = 0;
  for (int32_t bi = 0; bi < static_cast<int32_t>(w.blocks.size()); ++bi) {
    const Block& b = w.blocks[bi];
    const int64_t rows = b.n_tok * w.group;
    for (int32_t h = 0; h < n_kv; ++h) {
      int32_t lo = b.lo;
      do {  // at least one piece, even for an empty range (its output is 0)
        const int32_t hi = static_cast<int32_t>(std::min<int64_t>(b.hi, lo + piece));
        w.pieces.push_back({bi, h, lo, hi, state});
        state += state_floats(rows, w.q->head_dim);
        lo = hi;
      } while (lo < b.hi);
    }
  }
  w.state.resize(static_cast<size_t>(state));
  w.state_data = w.state.data();
}

// Merges each (block, KV head)'s pieces (consecutive in w.pieces) into out.
void combine(const Work& w, float* out) {
  const Query& q = *w.q;
  const int64_t hd = q.head_dim;
  std::vector<float> acc(hd);
  size_t i = 0;
  while (i < w.pieces.size()) {
    size_t j = i;
    while (j < w.pieces.size() && w.pieces[j].block == w.pieces[i].block &&
           w.pieces[j].kv_head == w.pieces[i].kv_head) {
      ++j;
    }
    const Block& block = w.blocks[w.pieces[i].block];
    const int64_t rows = block.n_tok * w.group;
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
      const int64_t tok = block.tok0 + r / w.group;
      const int64_t head = w.pieces[i].kv_head * w.group + r % w.group;
      float* o = out + (tok * q.n_heads + head) * hd;
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < hd; ++d) o[d] = acc[d] * inv;
    }
    i = j;
  }
}

}  // namespace

Status attend(const Query& query, const KvBuffers& kv, const AttendPlan& plan,
              const Params& params, std::span<float> out, const Threads& threads) {
  Status s = check_inputs(query, kv, plan, out);
  if (!s.is_ok()) return s;
  Work w{&query, &kv, &plan, params, query.n_heads / kv.n_kv_heads, {}, {}, {}, nullptr};
  make_blocks(w);
  const int64_t n_threads = threads.run ? std::max<int64_t>(1, threads.count) : 1;
  make_pieces(w, n_threads);
  static const RunPieces run_pieces = pick_run_pieces();
  const bool half = kv.dtype == KvDtype::kFloat16;
  const int64_t n = static_cast<int64_t>(w.pieces.size());
  if (n_threads > 1 && n > 1) {
    threads.run(n, [&](int64_t begin, int64_t end) { run_pieces(w, half, begin, end); });
  } else {
    run_pieces(w, half, 0, n);
  }
  combine(w, out.data());
  return Status::ok();
}

}  // namespace cellcache::attention
