// Core tests: configuration, sequence verbs (new, clone, rm, free, clear), the
// handle registry; check_invariants() after each.
#include "core_test_util.h"

using namespace cellcache;
using namespace cellcache_test;

TEST(config_errors_are_invalid_config) {
  CHECK_CODE(CellCache::create({0, 1, {kFull}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({-3, 1, {kFull}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, 0, {kFull}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, 2, {kFull, 4, kFull}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, 2, {}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, 1, {0}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, 1, {-2}}), StatusCode::kInvalidConfig);
  CHECK_OK(CellCache::create({8, 3, {4}}));
  CHECK_OK(CellCache::create({8, 2, {4, kFull}}));
}

TEST(seq_new_hands_out_lowest_free_id_up_to_256) {
  auto c = make(8);
  for (int i = 0; i < kMaxSequences; ++i) CHECK_EQ(new_seq(*c), i);
  CHECK_CODE(c->seq_new(), StatusCode::kCapacity);
  CHECK_OK(c->seq_free(17));
  CHECK_EQ(new_seq(*c), 17);
  CHECK_INVARIANTS(*c);
}

TEST(unknown_sequence_is_refused_by_every_verb) {
  auto c = make(8);
  seq_t a = new_seq(*c);
  CHECK_OK(c->seq_free(a));
  for (seq_t bad : {a, 77, -1, 256, 100000}) {
    CHECK_CODE(c->declare_step(std::vector<seq_t>{bad}), StatusCode::kUnknownSequence);
    CHECK_CODE(c->seq_clone(bad), StatusCode::kUnknownSequence);
    CHECK_STATUS(c->seq_rm(bad), StatusCode::kUnknownSequence);
    CHECK_STATUS(c->seq_free(bad), StatusCode::kUnknownSequence);
    CHECK_CODE(c->next_pos(bad), StatusCode::kUnknownSequence);
    CHECK_CODE(c->seq_len(bad), StatusCode::kUnknownSequence);
  }
  seq_t b = new_seq(*c);
  CHECK_CODE(c->declare_step(std::vector<seq_t>{b, 5}), StatusCode::kUnknownSequence);
  CHECK_INVARIANTS(*c);
}

TEST(config_limits_are_enforced) {
  CHECK_CODE(CellCache::create({kMaxCells + 1, 1, {kFull}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, kMaxLayers + 1, {kFull}}), StatusCode::kInvalidConfig);
  auto c = make(8);
  CHECK_EQ(c->n_sequences(), 0);
  new_seq(*c);
  new_seq(*c);
  CHECK_EQ(c->n_sequences(), 2);
}

TEST(clone_shares_cells_and_last_owner_frees) {
  auto c = make(8);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a}, {0, 1, 2});
  auto b = c->seq_clone(a);
  CHECK_OK(b);
  CHECK_EQ(c->free_cells(), 5);
  CHECK_EQ(c->seq_len(b.value()).value(), 3);
  CHECK_EQ(c->next_pos(b.value()).value(), 3);
  CHECK_INVARIANTS(*c);
  CHECK_OK(c->seq_free(a));
  CHECK_EQ(c->free_cells(), 5);
  CHECK(declare(*c, {b.value()}));
  auto r = c->place_step(std::vector<int64_t>{3}, 0);
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 0), {0, 1, 2, 3}));
  CHECK_OK(c->seq_free(b.value()));
  CHECK_EQ(c->free_cells(), 8);
  CHECK_EQ(c->used_end(), 0);
  CHECK_INVARIANTS(*c);
}

TEST(clone_upto_shares_a_prefix_and_branches_diverge) {
  auto c = make(16);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a, a, a}, {0, 1, 2, 3, 4});
  seq_t b = c->seq_clone(a, 3).value();
  CHECK_EQ(c->next_pos(b).value(), 3);
  CHECK_EQ(c->seq_len(b).value(), 3);
  CHECK(declare(*c, {b, a}));
  auto r = c->place_step(std::vector<int64_t>{3, 5}, 0);
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 0), {0, 1, 2, 3}));
  CHECK(same(attended(*c, r.value(), 1), {0, 1, 2, 3, 4, 5}));
  CHECK_CODE(c->seq_clone(a, -1), StatusCode::kPositionConflict);
  seq_t empty = c->seq_clone(a, 0).value();
  CHECK_EQ(c->seq_len(empty).value(), 0);
  CHECK_INVARIANTS(*c);
}

TEST(seq_rm_tail_lowers_next_pos_and_middle_leaves_a_hole) {
  auto c = make(16);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a, a, a, a}, {0, 1, 2, 3, 4, 5});
  CHECK_OK(c->seq_rm(a, 4));
  CHECK_EQ(c->next_pos(a).value(), 4);
  CHECK_EQ(c->used_end(), 4);
  CHECK_OK(c->seq_rm(a, 1, 2));
  CHECK_EQ(c->seq_len(a).value(), 3);
  CHECK_EQ(c->next_pos(a).value(), 4);
  CHECK_EQ(c->free_cells(), 13);
  CHECK_OK(c->seq_rm(a, 2, 2));  // empty range
  CHECK_EQ(c->seq_len(a).value(), 3);
  CHECK_STATUS(c->seq_rm(a, -1), StatusCode::kPositionConflict);
  CHECK_STATUS(c->seq_rm(a, 3, 2), StatusCode::kPositionConflict);
  CHECK_EQ(c->seq_len(a).value(), 3);
  // The freed hole is reused first (lowest free cell).
  CHECK(declare(*c, {a}));
  auto r = c->place_step(std::vector<int64_t>{4}, 0);
  CHECK_OK(r);
  CHECK_EQ(r.value().cells[0], 1);
  CHECK(same(attended(*c, r.value(), 0), {0, 2, 3, 4}));
  CHECK_INVARIANTS(*c);
}

TEST(clear_empties_everything_and_releases_ids) {
  auto c = make(8);
  seq_t a = new_seq(*c);
  step(*c, {a, a}, {0, 1});
  c->clear();
  CHECK_EQ(c->free_cells(), 8);
  CHECK_EQ(c->used_end(), 0);
  CHECK_CODE(c->next_pos(a), StatusCode::kUnknownSequence);
  CHECK_EQ(new_seq(*c), 0);
  CHECK_INVARIANTS(*c);
}

TEST(registry_finds_live_caches_and_refuses_stale_handles) {
  auto c1 = make(8);
  auto c2 = make(8);
  int64_t h1 = register_cache(c1.get());
  int64_t h2 = register_cache(c2.get());
  CHECK(h1 != h2);
  CHECK(lookup_cache(h1).value() == c1.get());
  CHECK(lookup_cache(h2).value() == c2.get());
  unregister_cache(h1);
  CHECK_CODE(lookup_cache(h1), StatusCode::kUnknownCache);
  CHECK_CODE(lookup_cache(0), StatusCode::kUnknownCache);
  CHECK_CODE(lookup_cache(-5), StatusCode::kUnknownCache);
  int64_t h3 = register_cache(c1.get());
  CHECK(h3 != h1);  // handles are never reused
  unregister_cache(h2);
  unregister_cache(h3);
}

TEST(status_codes_have_names) {
  CHECK(std::string(status_code_name(StatusCode::kPositionConflict)) == "PositionConflict");
  CHECK(std::string(status_code_name(StatusCode::kUnknownCache)) == "UnknownCache");
}
