// Core tests: the step protocol (declare, place once, later layers, invalidation,
// partly served steps, admission); check_invariants() after each.
#include "core_test_util.h"

using namespace cellcache;
using namespace cellcache_test;

TEST(prefill_places_lowest_cells_and_masks_causally) {
  auto c = make(16);
  seq_t a = new_seq(*c);
  CHECK(declare(*c, {a, a, a}));
  CHECK_EQ(c->planned_used_end(), 3);
  auto r = c->place_step(std::vector<int64_t>{0, 1, 2}, 0);
  CHECK_OK(r);
  const LayerStep& s = r.value();
  CHECK_EQ(s.n_tok, 3);
  CHECK_EQ(s.used_end, 3);
  CHECK_EQ(static_cast<int>(s.mask.size()), 9);
  CHECK((std::vector<cell_t>(s.cells.begin(), s.cells.end()) == std::vector<cell_t>{0, 1, 2}));
  CHECK(same(attended(*c, s, 0), {0}));
  CHECK(same(attended(*c, s, 2), {0, 1, 2}));
  CHECK_EQ(c->next_pos(a).value(), 3);
  CHECK_EQ(c->seq_len(a).value(), 3);
  CHECK_EQ(c->free_cells(), 13);
  CHECK_EQ(c->used_end(), 3);
  CHECK_EQ(c->capacity(), 16);
  CHECK(c->can_extend(13));
  CHECK(!c->can_extend(14));
  CHECK(!c->can_extend(-1));
  CHECK_INVARIANTS(*c);
}

TEST(admission_refusal_changes_nothing_and_keeps_declared_step) {
  auto c = make(4);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a}, {0, 1, 2});
  CHECK(declare(*c, {a}));
  auto refused = c->declare_step(std::vector<seq_t>{a, a});
  CHECK(refused.is_ok() && !refused.value());
  CHECK_EQ(c->free_cells(), 1);
  CHECK_EQ(c->next_pos(a).value(), 3);
  CHECK_INVARIANTS(*c);
  auto r = c->place_step(std::vector<int64_t>{3}, 0);  // the earlier declaration stands
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 0), {0, 1, 2, 3}));
  CHECK_EQ(c->free_cells(), 0);
  auto full = c->declare_step(std::vector<seq_t>{a});
  CHECK(full.is_ok() && !full.value());
  CHECK_INVARIANTS(*c);
}

TEST(position_conflicts_are_refused_and_the_declaration_stands) {
  auto c = make(8);
  seq_t a = new_seq(*c);
  seq_t b = new_seq(*c);
  step(*c, {a, a}, {0, 1});
  CHECK(declare(*c, {a, a, b}));
  const std::vector<std::vector<int64_t>> bad = {
      {1, 2, 0},     // rewrites position 1 that a holds
      {2, 2, 0},     // repeats within the step
      {3, 2, 0},     // goes backwards within the step
      {2, 3, -1},    // negative
      {2, 3, int64_t{1} << 40},  // out of int32 range
      {2, 3},        // count differs from the declaration
      {2, 3, 0, 1},
  };
  for (const auto& positions : bad) {
    CHECK_CODE(c->place_step(positions, 0), StatusCode::kPositionConflict);
    CHECK_EQ(c->free_cells(), 6);
    CHECK_EQ(c->next_pos(a).value(), 2);
    CHECK_EQ(c->seq_len(b).value(), 0);
    CHECK_INVARIANTS(*c);
  }
  auto r = c->place_step(std::vector<int64_t>{2, 3, 0}, 0);
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 1), {0, 1, 2, 3}));
  CHECK(same(attended(*c, r.value(), 2), {0}));
  CHECK_INVARIANTS(*c);
}

TEST(position_after_hole_must_exceed_highest_held) {
  auto c = make(16);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a, a}, {0, 1, 2, 3});
  CHECK_OK(c->seq_rm(a, 1, 3));  // holds 0 and 3
  CHECK_EQ(c->seq_len(a).value(), 2);
  CHECK_EQ(c->next_pos(a).value(), 4);
  CHECK(declare(*c, {a}));
  CHECK_CODE(c->place_step(std::vector<int64_t>{2}, 0), StatusCode::kPositionConflict);
  CHECK_OK(c->place_step(std::vector<int64_t>{4}, 0));
  CHECK_INVARIANTS(*c);
}

