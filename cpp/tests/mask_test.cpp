// Core tests: masks (windows in positions, sequence isolation, buffer reuse).
#include "core_test_util.h"

using namespace cellcache;
using namespace cellcache_test;

TEST(window_is_measured_in_positions_not_cells) {
  auto c = make(16, {2});
  seq_t a = new_seq(*c);
  step(*c, {a}, {0});
  CHECK(declare(*c, {a}));
  auto r = c->place_step(std::vector<int64_t>{5}, 0);  // a gap: cell 1 holds position 5
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 0), {5}));
  CHECK_INVARIANTS(*c);
}

TEST(window_edges_see_exactly_w_positions) {
  auto c = make(32, {4, kFull});
  seq_t a = new_seq(*c);
  CHECK(declare(*c, {a, a, a, a, a, a}));
  std::vector<int64_t> pos = {0, 1, 2, 3, 4, 5};
  auto w = c->place_step(pos, 0);
  CHECK_OK(w);
  CHECK(same(attended(*c, w.value(), 3), {0, 1, 2, 3}));
  CHECK(same(attended(*c, w.value(), 4), {1, 2, 3, 4}));
  CHECK(same(attended(*c, w.value(), 5), {2, 3, 4, 5}));
  auto f = c->place_step(pos, 1);
  CHECK_OK(f);
  CHECK(same(attended(*c, f.value(), 5), {0, 1, 2, 3, 4, 5}));
  CHECK(window_sees(4, 2, 5));
  CHECK(!window_sees(4, 1, 5));
  CHECK(!window_sees(kFull, 6, 5));
  CHECK_INVARIANTS(*c);
}

TEST(sequences_see_only_their_own_cells) {
  auto c = make(32, {2});
  seq_t a = new_seq(*c);
  seq_t b = new_seq(*c);
  CHECK(declare(*c, {a, a, a, b, b}));
  auto r = c->place_step(std::vector<int64_t>{0, 1, 2, 0, 1}, 0);
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 2), {1, 2}));
  CHECK(same(attended(*c, r.value(), 4), {0, 1}));
  CHECK(declare(*c, {b, a}));
  r = c->place_step(std::vector<int64_t>{2, 3}, 0);
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 0), {1, 2}));
  CHECK(same(attended(*c, r.value(), 1), {2, 3}));
  CHECK_INVARIANTS(*c);
}

TEST(mask_buffer_is_reused_when_shapes_repeat) {
  auto c = make(64);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a, a}, {0, 1, 2, 3});
  seq_t b = new_seq(*c);
  CHECK(declare(*c, {a, b}));
  const uint8_t* first = c->place_step(std::vector<int64_t>{4, 0}, 0).value().mask.data();
  CHECK_OK(c->seq_rm(a, 4));
  CHECK_OK(c->seq_rm(b));
  CHECK(declare(*c, {a, b}));
  const uint8_t* second = c->place_step(std::vector<int64_t>{4, 0}, 0).value().mask.data();
  CHECK(first == second);
  CHECK_INVARIANTS(*c);
}
