// cellcache::write's core (attention/kv_write.h): rows land at their cells
// and nowhere else; fp32 -> fp16 rounds to nearest even, checked against a
// brute-force reference that searches the finite halves; bad input writes
// nothing.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention/kv_write.h"
#include "graph/graph_ops.h"
#include "check.h"

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
      CHECK(cellcache::write_op(cells, rows, {buf.data(), dtype, n_cells, row}).is_ok());
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
  const KvCache kv{cache.data(), KvDtype::kFloat32, n_cells, row};
  auto code = [&](std::vector<int64_t> cells, std::span<const float> r, KvCache c) {
    return cellcache::write_op(cells, r, c).code();
  };
  CHECK(code({0, 4}, rows, kv) == StatusCode::kInvalidConfig);   // one past the end
  CHECK(code({-1, 0}, rows, kv) == StatusCode::kInvalidConfig);
  CHECK(code({0, int64_t{1} << 40}, rows, kv) == StatusCode::kInvalidConfig);
  CHECK(code({0}, rows, kv) == StatusCode::kInvalidConfig);      // 2 rows for 1 cell
  CHECK(code({0, 1}, std::span<const float>(rows).first(5), kv) == StatusCode::kInvalidConfig);
  CHECK(code({0, 1}, rows, {nullptr, KvDtype::kFloat32, n_cells, row}) ==
        StatusCode::kInvalidConfig);
  CHECK(code({0, 1}, rows, {cache.data(), static_cast<KvDtype>(7), n_cells, row}) ==
        StatusCode::kInvalidConfig);
  // Rows inside the cache itself (memcpy of overlapping memory), and buffers
  // off their element alignment.
  CHECK(code({1, 2}, std::span<const float>(cache).first(2 * row), kv) ==
        StatusCode::kInvalidConfig);
  std::vector<unsigned char> raw((n_cells * row + 1) * sizeof(float));
  CHECK(code({0}, std::span<const float>(rows).first(row),
             {raw.data() + 1, KvDtype::kFloat16, n_cells, row}) == StatusCode::kInvalidConfig);
  for (float x : cache) CHECK(x == 7.0f);  // every refusal left the cache as it was
  CHECK(code({}, {}, kv) == StatusCode::kOk);  // an empty write is a no-op, not an error
  CHECK(!cellcache::last_op_error().is_ok());  // remembered for the runner's report
  cellcache::clear_last_op_error();
}
