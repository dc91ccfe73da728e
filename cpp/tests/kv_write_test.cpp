// cellcache::write's core (attention/kv_write.h): rows land at their cells
// and nowhere else; fp32 -> fp16 rounds to nearest even, checked against a
// brute-force reference that searches the finite halves; int8 heads equal
// kv_int8.h's rule (tests/int8_reference.h) bit for bit; bad input writes
// nothing.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention/kv_write.h"
#include "graph/graph_ops.h"
#include "check.h"
#include "int8_reference.h"

namespace {

using cellcache::StatusCode;
using cellcache::attention::float_to_half;
using cellcache::attention::KvCache;
using cellcache::attention::KvDtype;

double half_value(uint16_t h) {  // exact, from the IEEE binary16 definition
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  const double mag = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Round to nearest, ties to the even bit pattern, over the finite halves;
// 0x7c00 (inf) counts as the value 65536, the next step after 65504.
uint16_t reference_half(float x) {
  if (std::isnan(x)) return 0x7e00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  auto value = [](uint16_t h) { return h == 0x7c00 ? 65536.0 : half_value(h); };
  if (a >= 65536.0) return sign | 0x7c00;
  uint16_t lo = 0, hi = 0x7c00;  // value(lo) <= a < value(hi)
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    (value(mid) <= a ? lo : hi) = mid;
  }
  const double dl = a - value(lo), dh = value(hi) - a;
  const uint16_t pick = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
  return sign | pick;
}

bool same_half(uint16_t got, uint16_t want) {
  const bool nan_got = (got & 0x7c00) == 0x7c00 && (got & 0x3ff);
  const bool nan_want = (want & 0x7c00) == 0x7c00 && (want & 0x3ff);
  return nan_got || nan_want ? nan_got == nan_want : got == want;
}

std::vector<float> test_values() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.996f, 65520.0f, 65536.0f,
                          1e30f, -1e30f, INFINITY, -INFINITY, NAN, 6.1035156e-05f /* 2^-14 */,
                          5.9604645e-08f /* 2^-24 */, 2.9802322e-08f /* 2^-25: tie to 0 */,
                          8.940697e-08f /* 1.5 * 2^-24: tie to 2^-23 */, 1e-10f,
                          std::nextafter(6.1035156e-05f, 0.0f)};
  for (uint16_t h = 0; h < 0x7c00; h += 7) {  // halfway points between neighbouring halves
    const double mid = (half_value(h) + half_value(static_cast<uint16_t>(h + 1))) / 2;
    v.push_back(static_cast<float>(mid));
    v.push_back(std::nextafter(static_cast<float>(mid), 0.0f));
    v.push_back(-std::nextafter(static_cast<float>(mid), 1e9f));
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 20000; ++i) v.push_back(std::bit_cast<float>(bits(rng)));
  std::uniform_real_distribution<float> normal(-8.0f, 8.0f);
  for (int i = 0; i < 5000; ++i) v.push_back(normal(rng));
  return v;
}

}  // namespace

TEST(float_to_half_rounds_to_nearest_even) {
  for (float x : test_values()) {
    const uint16_t got = float_to_half(x), want = reference_half(x);
    if (!same_half(got, want)) {
      CHECK(same_half(got, want));
      std::fprintf(stderr, "  x = %.9g (0x%08x): got 0x%04x, want 0x%04x\n", x,
                   std::bit_cast<uint32_t>(x), got, want);
      break;
    }
  }
}

TEST(write_converts_rows_into_their_cells_only) {
  const std::vector<float> values = test_values();
  const int64_t row = 24;  // 3 KV heads x head_dim 8: the vector path and its tail
  const int64_t n_cells = 16;
  const std::vector<int64_t> cells = {9, 2, 15};
  for (KvDtype dtype : {KvDtype::kFloat32, KvDtype::kFloat16}) {
    for (size_t start = 0; start + cells.size() * row <= values.size(); start += 997) {
      const size_t elem = dtype == KvDtype::kFloat16 ? 2 : 4;
      std::vector<unsigned char> buf(n_cells * row * elem, 0xab);
      const std::vector<unsigned char> before = buf;
      std::vector<float> rows(values.begin() + start, values.begin() + start + cells.size() * row);
      CHECK(cellcache::write_op(cells, rows, {buf.data(), dtype, n_cells, 3, 8}).is_ok());
      for (int64_t c = 0; c < n_cells; ++c) {
        const auto it = std::find(cells.begin(), cells.end(), c);
        for (int64_t e = 0; e < row; ++e) {
          const size_t at = (c * row + e) * elem;
          if (it == cells.end()) {
            CHECK(std::memcmp(buf.data() + at, before.data() + at, elem) == 0);
            continue;
          }
          const float x = rows[(it - cells.begin()) * row + e];
          if (dtype == KvDtype::kFloat32) {
            float got;
            std::memcpy(&got, buf.data() + at, 4);
            CHECK(std::memcmp(&got, &x, 4) == 0);
          } else {
            uint16_t got;
            std::memcpy(&got, buf.data() + at, 2);
            CHECK(same_half(got, reference_half(x)));
          }
        }
      }
    }
  }
}

