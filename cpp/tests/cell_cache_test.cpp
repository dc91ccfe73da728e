// Unit tests of the cell cache core: every verb, every failure status, and
// check_invariants() after each.
#include <algorithm>
#include <vector>

#include "cellcache/cell_cache.h"
#include "cellcache/registry.h"
#include "check.h"

using namespace cellcache;

namespace {

const Window kFull = std::nullopt;

std::unique_ptr<CellCache> make(int32_t n_cells, std::vector<Window> windows = {kFull},
                                int32_t n_layers = 0) {
  CacheConfig config{n_cells, n_layers ? n_layers : static_cast<int32_t>(windows.size()),
                     windows};
  auto r = CellCache::create(config);
  if (!r.is_ok()) return nullptr;
  return std::move(r.value());
}

#define CHECK_OK(expr) CHECK((expr).is_ok())
#define CHECK_CODE(expr, want) CHECK_EQ(static_cast<int>((expr).status().code()), \
                                        static_cast<int>(want))
#define CHECK_STATUS(expr, want) CHECK_EQ(static_cast<int>((expr).code()), static_cast<int>(want))
#define CHECK_INVARIANTS(cache) CHECK((cache).check_invariants().is_ok())

seq_t new_seq(CellCache& c) { return c.seq_new().value(); }

bool declare(CellCache& c, std::vector<seq_t> seqs) {
  auto r = c.declare_step(seqs);
  return r.is_ok() && r.value();
}

// Declares and places one step on every layer; CHECKs each gate separately so
// an admission refusal cannot pass for a placement refusal.
void step(CellCache& c, std::vector<seq_t> seqs, std::vector<int64_t> positions) {
  auto admitted = c.declare_step(seqs);
  CHECK(admitted.is_ok() && admitted.value());
  for (int32_t l = 0; l < c.n_layers(); ++l) CHECK_OK(c.place_step(positions, l));
}

// Positions of the cells token i of a layer step may attend, sorted.
std::vector<pos_t> attended(const CellCache& c, const LayerStep& s, int32_t i) {
  std::vector<pos_t> out;
  for (int32_t j = 0; j < s.used_end; ++j) {
    if (s.mask[static_cast<size_t>(i) * s.used_end + j]) out.push_back(c.cell_positions()[j]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool same(const std::vector<pos_t>& a, std::vector<pos_t> b) { return a == b; }

}  // namespace

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

TEST(config_limits_are_enforced) {
  CHECK_CODE(CellCache::create({kMaxCells + 1, 1, {kFull}}), StatusCode::kInvalidConfig);
  CHECK_CODE(CellCache::create({8, kMaxLayers + 1, {kFull}}), StatusCode::kInvalidConfig);
  auto c = make(8);
  CHECK_EQ(c->n_sequences(), 0);
  new_seq(*c);
  new_seq(*c);
  CHECK_EQ(c->n_sequences(), 2);
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

int main() { return cellcache_test::run_all(); }
