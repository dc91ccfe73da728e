// Core tests of the ownership queries a prefix cache relies on:
// cells_owned_only_by (cells a set of sequences alone holds) and seq_serial
// (an id's lifetime); check_invariants() after each.
#include "core_test_util.h"

using namespace cellcache;
using namespace cellcache_test;

namespace {

int32_t only_by(const CellCache& c, std::vector<seq_t> seqs) {
  auto r = c.cells_owned_only_by(seqs);
  CHECK(r.is_ok());
  return r.is_ok() ? r.value() : -1;
}

}  // namespace

TEST(cells_owned_only_by_counts_cells_no_outside_sequence_shares) {
  auto c = make(16);
  seq_t a = new_seq(*c);
  step(*c, {a, a, a, a, a}, {0, 1, 2, 3, 4});
  seq_t b = c->seq_clone(a, 3).value();  // shares positions 0..2
  step(*c, {b, b}, {3, 4});              // b's own two cells
  seq_t d = new_seq(*c);
  step(*c, {d}, {0});
  CHECK_EQ(only_by(*c, {}), 0);
  CHECK_EQ(only_by(*c, {a}), 2);        // positions 3, 4 of a
  CHECK_EQ(only_by(*c, {b}), 2);
  CHECK_EQ(only_by(*c, {a, b}), 7);     // 3 shared + 2 + 2
  CHECK_EQ(only_by(*c, {a, b, d}), 16 - c->free_cells());
  CHECK_EQ(only_by(*c, {b, b}), 2);     // duplicates count once
  CHECK_INVARIANTS(*c);
  // What the query promised is what freeing frees.
  const int32_t free_before = c->free_cells();
  CHECK_OK(c->seq_free(a));
  CHECK_EQ(c->free_cells(), free_before + 2);
  CHECK_EQ(only_by(*c, {b}), 5);        // the shared cells are b's alone now
  CHECK_INVARIANTS(*c);
}

TEST(cells_owned_only_by_refuses_unknown_ids) {
  auto c = make(8);
  seq_t a = new_seq(*c);
  seq_t gone = new_seq(*c);
  CHECK_OK(c->seq_free(gone));
  for (seq_t bad : {gone, -1, 256, 99999}) {
    CHECK_CODE(c->cells_owned_only_by(std::vector<seq_t>{a, bad}),
               StatusCode::kUnknownSequence);
  }
  CHECK_INVARIANTS(*c);
}

TEST(seq_serial_names_each_lifetime_of_an_id) {
  auto c = make(8);
  seq_t a = new_seq(*c);
  const uint64_t first = c->seq_serial(a).value();
  seq_t b = c->seq_clone(a).value();
  CHECK(c->seq_serial(b).value() > first);
  CHECK_OK(c->seq_free(a));
  CHECK_CODE(c->seq_serial(a), StatusCode::kUnknownSequence);
  seq_t again = new_seq(*c);  // the lowest free id: a's, with a new serial
  CHECK_EQ(again, a);
  CHECK(c->seq_serial(again).value() > c->seq_serial(b).value());
  const uint64_t before_clear = c->seq_serial(again).value();
  c->clear();
  CHECK_EQ(new_seq(*c), 0);
  CHECK(c->seq_serial(0).value() > before_clear);  // clear reuses no serial
  CHECK_CODE(c->seq_serial(-3), StatusCode::kUnknownSequence);
  CHECK_INVARIANTS(*c);
}
