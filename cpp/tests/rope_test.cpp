// cellcache::rope's core (attention/rope.h) against RoPE written from its
// definition (RoFormer's rotation of each pair (x[i], x[i + half]) by the
// token's angle, in double, then rounded), and bit for bit against the
// separately rounded products of transformers' q * cos + rotate_half(q) * sin;
// bad input writes nothing.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention/rope.h"
#include "graph/graph_ops.h"
#include "check.h"

namespace {

using cellcache::StatusCode;
using cellcache::attention::RopeShape;

struct Case {
  RopeShape shape;
  std::vector<float> x, cos, sin;
};

// cos/sin of real angles (position * inverse frequency), as the models' tables hold.
Case make_case(int64_t n_tok, int64_t n_heads, int64_t head_dim, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Case c{{n_tok, n_heads, head_dim}, {}, {}, {}};
  c.x.resize(n_tok * n_heads * head_dim);
  for (float& v : c.x) v = normal(rng);
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t i = 0; i < head_dim; ++i) {
      const double inv_freq = std::pow(10000.0, -2.0 * static_cast<double>(i % half) / head_dim);
      const double angle = static_cast<double>(t * 7 + 3) * inv_freq;
      c.cos.push_back(static_cast<float>(std::cos(angle)));
      c.sin.push_back(static_cast<float>(std::sin(angle)));
    }
  }
  return c;
}

TEST(rope_rotates_each_pair_by_its_token_angle) {
  const Case c = make_case(5, 3, 16, 1);
  std::vector<float> out(c.x.size(), -1.0f);
  CHECK(cellcache::rope_op(c.shape, c.x, c.cos, c.sin, out).is_ok());
  const int64_t half = 8;
  double worst = 0;
  for (int64_t t = 0; t < 5; ++t) {
    for (int64_t h = 0; h < 3; ++h) {
      for (int64_t i = 0; i < half; ++i) {
        const int64_t row = (t * 3 + h) * 16;
        const double a = c.x[row + i], b = c.x[row + i + half];
        const double co = c.cos[t * 16 + i], si = c.sin[t * 16 + i];
        worst = std::fmax(worst, std::fabs(out[row + i] - (a * co - b * si)));
        worst = std::fmax(worst, std::fabs(out[row + i + half] - (b * co + a * si)));
      }
    }
  }
  CHECK(worst < 1e-5);
}

TEST(rope_rounds_each_product_as_eager_torch_does) {
  // q * cos + rotate_half(q) * sin, each op rounded to float: the same bits.
  const Case c = make_case(9, 4, 64, 2);
  std::vector<float> out(c.x.size());
  CHECK(cellcache::rope_op(c.shape, c.x, c.cos, c.sin, out).is_ok());
  int differ = 0;
  for (int64_t t = 0; t < 9; ++t) {
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i = 0; i < 64; ++i) {
        const int64_t row = (t * 4 + h) * 64;
        volatile float rotated = i < 32 ? -c.x[row + i + 32] : c.x[row + i - 32];
        volatile float p1 = c.x[row + i] * c.cos[t * 64 + i];
        volatile float p2 = rotated * c.sin[t * 64 + i];
        volatile float want = p1 + p2;
        differ += std::memcmp(&out[row + i], const_cast<float*>(&want), sizeof(float)) != 0;
      }
    }
  }
  CHECK_EQ(differ, 0);
}

TEST(rope_in_place_equals_out_of_place) {
  Case c = make_case(3, 2, 8, 3);
  std::vector<float> out(c.x.size());
  CHECK(cellcache::rope_op(c.shape, c.x, c.cos, c.sin, out).is_ok());
  CHECK(cellcache::rope_op(c.shape, c.x, c.cos, c.sin, c.x).is_ok());
  CHECK(std::memcmp(out.data(), c.x.data(), out.size() * sizeof(float)) == 0);
}

TEST(rope_of_no_tokens_is_ok) {
  std::vector<float> none;
  CHECK(cellcache::rope_op({0, 2, 8}, none, none, none, none).is_ok());
}