TEST(write_refuses_bad_input_and_writes_nothing) {
  const int64_t row = 4, n_cells = 4;
  std::vector<float> cache(n_cells * row, 7.0f);
  const std::vector<float> rows(2 * row, 1.0f);
  const KvCache kv{cache.data(), KvDtype::kFloat32, n_cells, 1, row};
  auto code = [&](std::vector<int64_t> cells, std::span<const float> r, KvCache c) {
    return cellcache::write_op(cells, r, c).code();
  };
  CHECK(code({0, 4}, rows, kv) == StatusCode::kInvalidConfig);   // one past the end
  CHECK(code({-1, 0}, rows, kv) == StatusCode::kInvalidConfig);
  CHECK(code({0, int64_t{1} << 40}, rows, kv) == StatusCode::kInvalidConfig);
  CHECK(code({0}, rows, kv) == StatusCode::kInvalidConfig);      // 2 rows for 1 cell
  CHECK(code({0, 1}, std::span<const float>(rows).first(5), kv) == StatusCode::kInvalidConfig);
  CHECK(code({0, 1}, rows, {nullptr, KvDtype::kFloat32, n_cells, 1, row}) ==
        StatusCode::kInvalidConfig);
  CHECK(code({0, 1}, rows, {cache.data(), static_cast<KvDtype>(7), n_cells, 1, row}) ==
        StatusCode::kInvalidConfig);
  // Rows inside the cache itself (memcpy of overlapping memory), and buffers
  // off their element alignment.
  CHECK(code({1, 2}, std::span<const float>(cache).first(2 * row), kv) ==
        StatusCode::kInvalidConfig);
  std::vector<unsigned char> raw((n_cells * row + 1) * sizeof(float));
  CHECK(code({0}, std::span<const float>(rows).first(row),
             {raw.data() + 1, KvDtype::kFloat16, n_cells, 1, row}) == StatusCode::kInvalidConfig);
  for (float x : cache) CHECK(x == 7.0f);  // every refusal left the cache as it was
  CHECK(code({}, {}, kv) == StatusCode::kOk);  // an empty write is a no-op, not an error
  CHECK(!cellcache::last_op_error().is_ok());  // remembered for the runner's report
  cellcache::clear_last_op_error();
}

namespace {

// Heads of hd values that exercise the int8 rule: random magnitudes from
// subnormal to near FLT_MAX, zeros, ties, and non-finite values.
std::vector<std::vector<float>> int8_heads(int64_t hd, std::mt19937& rng) {
  std::vector<std::vector<float>> heads;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-45, 37);
  for (int i = 0; i < 60; ++i) {
    const float mag = std::pow(10.0f, static_cast<float>(exponent(rng)));
    std::vector<float> h(hd);
    for (float& x : h) x = normal(rng) * mag;
    heads.push_back(h);
  }
  const float fmax = std::numeric_limits<float>::max();
  const float tiny = std::numeric_limits<float>::denorm_min();
  for (float fill : {0.0f, -0.0f, fmax, -fmax, tiny, 1e-40f, 1e-39f, 1.1754944e-38f, 1e-44f}) {
    std::vector<float> h(hd, fill);
    if (hd > 1) h[hd / 2] = -fill / 3;
    heads.push_back(h);
  }
  for (float special : {INFINITY, -INFINITY, NAN}) {
    std::vector<float> h(hd, 1.5f);
    h[hd - 1] = special;
    heads.push_back(h);
  }
  std::vector<float> mixed(hd, 1e-30f);  // one huge value: the rest quantize to 0
  mixed[0] = 3e38f;
  heads.push_back(mixed);
  return heads;
}

}  // namespace

