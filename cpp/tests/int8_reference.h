// The int8 K/V rule of attention/kv_int8.h, written again from its text for
// the tests (double arithmetic, rounding by hand), independent of the code
// under test: quantize one head, dequantize a buffer.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace int8_reference {

constexpr int64_t kScaleBytes = 4;

// fl(a / b) for binary32 a, b: the double quotient rounded once more to
// binary32 is the correctly rounded binary32 quotient (53 >= 2 * 24 + 2).
inline float div_f32(float a, float b) {
  return static_cast<float>(static_cast<double>(a) / static_cast<double>(b));
}

// Round half to even, by hand.
inline double round_half_even(double r) {
  const double f = std::floor(r);
  const double frac = r - f;
  if (frac > 0.5) return f + 1;
  if (frac < 0.5) return f;
  return std::fmod(f, 2.0) == 0.0 ? f : f + 1;
}

// One head by the rule: q[0..hd) and the scale.
inline void quantize(const float* x, int64_t hd, int8_t* q, float* scale) {
  double amax = 0;
  bool finite = true;
  for (int64_t i = 0; i < hd; ++i) {
    if (!std::isfinite(x[i])) finite = false;
    amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  }
  if (!finite) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = 0; i < hd; ++i) q[i] = 0;
    return;
  }
  *scale = div_f32(static_cast<float>(amax), 127.0f);
  for (int64_t i = 0; i < hd; ++i) {
    if (*scale == 0.0f) {
      q[i] = 0;
      continue;
    }
    const double r = round_half_even(div_f32(x[i], *scale));
    q[i] = static_cast<int8_t>(r > 127 ? 127 : r < -127 ? -127 : r);
  }
}

// fp32 K (or V) [..., hd] -> the values the rule reads back,
// fl(q * scale) (NaN for a head stored with a NaN scale).
inline std::vector<float> round_trip(const std::vector<float>& x, int64_t hd) {
  std::vector<float> out(x.size());
  std::vector<int8_t> q(hd);
  const int64_t heads = static_cast<int64_t>(x.size()) / hd;
  for (int64_t h = 0; h < heads; ++h) {
    float scale;
    quantize(&x[h * hd], hd, q.data(), &scale);
    for (int64_t i = 0; i < hd; ++i) {
      out[h * hd + i] = static_cast<float>(static_cast<double>(q[i]) * scale);
    }
  }
  return out;
}

}  // namespace int8_reference