TEST(rope_refuses_bad_input_and_writes_nothing) {
  Case c = make_case(2, 2, 8, 4);
  auto code = [&](RopeShape shape, std::span<const float> x, std::span<const float> cos,
                  std::span<const float> sin, std::span<float> out) {
    std::vector<float> before(out.begin(), out.end());
    const StatusCode got = cellcache::rope_op(shape, x, cos, sin, out).code();
    CHECK(std::equal(before.begin(), before.end(), out.begin()));
    return got;
  };
  std::vector<float> out(c.x.size(), 5.0f);
  const auto bad = StatusCode::kInvalidConfig;
  CHECK(code({2, 2, 7}, c.x, c.cos, c.sin, out) == bad);           // odd head_dim
  CHECK(code({2, 2, 0}, c.x, c.cos, c.sin, out) == bad);
  CHECK(code({2, 0, 8}, c.x, c.cos, c.sin, out) == bad);
  CHECK(code({-1, 2, 8}, c.x, c.cos, c.sin, out) == bad);
  CHECK(code({3, 2, 8}, c.x, c.cos, c.sin, out) == bad);           // x too short
  CHECK(code({2, 2, 8}, std::span<const float>(c.x).first(31), c.cos, c.sin, out) == bad);
  CHECK(code({2, 2, 8}, c.x, std::span<const float>(c.cos).first(15), c.sin, out) == bad);
  CHECK(code({2, 2, 8}, c.x, c.cos, std::span<const float>(c.sin).first(8), out) == bad);
  CHECK(code({2, 2, 8}, c.x, c.cos, c.sin, std::span<float>(out).first(16)) == bad);
  CHECK(code({int64_t{1} << 40, int64_t{1} << 20, 1 << 20}, c.x, c.cos, c.sin, out) == bad);
  // out overlapping x by part, or overlapping the tables.
  std::vector<float> both(c.x.size() + 4, 1.0f);
  CHECK(code({2, 2, 8}, std::span<const float>(both).first(32),
             c.cos, c.sin, std::span<float>(both).subspan(4)) == bad);
  std::vector<float> table(c.cos);
  table.resize(32, 0.5f);
  CHECK(code({2, 2, 8}, c.x, std::span<const float>(table).first(16), c.sin,
             std::span<float>(table)) == bad);
  CHECK(cellcache::last_op_error().code() == bad);
  cellcache::clear_last_op_error();
}

}  // namespace

TEST(rope_shape_takes_a_row_per_token_laid_out_as_x_s_tokens) {
  using cellcache::attention::rope_shape;
  using V = std::vector<int64_t>;
  // [*tokens, head_dim] and [*tokens, 1, head_dim]; n_tok the token dims' product.
  for (const V& table : {V{2, 3, 8}, V{2, 3, 1, 8}}) {
    const auto shape = rope_shape(V{2, 3, 4, 8}, table, table);
    CHECK(shape.is_ok());
    CHECK_EQ(shape.value().n_tok, 6);
    CHECK_EQ(shape.value().n_heads, 4);
    CHECK_EQ(shape.value().head_dim, 8);
  }
  CHECK_EQ(rope_shape(V{4, 8}, V{8}, V{1, 8}).value().n_tok, 1);  // no token dims: one token
  CHECK_EQ(rope_shape(V{0, 4, 8}, V{0, 8}, V{0, 8}).value().n_tok, 0);
  // Six rows all the same, but per-head tables (or another token layout) to eager
  // broadcasting; head_dim, rank, a non-1 heads slot, a negative size, overflow.
  const V x{2, 3, 4, 8};
  for (const V& table : {V{3, 4, 8}, V{6, 8}, V{3, 2, 8}, V{2, 3, 2, 8}, V{2, 3, 6},
                         V{2, 3, 1, 1, 8}, V{1, 2, 3, 8}}) {
    const auto shape = rope_shape(x, table, V{2, 3, 8});
    CHECK(!shape.is_ok());
    CHECK(shape.status().code() == StatusCode::kInvalidConfig);
    CHECK(!rope_shape(x, V{2, 3, 8}, table).is_ok());  // sin alike
  }
  CHECK(!rope_shape(V{8}, V{8}, V{8}).is_ok());
  CHECK(!rope_shape(V{-2, 4, 8}, V{-2, 8}, V{-2, 8}).is_ok());
  const int64_t big = int64_t{1} << 40;
  CHECK(!rope_shape(V{big, big, 4, 8}, V{big, big, 8}, V{big, big, 8}).is_ok());
}
