#include "attention/kv_write.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define CC_HAVE_F16C_PATH 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define CC_HAVE_NEON_PATH 1
#endif

namespace cellcache::attention {

uint16_t float_to_half(float x) {
  // Subnormal halves: x + 0.5f has an ulp of 2^-24, the subnormal half's, so
  // the FPU's own rounding (to nearest even) leaves the half's bits at the
  // bottom of the sum. Normal ones: rebias the exponent and round the 13
  // dropped mantissa bits by an integer add (ties to even through mant_odd).
  constexpr uint32_t kInf32 = 0xffu << 23;
  constexpr uint32_t kHalfOverflow = (127u + 16) << 23;  // 2^16: inf or NaN from here
  constexpr uint32_t kMinNormal = 113u << 23;            // 2^-14, the smallest normal half
  constexpr uint32_t kDenormMagic = 126u << 23;            // 0.5f
  uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint16_t h;
  if (u >= kHalfOverflow) {
    h = u > kInf32 ? 0x7e00u : 0x7c00u;
  } else if (u < kMinNormal) {
    const float f = std::bit_cast<float>(u) + std::bit_cast<float>(kDenormMagic);
    h = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) - kDenormMagic);
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;
    h = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(h | sign);
}

void quantize_int8_head(const float* x, int64_t head_dim, int8_t* out) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < head_dim; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && a <= std::numeric_limits<float>::max();  // false for inf and NaN
    amax = std::max(amax, a);
  }
  float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
  if (!finite || scale == 0.0f) {
    std::fill(out, out + head_dim, int8_t{0});
  } else {
    for (int64_t i = 0; i < head_dim; ++i) {
      const float r = std::nearbyint(x[i] / scale);  // ties to even (default environment)
      out[i] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
    }
  }
  std::memcpy(out + head_dim, &scale, sizeof(scale));
}

namespace {

void to_half_scalar(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_half(src[i]);
}

#ifdef CC_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) void to_half_f16c(const float* src, uint16_t* dst,
                                                       int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  to_half_scalar(src + i, dst + i, n - i);
}
#endif

#ifdef CC_HAVE_NEON_PATH
// fcvtn/fcvtn2 round to nearest even (the FPCR's default mode, which nothing
// here changes), as float_to_half and vcvtps2ph do. Every AArch64 CPU has them.
void to_half_neon(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(vld1q_f32(src + i)), vld1q_f32(src + i + 4));
    vst1q_u16(dst + i, vreinterpretq_u16_f16(h));
  }
  to_half_scalar(src + i, dst + i, n - i);
}
#endif

using ToHalf = void (*)(const float*, uint16_t*, int64_t);

ToHalf pick_to_half() {
#ifdef CC_HAVE_F16C_PATH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) return to_half_f16c;
#endif
#ifdef CC_HAVE_NEON_PATH
  return to_half_neon;
#endif
  return to_half_scalar;
}

}  // namespace

Status write_rows(std::span<const int64_t> cells, std::span<const float> rows,
                  const KvCache& cache) {
  auto bad = [](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "write: " + what);
  };
  if (cache.data == nullptr || cache.n_cells < 1 || cache.n_kv_heads < 1 || cache.head_dim < 1) {
    return bad("the K/V buffer is null or empty");
  }
  if (cache.dtype != KvDtype::kFloat32 && cache.dtype != KvDtype::kFloat16 &&
      cache.dtype != KvDtype::kInt8) {
    return bad("unsupported K/V dtype");
  }
  const int64_t n = static_cast<int64_t>(cells.size());
  const int64_t row_elems = cache.n_kv_heads * cache.head_dim;  // fp32 values a row brings
  if (static_cast<int64_t>(rows.size()) != n * row_elems) {
    return bad(std::to_string(rows.size()) + " values for " + std::to_string(n) +
               " cells of " + std::to_string(row_elems) + " elements");
  }
  const size_t elem = cache.dtype == KvDtype::kFloat32 ? sizeof(float)
                      : cache.dtype == KvDtype::kFloat16 ? sizeof(uint16_t) : sizeof(int8_t);
  const auto row_bytes =
      static_cast<size_t>(cache.n_kv_heads * kv_head_bytes(cache.dtype, cache.head_dim));
  const auto cache_begin = reinterpret_cast<uintptr_t>(cache.data);
  const uintptr_t cache_end = cache_begin + static_cast<size_t>(cache.n_cells) * row_bytes;
  const auto rows_begin = reinterpret_cast<uintptr_t>(rows.data());
  const uintptr_t rows_end = rows_begin + rows.size() * sizeof(float);
  if (cache_begin % elem != 0 || rows_begin % sizeof(float) != 0) {
    return bad("the K/V buffer or the rows are not aligned to their element size");
  }
  if (!rows.empty() && rows_begin < cache_end && cache_begin < rows_end) {
    return bad("the rows overlap the K/V buffer they are written into");
  }
  for (int64_t c : cells) {
    if (c < 0 || c >= cache.n_cells) {
      return bad("cell " + std::to_string(c) + " lies outside the K/V buffer of " +
                 std::to_string(cache.n_cells) + " cells");
    }
  }
  const size_t row = static_cast<size_t>(row_elems);
  char* base = static_cast<char*>(cache.data);
  switch (cache.dtype) {
    case KvDtype::kFloat32:
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(base + static_cast<size_t>(cells[i]) * row_bytes, rows.data() + i * row,
                    row_bytes);
      }
      break;
    case KvDtype::kFloat16: {
      static const ToHalf to_half = pick_to_half();
      for (int64_t i = 0; i < n; ++i) {
        auto* dst = reinterpret_cast<uint16_t*>(base + static_cast<size_t>(cells[i]) * row_bytes);
        to_half(rows.data() + i * row, dst, static_cast<int64_t>(row));
      }
      break;
    }
    case KvDtype::kInt8: {
      const int64_t hd = cache.head_dim;
      const int64_t head_bytes = kv_head_bytes(KvDtype::kInt8, hd);
      for (int64_t i = 0; i < n; ++i) {
        auto* dst = reinterpret_cast<int8_t*>(base + static_cast<size_t>(cells[i]) * row_bytes);
        for (int64_t h = 0; h < cache.n_kv_heads; ++h) {
          quantize_int8_head(rows.data() + i * row + h * hd, hd, dst + h * head_bytes);
        }
      }
      break;
    }
  }
  return Status::ok();
}

}  // namespace cellcache::attention
