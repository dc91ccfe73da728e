#include "attention/rope.h"

#include <algorithm>
#include <cstddef>
#include <string>

namespace cellcache::attention {

namespace {

bool overlap(std::span<const float> a, std::span<const float> b) {
  return !a.empty() && !b.empty() && a.data() < b.data() + b.size() &&
         b.data() < a.data() + a.size();
}

}  // namespace

Result<RopeShape> rope_shape(std::span<const int64_t> x, std::span<const int64_t> cos,
                             std::span<const int64_t> sin) {
  const auto bad = [](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "rope: " + what);
  };
  if (x.size() < 2) return bad("x must be [*tokens, n_heads, head_dim]");
  const std::span<const int64_t> tokens = x.first(x.size() - 2);
  for (const std::span<const int64_t> table : {cos, sin}) {
    const bool plain = table.size() == tokens.size() + 1;
    const bool broadcast = table.size() == tokens.size() + 2 && table[tokens.size()] == 1;
    if ((!plain && !broadcast) || table.back() != x.back() ||
        !std::equal(tokens.begin(), tokens.end(), table.begin())) {
      return bad("cos and sin must be [*tokens, head_dim] or [*tokens, 1, head_dim] for x "
                 "[*tokens, n_heads, head_dim]");
    }
  }
  int64_t n_tok = 1;
  for (const int64_t size : tokens) {
    if (size < 0) return bad("a negative size");
    if (__builtin_mul_overflow(n_tok, size, &n_tok)) return bad("x's token count overflows");
  }
  return RopeShape{n_tok, x[x.size() - 2], x.back()};
}

Status apply_rope(const RopeShape& shape, std::span<const float> x, std::span<const float> cos,
                  std::span<const float> sin, std::span<float> out) {
  auto bad = [](const std::string& what) {
    return Status(StatusCode::kInvalidConfig, "rope: " + what);
  };
  if (shape.n_heads < 1 || shape.head_dim < 2 || shape.head_dim % 2 != 0 || shape.n_tok < 0) {
    return bad("n_heads must be >= 1, head_dim even and >= 2 and n_tok >= 0; got n_tok " +
               std::to_string(shape.n_tok) + ", n_heads " + std::to_string(shape.n_heads) +
               ", head_dim " + std::to_string(shape.head_dim));
  }
  int64_t head_elems = 0, n_x_elems = 0, n_table_elems = 0;
  if (__builtin_mul_overflow(shape.n_heads, shape.head_dim, &head_elems) ||
      __builtin_mul_overflow(shape.n_tok, head_elems, &n_x_elems) ||
      __builtin_mul_overflow(shape.n_tok, shape.head_dim, &n_table_elems)) {
    return bad("n_tok * n_heads * head_dim overflows");
  }
  const auto n_x = static_cast<size_t>(n_x_elems);
  const auto n_table = static_cast<size_t>(n_table_elems);
  if (x.size() != n_x || out.size() != n_x) {
    return bad("x and out must hold n_tok * n_heads * head_dim = " + std::to_string(n_x) +
               " values, got " + std::to_string(x.size()) + " and " + std::to_string(out.size()));
  }
  if (cos.size() != n_table || sin.size() != n_table) {
    return bad("cos and sin must hold n_tok * head_dim = " + std::to_string(n_table) +
               " values, got " + std::to_string(cos.size()) + " and " +
               std::to_string(sin.size()));
  }
  const std::span<const float> o(out.data(), out.size());
  if ((o.data() != x.data() && overlap(o, x)) || overlap(o, cos) || overlap(o, sin)) {
    return bad("out overlaps x (other than being x), cos or sin");
  }
  const int64_t half = shape.head_dim / 2;
  for (int64_t t = 0; t < shape.n_tok; ++t) {
    const float* c = cos.data() + t * shape.head_dim;
    const float* s = sin.data() + t * shape.head_dim;
    for (int64_t h = 0; h < shape.n_heads; ++h) {
      const int64_t row = (t * shape.n_heads + h) * shape.head_dim;
      const float* xr = x.data() + row;
      float* yr = out.data() + row;
      for (int64_t i = 0; i < half; ++i) {
        const float lo = xr[i];
        const float hi = xr[i + half];
        yr[i] = lo * c[i] - hi * s[i];
        yr[i + half] = hi * c[i + half] + lo * s[i + half];
      }
    }
  }
  return Status::ok();
}

}  // namespace cellcache::attention