TEST(write_int8_stores_each_head_by_the_rule_bit_for_bit) {
  std::mt19937 rng(3);
  for (int64_t hd : {1, 7, 8, 16, 32, 64, 72}) {
    const int64_t n_kv = 3, n_cells = 5, stored = hd + 4;
    const std::vector<std::vector<float>> heads = int8_heads(hd, rng);
    for (size_t first = 0; first < heads.size(); first += 2 * n_kv) {
      // Two cells (4 and 1) of n_kv heads each, taken in turn from `heads`.
      const std::vector<int64_t> cells = {4, 1};
      std::vector<float> rows;
      for (int64_t j = 0; j < 2 * n_kv; ++j) {
        const auto& h = heads[(first + j) % heads.size()];
        rows.insert(rows.end(), h.begin(), h.end());
      }
      std::vector<int8_t> buf(n_cells * n_kv * stored, 0x5a);
      CHECK(cellcache::write_op(cells, rows, {buf.data(), KvDtype::kInt8, n_cells, n_kv, hd}).is_ok());
      for (int64_t c = 0; c < n_cells; ++c) {
        const auto it = std::find(cells.begin(), cells.end(), c);
        for (int64_t h = 0; h < n_kv; ++h) {
          const int8_t* got = &buf[(c * n_kv + h) * stored];
          if (it == cells.end()) {  // not written
            for (int64_t b = 0; b < stored; ++b) CHECK_EQ(got[b], int8_t{0x5a});
            continue;
          }
          const float* x = &rows[((it - cells.begin()) * n_kv + h) * hd];
          std::vector<int8_t> want(hd);
          float want_scale;
          int8_reference::quantize(x, hd, want.data(), &want_scale);
          const float got_scale = cellcache::attention::int8_head_scale(got, hd);
          CHECK(std::memcmp(got, want.data(), hd) == 0);
          CHECK(std::memcmp(&got_scale, &want_scale, 4) == 0);  // bits, NaN included
          if (!(got_scale >= std::numeric_limits<float>::min())) continue;  // NaN, 0, subnormal
          // What the rule promises for a normal scale: each value reads back
          // within half a step (a subnormal scale is rounded too coarsely).
          for (int64_t i = 0; i < hd; ++i) {
            CHECK(got[i] >= -127);
            const double back = static_cast<double>(got[i]) * got_scale;
            CHECK(std::abs(back - x[i]) <= 0.5 * got_scale * (1 + 1e-6) + 1e-45);
          }
        }
      }
    }
  }
}

TEST(write_int8_rounds_ties_to_even_and_marks_non_finite_heads) {
  // Hand-worked: amax 127 gives scale 1, so x / scale = x exactly.
  const std::vector<float> x = {127.0f, 2.5f, 3.5f, -2.5f, 0.5f, 1.5f, -126.5f, -0.49f};
  const std::vector<int8_t> want = {127, 2, 4, -2, 0, 2, -126, 0};
  std::vector<int8_t> buf(x.size() + 4);
  const int64_t hd = static_cast<int64_t>(x.size());
  CHECK(cellcache::write_op(std::vector<int64_t>{0}, x, {buf.data(), KvDtype::kInt8, 1, 1, hd}).is_ok());
  CHECK(std::equal(want.begin(), want.end(), buf.begin()));
  CHECK_EQ(cellcache::attention::int8_head_scale(buf.data(), hd), 1.0f);
  // 1e-44 / 127 underflows to a zero scale: all zeros; one NaN: NaN scale, zeros.
  for (float special : {1e-44f, NAN}) {
    std::vector<float> y(hd, 1.0f);
    if (special == special) std::fill(y.begin(), y.end(), special); else y[2] = special;
    CHECK(cellcache::write_op(std::vector<int64_t>{0}, y, {buf.data(), KvDtype::kInt8, 1, 1, hd}).is_ok());
    for (int64_t i = 0; i < hd; ++i) CHECK_EQ(buf[i], int8_t{0});
    const float s = cellcache::attention::int8_head_scale(buf.data(), hd);
    CHECK(special == special ? s == 0.0f : std::isnan(s));
  }
}

TEST(write_int8_refuses_a_head_dim_the_buffer_cannot_hold) {
  std::vector<int8_t> buf(2 * (4 + 4));
  const std::vector<float> rows(4, 1.0f);
  CHECK(cellcache::write_op(std::vector<int64_t>{0}, rows, {buf.data(), KvDtype::kInt8, 2, 1, 0})
            .code() == StatusCode::kInvalidConfig);
  CHECK(cellcache::write_op(std::vector<int64_t>{2}, rows, {buf.data(), KvDtype::kInt8, 2, 1, 4})
            .code() == StatusCode::kInvalidConfig);  // a cell past the end
  for (int8_t b : buf) CHECK_EQ(b, int8_t{0});
  cellcache::clear_last_op_error();
}