TEST(forward_without_declaration_fails) {
  auto c = make(8, {kFull}, 2);
  seq_t a = new_seq(*c);
  CHECK_CODE(c->place_step(std::vector<int64_t>{0}, 0), StatusCode::kStepNotDeclared);
  CHECK(declare(*c, {a}));
  CHECK_OK(c->place_step(std::vector<int64_t>{0}, 0));
  // The same layer twice: a second forward that was not declared.
  CHECK_CODE(c->place_step(std::vector<int64_t>{1}, 0), StatusCode::kStepNotDeclared);
  CHECK_CODE(c->place_step(std::vector<int64_t>{0}, 0), StatusCode::kStepNotDeclared);
  CHECK_OK(c->place_step(std::vector<int64_t>{0}, 1));
  // The step is complete; any further serve is undeclared.
  CHECK_CODE(c->place_step(std::vector<int64_t>{1}, 1), StatusCode::kStepNotDeclared);
  CHECK_OK(c->served_layer(0));  // the finished step's masks stay readable
  CHECK_EQ(c->free_cells(), 7);
  CHECK_INVARIANTS(*c);
}

TEST(later_layers_reuse_the_placement_and_must_agree_on_positions) {
  auto c = make(8, {kFull, 2});
  seq_t a = new_seq(*c);
  CHECK(declare(*c, {a, a, a}));
  auto l0 = c->place_step(std::vector<int64_t>{0, 1, 2}, 0);
  CHECK_OK(l0);
  CHECK_CODE(c->place_step(std::vector<int64_t>{0, 1, 3}, 1), StatusCode::kPositionConflict);
  auto l1 = c->place_step(std::vector<int64_t>{0, 1, 2}, 1);
  CHECK_OK(l1);
  CHECK(l1.value().cells.data() == l0.value().cells.data());
  CHECK(same(attended(*c, l1.value(), 2), {1, 2}));
  CHECK(same(attended(*c, c->served_layer(0).value(), 2), {0, 1, 2}));
  CHECK_EQ(c->free_cells(), 5);
  CHECK_INVARIANTS(*c);
}

TEST(verb_between_declare_and_forward_end_invalidates) {
  auto c = make(8, {kFull}, 2);
  seq_t a = new_seq(*c);
  seq_t b = new_seq(*c);
  CHECK(declare(*c, {a, b}));
  CHECK_OK(c->place_step(std::vector<int64_t>{0, 0}, 0));
  CHECK_OK(c->seq_rm(b));
  CHECK_CODE(c->place_step(std::vector<int64_t>{0, 0}, 1), StatusCode::kStepInvalidated);
  CHECK_CODE(c->served_layer(0), StatusCode::kStepInvalidated);
  CHECK_INVARIANTS(*c);
  // Each verb invalidates a declared step before its first layer, too.
  for (int verb = 0; verb < 5; ++verb) {
    CHECK(declare(*c, {a}));
    if (verb == 0) CHECK_OK(c->seq_new());
    if (verb == 1) CHECK_OK(c->seq_clone(a));
    if (verb == 2) CHECK_OK(c->seq_rm(b));
    if (verb == 3) CHECK_OK(c->seq_free(c->seq_new().value()));
    if (verb == 4) c->clear();
    CHECK_CODE(c->place_step(std::vector<int64_t>{1}, 0), StatusCode::kStepInvalidated);
    CHECK_INVARIANTS(*c);
  }
  // A failed verb changes nothing, so it does not invalidate.
  a = new_seq(*c);
  CHECK(declare(*c, {a}));
  CHECK_STATUS(c->seq_rm(99), StatusCode::kUnknownSequence);
  CHECK_OK(c->place_step(std::vector<int64_t>{0}, 0));
  CHECK_INVARIANTS(*c);
}

