// Core tests: one pool per window policy and reclaim (cell_pool.h, issue #25):
// config errors, bounded windowed pools, reclaim shared by forks, refusals
// below what a pool holds, the attention plan's anchor, admission per pool,
// and a differential against a cache that never reclaims (every token must
// attend the same positions). check_invariants() after each verb.
#include <random>
#include <string>

#include "cellcache/admission.h"
#include "core_test_util.h"

using namespace cellcache;
using namespace cellcache_test;

namespace {

std::unique_ptr<CellCache> make_pooled(int32_t n_cells, std::vector<Window> windows,
                                       std::vector<WindowPool> pools, int32_t margin) {
  auto r = CellCache::create(CacheConfig(n_cells, static_cast<int32_t>(windows.size()),
                                         windows, pools, margin));
  if (!r.is_ok()) return nullptr;
  return std::move(r.value());
}

// Positions of the cells token i of `layer`'s step may attend, sorted, read
// in the layer's pool.
std::vector<pos_t> attended_in(const CellCache& c, int32_t layer, const LayerStep& s, int32_t i) {
  const auto positions = c.pool_state(c.pool_of(layer).value()).value().cell_positions;
  std::vector<pos_t> out;
  for (int32_t j = 0; j < s.used_end; ++j) {
    if (s.mask[static_cast<size_t>(i) * s.used_end + j]) out.push_back(positions[j]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Positions held in a pool (by any sequence), sorted.
std::vector<pos_t> held_in(const CellCache& c, int32_t pool) {
  std::vector<pos_t> out;
  const PoolState state = c.pool_state(pool).value();
  for (pos_t p : state.cell_positions) {
    if (p >= 0) out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<pos_t> range(pos_t lo, pos_t hi) {
  std::vector<pos_t> out;
  for (pos_t p = lo; p < hi; ++p) out.push_back(p);
  return out;
}

// One token of each of `seqs` at its next position, every layer.
void decode(CellCache& c, std::vector<seq_t> seqs) {
  std::vector<int64_t> positions;
  for (seq_t s : seqs) positions.push_back(c.next_pos(s).value());
  step(c, seqs, positions);
}

}  // namespace

TEST(pool_configs_that_do_not_fit_the_layers_are_named) {
  const std::vector<Window> gemma = {4, 4, kFull};
  struct Bad {
    std::vector<Window> windows;
    std::vector<WindowPool> pools;
    int32_t margin;
    std::string names;
  };
  const std::vector<Bad> bad = {
      {gemma, {{8, 20}}, 2, "window_cells for window 8: no layer has that window"},
      {gemma, {{4, 20}, {4, 30}}, 2, "window_cells for window 4 given twice, got 20 and 30"},
      {gemma, {{4, 6}}, 2, "window_cells for window 4 must lie in [7, "},  // W + R + 1
      {{4, 2}, {{4, 20}}, 2, "window 2 has none"},
      {gemma, {{4, 20}}, -1, "retained_margin must lie in [0, "},
      {{kFull}, {{4, 20}}, 0, "no layer has that window"},
  };
  for (const Bad& b : bad) {
    auto r = CellCache::create(CacheConfig(16, static_cast<int32_t>(b.windows.size()), b.windows,
                                           b.pools, b.margin));
    CHECK_CODE(r, StatusCode::kInvalidConfig);
    CHECK(r.status().message().find(b.names) != std::string::npos);
  }
  CHECK(make_pooled(16, gemma, {{4, 7}}, 2) != nullptr);  // the least size fits
}

TEST(one_policy_and_no_window_pools_keep_a_single_pool) {
  auto mistral = make(32, {4, 4});
  CHECK_EQ(mistral->n_pools(), 1);
  CHECK(!mistral->pool_state(0).value().reclaims);
  auto gemma = make(32, {4, kFull});
  CHECK_EQ(gemma->n_pools(), 1);
  CHECK_EQ(gemma->pool_of(1).value(), 0);
  seq_t a = new_seq(*mistral);
  for (int i = 0; i < 20; ++i) decode(*mistral, {a});
  CHECK_EQ(mistral->free_cells(), 12);  // nothing reclaimed
  CHECK_CODE(mistral->pool_state(1), StatusCode::kInvalidConfig);
  CHECK_INVARIANTS(*mistral);
}

TEST(pools_follow_the_layers_in_order_of_first_appearance) {
  auto c = make_pooled(40, {4, 4, kFull, 8, 4}, {{8, 20}, {4, 10}}, 1);
  CHECK(c != nullptr);
  CHECK_EQ(c->n_pools(), 3);
  const std::vector<int32_t> want = {0, 0, 1, 2, 0};
  for (int32_t l = 0; l < 5; ++l) CHECK_EQ(c->pool_of(l).value(), want[l]);
  CHECK_EQ(c->pool_state(0).value().capacity, 10);
  CHECK_EQ(c->pool_state(1).value().capacity, 40);
  CHECK_EQ(c->pool_state(2).value().capacity, 20);
  CHECK(c->pool_state(0).value().reclaims && !c->pool_state(1).value().reclaims);
  CHECK_CODE(c->pool_of(5), StatusCode::kLayerOutOfRange);
}

TEST(a_windowed_pool_of_two_windows_holds_a_sequence_of_any_length) {
  // W = 4, R = 2: a sequence keeps W + R cells; 2 x (W + R) cells run forever.
  auto c = make_pooled(16, {4}, {{4, 12}}, 2);
  seq_t a = new_seq(*c);
  for (pos_t p = 0; p < 1000; ++p) {
    CHECK(declare(*c, {a}));
    auto r = c->place_step(std::vector<int64_t>{p}, 0);
    CHECK_OK(r);
    CHECK(same(attended_in(*c, 0, r.value(), 0), range(std::max(0, p - 3), p + 1)));
    CHECK(same(held_in(*c, 0), range(std::max(0, p + 1 - 6), p + 1)));
  }
  CHECK_EQ(c->seq_len(a).value(), 1000);
  CHECK_EQ(c->next_pos(a).value(), 1000);
  CHECK_EQ(c->reclaimed(a, 0).value().count, 994);
  CHECK_EQ(c->reclaimed(a, 0).value().below, 994);
  CHECK_EQ(c->free_cells(), 6);
  CHECK_INVARIANTS(*c);
}

TEST(reclaimed_cells_go_to_other_sequences_and_the_full_pool_keeps_everything) {
  auto c = make_pooled(64, {3, kFull}, {{3, 6}}, 0);  // W + R + 1 = 4 <= 6
  seq_t a = new_seq(*c);
  seq_t b = new_seq(*c);
  for (int i = 0; i < 10; ++i) decode(*c, {a});
  CHECK(same(held_in(*c, 0), range(7, 10)));  // W + R = 3 kept
  CHECK_EQ(c->pool_state(1).value().free_cells, 54);
  for (int i = 0; i < 3; ++i) decode(*c, {b});  // into cells a gave up
  CHECK_EQ(c->pool_state(0).value().free_cells, 0);
  CHECK(!c->can_extend(1));
  auto refused = c->declare_step(std::vector<seq_t>{a, b});  // the windowed pool is full
  CHECK(refused.is_ok() && !refused.value());
  CHECK_EQ(c->next_pos(a).value(), 10);
  CHECK_OK(c->seq_free(b));
  decode(*c, {a});
  CHECK_EQ(c->seq_len(a).value(), 11);
  CHECK_INVARIANTS(*c);
}

TEST(a_cell_shared_by_forks_is_freed_when_the_last_owner_passes_it) {
  auto c = make_pooled(32, {2}, {{2, 16}}, 0);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a, a}, {0, 1, 2, 3});  // floor min(4 - 2, 0 - 1) < 0: nothing
  auto b = c->seq_clone(a);
  CHECK_OK(b);
  CHECK_EQ(c->free_cells(), 12);
  for (int i = 0; i < 4; ++i) decode(*c, {a});  // a at 8: its floor is 6
  CHECK_EQ(c->reclaimed(a, 0).value().below, 6);
  CHECK_EQ(c->reclaimed(b.value(), 0).value().count, 0);
  CHECK_EQ(c->free_cells(), 10);  // a's own 4, 5 freed; 0..3 stay: b owns them
  decode(*c, {b.value()});  // b at 4: floor 3, gives up 0..2, now free
  CHECK_EQ(c->free_cells(), 12);
  CHECK_EQ(c->reclaimed(b.value(), 0).value().count, 3);
  CHECK_EQ(c->seq_len(b.value()).value(), 5);
  CHECK_INVARIANTS(*c);
}

TEST(a_rollback_below_what_the_pool_holds_is_refused_and_changes_nothing) {
  auto c = make_pooled(32, {4, kFull}, {{4, 16}}, 1);
  seq_t a = new_seq(*c);
  for (int i = 0; i < 10; ++i) decode(*c, {a});  // floor 10 - 4 - 1 = 5
  CHECK_EQ(c->reclaimed(a, 0).value().below, 5);
  const auto before = std::vector<pos_t>(c->cell_positions().begin(), c->cell_positions().end());
  // A query at next position 7 would see 4..7: 4 is gone. 8 sees 5..8: kept.
  Status s = c->seq_rm(a, 7);
  CHECK_STATUS(s, StatusCode::kBelowReclaimed);
  CHECK(s.message().find("seq_rm of sequence 0 from position 7") != std::string::npos);
  CHECK(s.message().find("below 5") != std::string::npos);
  CHECK(s.message().find(">= 8") != std::string::npos);
  CHECK_CODE(c->seq_clone(a, 7), StatusCode::kBelowReclaimed);
  CHECK_STATUS(c->seq_rm(a, 3, 6), StatusCode::kBelowReclaimed);  // a middle range below 5
  CHECK(!c->holds_prefix(a, 7).value());
  CHECK(c->holds_prefix(a, 8).value());
  CHECK_EQ(c->next_pos(a).value(), 10);
  CHECK_EQ(c->n_sequences(), 1);
  CHECK((std::vector<pos_t>(c->cell_positions().begin(), c->cell_positions().end()) == before));
  CHECK_INVARIANTS(*c);
  // Within the margin, from 0, and ranges at or above the floor pass.
  auto prefix = c->seq_clone(a, 8);
  CHECK_OK(prefix);
  CHECK_EQ(c->next_pos(prefix.value()).value(), 8);
  CHECK_EQ(c->seq_len(prefix.value()).value(), 8);
  CHECK_OK(c->seq_rm(a, 5, 7));
  CHECK_OK(c->seq_rm(a, 8));
  CHECK_EQ(c->next_pos(a).value(), 8);
  CHECK_OK(c->seq_rm(prefix.value(), 0, 6));  // takes every reclaimed position
  CHECK_EQ(c->reclaimed(prefix.value(), 0).value().count, 0);
  CHECK_EQ(c->seq_len(prefix.value()).value(), 2);
  CHECK_INVARIANTS(*c);
}

TEST(the_latest_step_can_always_be_rolled_back_whole) {
  // R = 0 and a 6-token step (speculative proposals): the floor stops at the
  // step's first position - W + 1, so removing the whole step is exact.
  auto c = make_pooled(32, {3}, {{3, 16}}, 0);
  seq_t a = new_seq(*c);
  for (int i = 0; i < 8; ++i) decode(*c, {a});
  step(*c, {a, a, a, a, a, a}, {8, 9, 10, 11, 12, 13});
  CHECK_EQ(c->reclaimed(a, 0).value().below, 6);  // min(14 - 3, 8 - 2)
  CHECK_OK(c->seq_rm(a, 8));
  CHECK_EQ(c->next_pos(a).value(), 8);
  CHECK_CODE(c->seq_clone(a, 7), StatusCode::kBelowReclaimed);
  CHECK(declare(*c, {a}));
  auto r = c->place_step(std::vector<int64_t>{8}, 0);
  CHECK(same(attended_in(*c, 0, r.value(), 0), {6, 7, 8}));
  CHECK_INVARIANTS(*c);
}

TEST(the_plan_counts_reclaimed_cells_before_a_groups_first_cell) {
  auto c = make_pooled(32, {2, kFull}, {{2, 8}}, 1);
  seq_t a = new_seq(*c);
  seq_t b = new_seq(*c);
  for (int i = 0; i < 6; ++i) decode(*c, {a});  // a's floor 6 - 2 - 1 = 3
  CHECK(declare(*c, {b, a}));  // a's floor becomes 7 - 3 = 4 once both layers ran
  for (int32_t l = 0; l < 2; ++l) CHECK_OK(c->place_step(std::vector<int64_t>{0, 6}, l));
  for (int32_t l = 0; l < 2; ++l) {
    auto plan = c->attend_plan(l);
    CHECK_OK(plan);
    const AttendPlan& p = plan.value();
    CHECK_EQ(static_cast<int>(p.group_reclaimed.size()), 2);
    CHECK_EQ(p.group_reclaimed[0], 0);  // b
    // The windowed pool lists a's 4, 5, 6 after 4 reclaimed; the full pool all 7.
    CHECK_EQ(p.group_reclaimed[1], l == 0 ? 4 : 0);
    const int32_t first = p.tok_begin[1] - p.group_begin[1] + p.group_reclaimed[1];
    CHECK_EQ(first, l == 0 ? 5 : 0);  // a's position 5 is its 6th; full: from 0
  }
  CHECK_INVARIANTS(*c);
}

TEST(a_verb_between_layers_abandons_the_step_in_every_pool) {
  auto c = make_pooled(32, {2, kFull}, {{2, 8}}, 0);
  seq_t a = new_seq(*c);
  for (int i = 0; i < 5; ++i) decode(*c, {a});  // floor 5 - 2 = 3
  CHECK(declare(*c, {a, a}));
  CHECK_OK(c->place_step(std::vector<int64_t>{5, 6}, 0));  // layer 1 never runs
  // Judged without the abandoned step: next position 5 - 1 = 4, 4 - 2 + 1 >= 3.
  CHECK_OK(c->seq_rm(a, 4));
  CHECK_EQ(c->next_pos(a).value(), 4);
  CHECK(same(held_in(*c, 0), {3}));
  CHECK_EQ(c->pool_state(1).value().free_cells, 28);
  CHECK_INVARIANTS(*c);
}

TEST(admission_counts_a_windowed_pool_by_its_window) {
  // 10 + 2 x 99 = 208 cells in a full pool; a window of 8 with R = 4 and one
  // token a step keeps 8 + 4 + 1 per sequence: 2 x 13 = 26.
  CHECK_EQ(request_worst_case_cells_in_pool(10, 0, 2, 100, std::nullopt, 4, 1), 208);
  CHECK_EQ(request_worst_case_cells_in_pool(10, 0, 2, 100, Window(8), 4, 1), 26);
  // Steps of 16 tokens: max(R, 15) + 16 = 31 beyond the window.
  CHECK_EQ(request_worst_case_cells_in_pool(10, 0, 2, 100, Window(8), 4, 16), 78);
  // A short request is bounded by its own cells.
  CHECK_EQ(request_worst_case_cells_in_pool(3, 0, 1, 2, Window(8), 4, 1), 4);
  const std::vector<PoolLimit> pools = {{Window(8), 30}, {std::nullopt, 300}};
  CHECK(check_request_fits_pools("prompt 0", 10, 2, 100, pools, 4, 1).is_ok());
  const Status small = check_request_fits_pools("prompt 1", 10, 3, 100, pools, 4, 1);
  CHECK_STATUS(small, StatusCode::kCapacity);
  CHECK(small.message().starts_with("prompt 1 needs up to 39 cells of the window-8 pool"));
  const Status full = check_request_fits_pools("prompt 2", 10, 2, 200, pools, 4, 1);
  CHECK_STATUS(full, StatusCode::kCapacity);
  CHECK(full.message().starts_with("prompt 2 needs up to 408 cells ("));
  CHECK_STATUS(check_request_fits_pools("r", 1, 1, 1, pools, -1, 1), StatusCode::kInvalidConfig);
  CHECK_STATUS(check_request_fits_pools("r", 1, 1, 1, pools, 0, 0), StatusCode::kInvalidConfig);
  CHECK_STATUS(check_request_fits_pools("r", 1, kMaxSequences + 1, 1, pools, 0, 1),
               StatusCode::kCapacity);
}

// Random streams (200) on a pooled cache and on one pool that never reclaims:
// every served token must attend the same positions in both, and a verb
// refused as below the reclaimed horizon is one the pooled cache alone refuses.
TEST(reclaim_never_changes_what_a_token_attends) {
  std::mt19937 rng(20261203);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int refused = 0, compared = 0;
  for (int stream = 0; stream < 200; ++stream) {
    const std::vector<Window> windows = {Window(pick(1, 4)), kFull, Window(pick(1, 6))};
    const int32_t margin = pick(0, 2);
    std::vector<WindowPool> pools;
    for (const Window& w : windows) {
      if (!w || std::any_of(pools.begin(), pools.end(), [&](auto& p) { return p.window == *w; }))
        continue;
      pools.push_back({*w, *w + margin + 1 + pick(0, 6)});
    }
    auto pooled = make_pooled(250, windows, pools, margin);  // 40 verbs x 6 tokens fit
    auto plain = make(250, windows);
    CHECK(pooled != nullptr && plain != nullptr);
    if (!pooled || !plain) return;
    std::vector<seq_t> live;
    for (int verb = 0; verb < 40; ++verb) {
      const int kind = pick(0, 9);
      if (live.empty() || kind == 0) {
        seq_t s = new_seq(*pooled);
        CHECK_EQ(new_seq(*plain), s);
        live.push_back(s);
      } else if (kind <= 6) {  // decode 1-2 sequences by 1-3 tokens
        std::vector<seq_t> seqs;
        std::vector<int64_t> pos;
        for (int k = pick(1, 2); k > 0; --k) {
          const seq_t s = live[pick(0, static_cast<int>(live.size()) - 1)];
          if (std::find(seqs.begin(), seqs.end(), s) != seqs.end()) continue;
          const int64_t next = pooled->next_pos(s).value();
          for (int t = pick(1, 3), i = 0; i < t; ++i) {
            seqs.push_back(s);
            pos.push_back(next + i);
          }
        }
        auto ok = pooled->declare_step(seqs);
        if (!ok.is_ok() || !ok.value()) continue;
        CHECK(declare(*plain, seqs));
        for (int32_t l = 0; l < 3; ++l) {
          auto a = pooled->place_step(pos, l);
          auto b = plain->place_step(pos, l);
          CHECK(a.is_ok() && b.is_ok());
          if (!a.is_ok() || !b.is_ok()) return;
          for (int32_t i = 0; i < a.value().n_tok; ++i) {
            CHECK(attended_in(*pooled, l, a.value(), i) == attended_in(*plain, l, b.value(), i));
            ++compared;
          }
        }
      } else {  // roll back or fork near the horizon
        const seq_t s = live[pick(0, static_cast<int>(live.size()) - 1)];
        const pos_t next = pooled->next_pos(s).value();
        const pos_t p0 = std::max(0, next - pick(1, 8));
        if (kind <= 8) {
          Status st = pooled->seq_rm(s, p0);
          if (st.code() == StatusCode::kBelowReclaimed) {
            ++refused;
            continue;
          }
          CHECK_OK(st);
          CHECK_OK(plain->seq_rm(s, p0));
        } else {
          auto fork = pooled->seq_clone(s, p0);
          if (fork.status().code() == StatusCode::kBelowReclaimed) {
            ++refused;
            continue;
          }
          CHECK_OK(fork);
          CHECK_EQ(plain->seq_clone(s, p0).value(), fork.value());
          live.push_back(fork.value());
        }
      }
      for (seq_t s : live) CHECK_EQ(pooled->next_pos(s).value(), plain->next_pos(s).value());
      CHECK_INVARIANTS(*pooled);
    }
  }
  CHECK(refused > 60);
  CHECK(compared > 6000);
}