TEST(partly_served_step_is_removed_by_the_next_verb_or_declaration) {
  auto c = make(8, {kFull}, 2);
  seq_t a = new_seq(*c);
  step(*c, {a}, {0});
  // The forward stops after layer 0: layer 1 never wrote position 1's K/V.
  CHECK(declare(*c, {a}));
  CHECK_OK(c->place_step(std::vector<int64_t>{1}, 0));
  CHECK_EQ(c->next_pos(a).value(), 2);
  CHECK(declare(*c, {a}));  // a new declaration abandons it
  CHECK_EQ(c->next_pos(a).value(), 1);
  CHECK_EQ(c->free_cells(), 7);
  CHECK_INVARIANTS(*c);
  CHECK_OK(c->place_step(std::vector<int64_t>{1}, 0));
  CHECK_OK(c->place_step(std::vector<int64_t>{1}, 1));
  CHECK_EQ(c->next_pos(a).value(), 2);
  // Again, stopped by a verb: the clone must not inherit the half-written cell.
  CHECK(declare(*c, {a}));
  CHECK_OK(c->place_step(std::vector<int64_t>{2}, 0));
  seq_t b = c->seq_clone(a).value();
  CHECK_EQ(c->next_pos(a).value(), 2);
  CHECK_EQ(c->next_pos(b).value(), 2);
  CHECK_EQ(c->free_cells(), 6);
  CHECK_CODE(c->place_step(std::vector<int64_t>{2}, 1), StatusCode::kStepInvalidated);
  CHECK_INVARIANTS(*c);
  // A failed verb neither abandons nor invalidates.
  CHECK(declare(*c, {a}));
  CHECK_OK(c->place_step(std::vector<int64_t>{2}, 0));
  CHECK_STATUS(c->seq_rm(a, -1), StatusCode::kPositionConflict);
  CHECK_EQ(c->next_pos(a).value(), 3);
  CHECK_OK(c->place_step(std::vector<int64_t>{2}, 1));
  CHECK_INVARIANTS(*c);
}

TEST(layer_out_of_range_is_refused) {
  auto c = make(8, {kFull, 3});
  seq_t a = new_seq(*c);
  CHECK(declare(*c, {a}));
  for (int32_t bad : {-1, 2, 1000, -1000}) {
    CHECK_CODE(c->place_step(std::vector<int64_t>{0}, bad), StatusCode::kLayerOutOfRange);
    CHECK_CODE(c->served_layer(bad), StatusCode::kLayerOutOfRange);
    CHECK_CODE(c->window(bad), StatusCode::kLayerOutOfRange);
  }
  CHECK_EQ(c->free_cells(), 8);
  CHECK_OK(c->place_step(std::vector<int64_t>{0}, 1));  // declaration still stands
  CHECK(c->window(1).value() == Window(3));
  CHECK(!c->window(0).value().has_value());
  CHECK_INVARIANTS(*c);
}

TEST(written_end_only_grows) {
  auto c = make(16);
  seq_t a = new_seq(*c);
  CHECK(declare(*c, {a, a, a}));
  CHECK_EQ(c->written_end(), 0);  // declared, not yet placed
  CHECK_OK(c->place_step(std::vector<int64_t>{0, 1, 2}, 0));
  CHECK_EQ(c->written_end(), 3);
  CHECK_OK(c->seq_rm(a, 1));
  CHECK_EQ(c->used_end(), 1);
  CHECK_EQ(c->written_end(), 3);
  c->clear();
  CHECK_EQ(c->written_end(), 3);
  CHECK_INVARIANTS(*c);
}

TEST(many_sequences_in_one_step) {
  auto c = make(1024);
  std::vector<seq_t> seqs;
  std::vector<int64_t> pos;
  for (int i = 0; i < kMaxSequences; ++i) {
    seqs.push_back(new_seq(*c));
    seqs.push_back(seqs.back());
    pos.push_back(0);
    pos.push_back(1);
  }
  CHECK(declare(*c, seqs));
  auto r = c->place_step(pos, 0);
  CHECK_OK(r);
  CHECK(same(attended(*c, r.value(), 511), {0, 1}));
  CHECK_EQ(c->seq_len(255).value(), 2);
  CHECK_INVARIANTS(*c);
}
