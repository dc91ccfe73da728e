// PrefixCache (prefix_cache.h) on a real CellCache, no model: the rules of
// runtime/prefix_cache.py case by case (expectations worked out from the
// rules), the examples of tests/test_prefix_cache.py, and a randomized run
// against a brute-force oracle (the Python state machine's Oracle, ported).
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core_test_util.h"
#include "prefix_cache.h"

using namespace cellcache;
using namespace cellcache_test;
using cellcache::runner::PrefixCache;
using cellcache::runner::PrefixMatch;
using Tokens = std::vector<int64_t>;

namespace {

// Places positions start .. start+n-1 of seq (a step on every layer).
void extend(CellCache& c, seq_t seq, int64_t start, int64_t n) {
  if (n <= 0) return;
  std::vector<seq_t> seqs(static_cast<size_t>(n), seq);
  std::vector<int64_t> pos;
  for (int64_t p = start; p < start + n; ++p) pos.push_back(p);
  step(c, seqs, pos);
}

std::unique_ptr<PrefixCache> make_index(CellCache& c,
                                        std::optional<int32_t> max_cells = std::nullopt) {
  auto r = PrefixCache::create(c, max_cells);
  CHECK(r.ok());
  return r.ok() ? std::move(r.value()) : nullptr;
}

// A sequence holding tokens (cloned from src's first upto positions when
// given, the rest placed), handed to the index.
seq_t cached(CellCache& c, PrefixCache& index, const Tokens& tokens,
             std::optional<seq_t> src = std::nullopt, int32_t upto = 0) {
  seq_t seq = src ? c.seq_clone(*src, upto).value() : new_seq(c);
  extend(c, seq, src ? upto : 0, static_cast<int64_t>(tokens.size()) - (src ? upto : 0));
  CHECK(index.insert(tokens, seq).ok());
  return seq;
}

// A sequence holding n fresh positions, not given to the index.
seq_t fresh(CellCache& c, int64_t n) {
  seq_t seq = new_seq(c);
  extend(c, seq, 0, n);
  return seq;
}

bool is(PrefixMatch m, seq_t seq, int32_t length) { return m.seq == seq && m.length == length; }
bool miss(PrefixMatch m) { return m.seq == -1 && m.length == 0; }
bool live(const CellCache& c, seq_t seq) { return c.seq_len(seq).is_ok(); }
bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

// ------------------------------------------------------------------ create

TEST(prefix_create_refuses_a_bound_outside_the_cells) {
  auto c = make(32);
  for (int32_t bad : {-1, 33, 1 << 30}) {
    auto r = PrefixCache::create(*c, bad);
    CHECK(!r.ok());
    if (r.ok()) continue;
    CHECK(r.error().kind == runner::ErrorKind::kUser);
    CHECK(has(r.error().message, "prefix_cache_cells must be an integer in [0, 32]"));
    CHECK(has(r.error().message, "got " + std::to_string(bad)));
  }
  for (std::optional<int32_t> good : {std::optional<int32_t>(), std::optional<int32_t>(0),
                                      std::optional<int32_t>(32)}) {
    auto r = PrefixCache::create(*c, good);
    CHECK(r.ok());
    if (r.ok()) CHECK(r.value()->max_cells() == good);
  }
}

// ------------------------------------------------------------------ match

TEST(prefix_match_leaves_the_last_prompt_token_to_compute) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t seq = cached(*c, *index, {1, 2, 3});
  CHECK(is(index->match(Tokens{1, 2, 3}), seq, 2));
  CHECK(is(index->match(Tokens{1, 2, 3, 4}), seq, 3));
  CHECK(is(index->match(Tokens{1, 2}), seq, 1));
  CHECK(miss(index->match(Tokens{1})));
  CHECK(miss(index->match(Tokens{})));
  CHECK(miss(index->match(Tokens{5, 1, 2})));
  CHECK_EQ(index->size(), 1);
}

TEST(prefix_match_takes_the_longest_prefix_across_branches) {
  auto c = make(64);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 2, 3, 4, 5});
  seq_t b = cached(*c, *index, {1, 2, 7, 8});
  seq_t d = cached(*c, *index, {1, 9});
  CHECK(is(index->match(Tokens{1, 2, 7, 8, 9}), b, 4));
  CHECK(is(index->match(Tokens{1, 2, 3, 9}), a, 3));   // ends inside an edge
  CHECK(is(index->match(Tokens{1, 9, 9}), d, 2));
  CHECK(is(index->match(Tokens{1, 2, 3, 4, 5, 6, 7}), a, 5));
  // Capped at len-1 = 1, but served from below the whole common prefix [1, 2]:
  // a or b (a is the more recent), never d although d was used since b.
  CHECK(is(index->match(Tokens{1, 2}), a, 1));
  CHECK(is(index->match(Tokens{1, 2, 7}), b, 2));
  CHECK(is(index->match(Tokens{1, 2}), b, 1));
  // Common prefix [1] only: the most recent of all three.
  CHECK(is(index->match(Tokens{1, 5, 5}), b, 1));
  CHECK(is(index->match(Tokens{1, 9}), d, 1));
  CHECK(is(index->match(Tokens{1, 5, 5}), d, 1));
  CHECK(index->tokens(a) == Tokens({1, 2, 3, 4, 5}));
  CHECK(index->tokens(b) == Tokens({1, 2, 7, 8}));
  CHECK(index->tokens(d) == Tokens({1, 9}));
  CHECK(!index->tokens(99).has_value());
}

TEST(prefix_match_serves_the_most_recently_used_entry_below_the_match) {
  auto c = make(64);
  auto index = make_index(*c);
  seq_t e4 = cached(*c, *index, {1, 2, 3, 4});
  seq_t e5 = cached(*c, *index, {1, 2, 3, 5});
  seq_t e6 = cached(*c, *index, {1, 2, 3, 6});
  CHECK(is(index->match(Tokens{1, 2, 3, 9}), e6, 3));     // latest inserted
  CHECK(is(index->match(Tokens{1, 2, 3, 4, 0}), e4, 4));  // marks e4 used
  CHECK(is(index->match(Tokens{1, 2, 3, 9}), e4, 3));
  CHECK(is(index->match(Tokens{1, 2, 3, 5}), e5, 3));     // capped; e5 itself matches 4
  CHECK(is(index->match(Tokens{1, 2, 9}), e5, 2));
  CHECK(index->seqs() == std::vector<seq_t>({e6, e4, e5}));
  // A match ending inside an edge: entries below the edge's child.
  seq_t f1 = cached(*c, *index, {5, 5, 5, 1});
  seq_t f2 = cached(*c, *index, {5, 5, 5, 2});
  CHECK(is(index->match(Tokens{5, 5, 9}), f2, 2));
  CHECK(is(index->match(Tokens{5, 5, 5, 1, 1}), f1, 4));
  CHECK(is(index->match(Tokens{5, 5, 9}), f1, 2));
  CHECK(index->seqs() == std::vector<seq_t>({e6, e4, e5, f2, f1}));
}

TEST(prefix_system_prompt_shared_by_sessions_is_held_once) {
  auto c = make(64);
  auto index = make_index(*c);
  Tokens system(20, 9);
  auto with = [&](Tokens tail) {
    Tokens t = system;
    t.insert(t.end(), tail.begin(), tail.end());
    return t;
  };
  seq_t latest = cached(*c, *index, with({1, 2}));
  for (Tokens turn : {Tokens{3, 4}, Tokens{5, 6, 7}}) {
    CHECK(is(index->match(with(turn)), latest, 20));
    latest = cached(*c, *index, with(turn), latest, 20);
  }
  CHECK_EQ(index->size(), 3);
  CHECK_EQ(c->free_cells(), 64 - (20 + 2 + 2 + 3));
  CHECK_EQ(index->reclaimable_cells(), 27);
  CHECK_INVARIANTS(*c);
}

// ------------------------------------------------------------------ dedupe

TEST(prefix_insert_frees_a_covered_sequence_and_touches_the_latest_cover) {
  auto c = make(64);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 2, 3, 4});
  seq_t b = cached(*c, *index, {1, 2, 3, 5});
  seq_t d = cached(*c, *index, {7, 7});
  CHECK(index->seqs() == std::vector<seq_t>({a, b, d}));
  const int32_t free_before = c->free_cells();
  seq_t covered = fresh(*c, 2);  // tokens [1, 2]: a prefix of a's and b's
  CHECK(index->insert(Tokens{1, 2}, covered).ok());
  CHECK(!live(*c, covered));
  CHECK_EQ(c->free_cells(), free_before);  // its own cells freed with it
  CHECK(index->seqs() == std::vector<seq_t>({a, d, b}));  // b, the latest cover, used
  // Equal tokens, sharing the entry's cells: freed, frees no cell.
  seq_t same_tokens = c->seq_clone(d).value();
  CHECK(index->insert(Tokens{7, 7}, same_tokens).ok());
  CHECK(!live(*c, same_tokens));
  CHECK_EQ(c->free_cells(), free_before);
  CHECK(index->seqs() == std::vector<seq_t>({a, b, d}));
  CHECK_EQ(index->size(), 3);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_insert_frees_an_entry_that_is_a_prefix_of_the_new_one) {
  auto c = make(64);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 2});
  seq_t other = cached(*c, *index, {1, 5});
  seq_t b = cached(*c, *index, {1, 2, 3, 4}, a, 2);  // shares a's two cells
  CHECK(!live(*c, a));
  CHECK(index->seqs() == std::vector<seq_t>({other, b}));
  CHECK(index->tokens(b) == Tokens({1, 2, 3, 4}));
  CHECK_EQ(c->free_cells(), 64 - 4 - 2);  // a's cells are b's now
  CHECK(is(index->match(Tokens{1, 2, 3, 4, 5}), b, 4));
  CHECK(is(index->match(Tokens{1, 5, 6}), other, 2));
  // The tree re-compresses: the new leaf merges into the removed entry's node.
  seq_t longer = cached(*c, *index, {1, 2, 3, 4, 5, 6}, b, 4);
  CHECK(!live(*c, b));
  CHECK(index->tokens(longer) == Tokens({1, 2, 3, 4, 5, 6}));
  CHECK(is(index->match(Tokens{1, 2, 3, 4, 5, 6, 7}), longer, 6));
  CHECK(is(index->match(Tokens{1, 2, 9}), longer, 2));
  CHECK(is(index->match(Tokens{1, 5}), other, 1));
  // A fresh entry whose tokens are a prefix, not sharing cells: freed.
  seq_t covered = fresh(*c, 3);
  CHECK(index->insert(Tokens{1, 2, 3}, covered).ok());
  CHECK(!live(*c, covered));
  CHECK(index->seqs() == std::vector<seq_t>({other, longer}));
  CHECK_EQ(index->reclaimable_cells(), 8);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_removal_recompresses_the_tree) {
  auto c = make(64);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 2, 3});
  seq_t b = cached(*c, *index, {1, 2, 4});
  seq_t d = cached(*c, *index, {1, 5});
  // Evict a (the LRU): node [1,2] keeps one child and merges with it.
  CHECK(index->evict(c->free_cells() + 1, 0, std::nullopt));
  CHECK(!live(*c, a));
  CHECK(index->seqs() == std::vector<seq_t>({b, d}));
  CHECK(index->tokens(b) == Tokens({1, 2, 4}));
  CHECK(is(index->match(Tokens{1, 2, 3}), b, 2));
  CHECK(is(index->match(Tokens{1, 2, 4, 0}), b, 3));
  // Then a new branch inside the merged edge splits it again.
  seq_t e = cached(*c, *index, {1, 2, 9});
  CHECK(is(index->match(Tokens{1, 2, 4, 0}), b, 3));
  CHECK(is(index->match(Tokens{1, 2, 9, 0}), e, 3));
  CHECK(is(index->match(Tokens{1, 5, 0}), d, 2));
  CHECK(index->tokens(e) == Tokens({1, 2, 9}));
  CHECK(index->tokens(d) == Tokens({1, 5}));
}

// ------------------------------------------------------------------ eviction

TEST(prefix_evict_takes_least_recently_used_first) {
  auto c = make(8);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 1});
  seq_t b = cached(*c, *index, {2, 2});
  seq_t d = cached(*c, *index, {3, 3});
  CHECK_EQ(c->free_cells(), 2);
  CHECK(index->evict(2, 0, std::nullopt));  // room already: nothing evicted
  CHECK_EQ(index->size(), 3);
  CHECK(is(index->match(Tokens{1, 1, 0}), a, 2));  // a becomes the most recent
  CHECK(index->seqs() == std::vector<seq_t>({b, d, a}));
  CHECK(index->evict(4, 0, std::nullopt));
  CHECK(!live(*c, b) && live(*c, d) && live(*c, a));
  CHECK(index->seqs() == std::vector<seq_t>({d, a}));
  CHECK_EQ(c->free_cells(), 4);
  CHECK_EQ(index->stats().evictions, 1);
  CHECK(index->evict(8, 0, std::nullopt));
  CHECK(index->seqs().empty());
  CHECK_EQ(c->free_cells(), 8);
  CHECK_EQ(index->stats().evictions, 3);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_evict_refuses_and_evicts_nothing_when_not_enough) {
  auto c = make(12);
  auto index = make_index(*c);
  seq_t entry = cached(*c, *index, {1, 2, 3, 4, 5, 6});
  seq_t running = c->seq_clone(entry, 4).value();
  CHECK_EQ(index->reclaimable_cells(), 2);  // positions 4, 5 only
  CHECK(!index->evict(12, 0, std::nullopt));
  CHECK(index->seqs() == std::vector<seq_t>({entry}));
  CHECK_EQ(index->stats().evictions, 0);
  CHECK(index->evict(8, 0, std::nullopt));
  CHECK(index->seqs().empty());
  CHECK_EQ(c->free_cells(), 8);
  CHECK_EQ(c->seq_len(running).value(), 4);  // a running request keeps its cells
  CHECK_EQ(c->next_pos(running).value(), 4);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_evict_never_takes_keep) {
  auto c = make(8);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 1, 1});
  seq_t b = cached(*c, *index, {2, 2, 2});
  CHECK_EQ(c->free_cells(), 2);
  // Would need both; keep = a leaves only b (3 cells): refused.
  CHECK(!index->evict(6, 0, a));
  CHECK_EQ(index->size(), 2);
  CHECK(index->evict(5, 0, a));  // b alone suffices, though a is older
  CHECK(live(*c, a) && !live(*c, b));
  CHECK(index->seqs() == std::vector<seq_t>({a}));
  CHECK(!index->evict(6, 0, a));
  CHECK(index->evict(0, kMaxSequences, std::nullopt) && index->size() == 0);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_evict_frees_ids_too) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1});
  seq_t b = cached(*c, *index, {2});
  std::vector<seq_t> others;
  while (c->n_sequences() < kMaxSequences) others.push_back(new_seq(*c));
  CHECK(!index->evict(0, 3, std::nullopt));  // two entries free two ids at most
  CHECK_EQ(index->size(), 2);
  CHECK(!index->evict(0, 2, b));
  CHECK(index->evict(0, 1, std::nullopt));
  CHECK(!live(*c, a) && live(*c, b));
  CHECK_EQ(c->n_sequences(), kMaxSequences - 1);
  CHECK_EQ(c->free_cells(), 15);
  CHECK(!index->evict(16, 3, std::nullopt));  // cells would do, ids not: nothing
  CHECK(live(*c, b));
  CHECK(index->evict(16, 1, std::nullopt));   // room for an id already; cells need b
  CHECK(!live(*c, b));
  CHECK_EQ(c->free_cells(), 16);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_eviction_never_frees_a_cell_a_running_sequence_shares) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 2, 3, 4});
  seq_t b = cached(*c, *index, {5, 6, 7, 8});
  seq_t run_a = c->seq_clone(a, 3).value();  // shares a's positions 0..2
  seq_t run_b = c->seq_clone(b).value();     // shares all of b
  extend(*c, run_a, 3, 2);
  CHECK_EQ(c->free_cells(), 16 - 8 - 2);
  CHECK_EQ(index->reclaimable_cells(), 1);  // a's position 3
  CHECK(!index->evict(8, 0, std::nullopt));
  CHECK_EQ(index->size(), 2);
  CHECK(index->evict(7, 0, std::nullopt));  // a goes (LRU), its one cell comes back
  CHECK(index->seqs() == std::vector<seq_t>({b}));
  CHECK_EQ(c->free_cells(), 7);
  CHECK(!index->evict(8, 0, std::nullopt));  // b frees nothing: refused
  CHECK(index->evict(7, 0, std::nullopt));
  CHECK(index->seqs() == std::vector<seq_t>({b}));
  CHECK(index->evict(0, kMaxSequences - 2, std::nullopt));  // 3 live: b goes for its id
  CHECK_EQ(index->size(), 0);
  CHECK_EQ(c->free_cells(), 7);
  CHECK_EQ(c->seq_len(run_a).value(), 5);
  CHECK_EQ(c->seq_len(run_b).value(), 4);
  CHECK_INVARIANTS(*c);
}

// ------------------------------------------------------------------ bound

TEST(prefix_bound_cuts_a_long_entry_and_evicts_older_ones) {
  auto c = make(32);
  auto index = make_index(*c, 6);
  seq_t old = cached(*c, *index, {7, 7, 7});
  seq_t young = cached(*c, *index, {1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(index->seqs() == std::vector<seq_t>({young}));
  CHECK(index->tokens(young) == Tokens({1, 2, 3, 4, 5, 6}));
  CHECK_EQ(c->seq_len(young).value(), 6);
  CHECK_EQ(c->next_pos(young).value(), 6);
  CHECK_EQ(c->free_cells(), 26);
  CHECK(!live(*c, old));
  CHECK_EQ(index->stats().evictions, 1);
  CHECK(is(index->match(Tokens{1, 2, 3, 4, 5, 6, 7}), young, 6));
  CHECK_INVARIANTS(*c);
}

TEST(prefix_bound_keeps_cells_within_max_cells_evicting_lru) {
  auto c = make(32);
  auto index = make_index(*c, 7);
  seq_t a = cached(*c, *index, {1, 1, 1});
  seq_t b = cached(*c, *index, {2, 2, 2});
  CHECK(is(index->match(Tokens{1, 1, 1, 1}), a, 3));  // b is now the LRU
  seq_t d = cached(*c, *index, {3, 3});                  // 8 > 7: evict b
  CHECK(index->seqs() == std::vector<seq_t>({a, d}));
  CHECK(!live(*c, b));
  CHECK_EQ(index->reclaimable_cells(), 5);
  // A cell shared with a running request does not count against the bound...
  seq_t running = c->seq_clone(a).value();
  seq_t e = cached(*c, *index, {4, 4, 4, 4});  // 2 + 4 only-cached cells
  CHECK(index->seqs() == std::vector<seq_t>({a, d, e}));
  CHECK_EQ(index->reclaimable_cells(), 6);
  // ...until the request ends without becoming an entry.
  CHECK_OK(c->seq_free(running));
  CHECK_EQ(index->reclaimable_cells(), 9);
  index->enforce_bound();
  CHECK(index->seqs() == std::vector<seq_t>({d, e}));  // a alone is enough
  CHECK(!live(*c, a));
  CHECK_EQ(index->reclaimable_cells(), 6);
  // enforce_bound never evicts keep, even the least recently used.
  seq_t running2 = c->seq_clone(e).value();
  seq_t g = cached(*c, *index, {6, 6, 6, 6, 6});  // 2 + 5 only-cached cells
  CHECK(index->seqs() == std::vector<seq_t>({d, e, g}));
  CHECK_OK(c->seq_free(running2));
  CHECK_EQ(index->reclaimable_cells(), 11);
  index->enforce_bound(d);
  CHECK(index->seqs() == std::vector<seq_t>({d, g}));  // e goes instead of d
  CHECK_EQ(index->reclaimable_cells(), 7);
  CHECK_EQ(index->stats().evictions, 3);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_bound_zero_keeps_nothing) {
  auto c = make(8);
  auto index = make_index(*c, 0);
  seq_t a = fresh(*c, 3);
  CHECK(index->insert(Tokens{1, 2, 3}, a).ok());
  CHECK(!live(*c, a));
  CHECK_EQ(index->size(), 0);
  CHECK_EQ(c->free_cells(), 8);
  CHECK(miss(index->match(Tokens{1, 2, 3, 4})));
  // An empty sequence with no tokens is freed too, with no bound.
  auto unbounded = make_index(*c);
  seq_t empty = new_seq(*c);
  CHECK(unbounded->insert(Tokens{}, empty).ok());
  CHECK(!live(*c, empty));
  CHECK_EQ(unbounded->size(), 0);
}

TEST(prefix_bound_holds_when_a_covered_fork_leaves_its_cells_to_the_cache) {
  auto c = make(32);
  auto index = make_index(*c, 8);
  seq_t older = cached(*c, *index, {5, 5, 5, 5});
  seq_t first = fresh(*c, 6);
  seq_t second = c->seq_clone(first).value();
  CHECK(index->insert(Tokens{1, 2, 3, 4, 5, 6}, first).ok());
  CHECK(index->seqs() == std::vector<seq_t>({older, first}));
  CHECK_EQ(index->reclaimable_cells(), 4);
  CHECK(index->insert(Tokens{1, 2, 3, 4, 5, 6}, second).ok());
  CHECK(index->seqs() == std::vector<seq_t>({first}));
  CHECK_EQ(index->reclaimable_cells(), 6);
  CHECK(!live(*c, older) && !live(*c, second));
  CHECK_INVARIANTS(*c);
}

// ------------------------------------------------------------------ ids, changes

TEST(prefix_an_id_freed_and_handed_out_again_is_not_taken_for_the_entry) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t seq = cached(*c, *index, {1, 2, 3});
  CHECK_OK(c->seq_free(seq));
  seq_t other = fresh(*c, 3);  // the same id, someone else's sequence
  CHECK_EQ(other, seq);
  CHECK(miss(index->match(Tokens{1, 2, 3, 4})));
  CHECK_EQ(index->size(), 0);
  CHECK_EQ(index->stats().evictions, 0);
  index->clear();
  CHECK_EQ(c->seq_len(other).value(), 3);  // not freed by the index
  CHECK_INVARIANTS(*c);
}

TEST(prefix_inserting_an_id_freed_and_handed_out_again_is_not_refused_as_cached) {
  auto c = make(32);
  auto index = make_index(*c);
  seq_t seq = cached(*c, *index, {1, 2, 3});
  CHECK_OK(c->seq_free(seq));         // someone else frees the entry's id
  seq_t again = fresh(*c, 2);          // handed out again, holding 2 positions
  CHECK_EQ(again, seq);
  CHECK(index->insert(Tokens{7, 8}, again).ok());
  CHECK_EQ(index->size(), 1);
  const PrefixMatch hit = index->match(Tokens{7, 8, 9});
  CHECK_EQ(hit.seq, again);
  CHECK_EQ(hit.length, 2);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_cache_clear_by_someone_else_empties_the_index) {
  auto c = make(16);
  auto index = make_index(*c, 10);
  cached(*c, *index, {1, 2, 3});
  cached(*c, *index, {4, 5});
  c->clear();
  CHECK_EQ(index->size(), 0);
  CHECK_EQ(index->reclaimable_cells(), 0);
  seq_t a = fresh(*c, 2);
  seq_t b = fresh(*c, 1);
  CHECK(!index->evict(16, 0, std::nullopt));  // not ours: nothing to evict
  CHECK(miss(index->match(Tokens{1, 2, 3, 4})));
  index->clear();
  CHECK(live(*c, a) && live(*c, b));
  // The ids are free for the index again.
  seq_t d = c->seq_clone(a).value();
  CHECK(index->insert(Tokens{7, 7}, d).ok());
  CHECK(index->seqs() == std::vector<seq_t>({d}));
  CHECK_INVARIANTS(*c);
}

TEST(prefix_an_entry_changed_behind_the_index_is_never_served) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t seq = cached(*c, *index, {1, 2, 3, 4});
  CHECK_OK(c->seq_rm(seq, 2));  // someone cut our entry's tail
  CHECK(miss(index->match(Tokens{1, 2, 3, 4, 5})));
  CHECK_EQ(index->size(), 0);
  CHECK_EQ(c->n_sequences(), 0);
  CHECK_EQ(c->free_cells(), 16);
  // A hole, and a tail grown past the entry: dropped too; the next best serves.
  seq_t keep = cached(*c, *index, {1, 2, 8});
  seq_t holed = cached(*c, *index, {1, 2, 3, 4});
  seq_t grown = cached(*c, *index, {1, 2, 3, 5});
  CHECK_OK(c->seq_rm(holed, 1, 2));
  extend(*c, grown, 4, 1);
  CHECK(is(index->match(Tokens{1, 2, 3, 9}), keep, 2));
  CHECK(!live(*c, holed) && !live(*c, grown));
  CHECK(index->seqs() == std::vector<seq_t>({keep}));
  CHECK_EQ(index->stats().evictions, 0);
  CHECK_INVARIANTS(*c);
}

TEST(prefix_insert_refuses_a_sequence_that_does_not_hold_its_tokens) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t seq = fresh(*c, 4);
  auto r = index->insert(Tokens{1, 2, 3, 4, 5}, seq);
  CHECK(!r.ok());
  if (!r.ok()) {
    CHECK(r.error().kind == runner::ErrorKind::kUser);
    CHECK(has(r.error().message, "must hold exactly positions 0..4 of its 5"));
  }
  CHECK_OK(c->seq_rm(seq, 1, 2));  // a hole
  r = index->insert(Tokens{1, 2, 3, 4}, seq);
  CHECK(!r.ok());
  if (!r.ok()) CHECK(has(r.error().message, "holds 3 positions below 4"));
  CHECK_EQ(index->size(), 0);
  CHECK_EQ(c->seq_len(seq).value(), 3);  // still the caller's
  seq_t full = cached(*c, *index, {1, 2});
  r = index->insert(Tokens{1, 2}, full);
  CHECK(!r.ok());
  if (!r.ok()) {
    CHECK(r.error().kind == runner::ErrorKind::kUser);
    CHECK(has(r.error().message, "sequence " + std::to_string(full) + " is already cached"));
  }
  r = index->insert(Tokens{1}, 200);  // not a live sequence: the cache refuses
  CHECK(!r.ok());
  if (!r.ok()) CHECK(r.error().kind == runner::ErrorKind::kRuntime);
  CHECK(index->seqs() == std::vector<seq_t>({full}));
  CHECK_INVARIANTS(*c);
}

// ------------------------------------------------------------------ clear, stats

TEST(prefix_clear_frees_entries_but_not_running_cells) {
  auto c = make(16);
  auto index = make_index(*c);
  seq_t a = cached(*c, *index, {1, 2, 3});
  seq_t b = cached(*c, *index, {4, 5});
  seq_t running = c->seq_clone(a, 2).value();
  index->record(5, 2);
  index->clear();
  CHECK_EQ(index->size(), 0);
  CHECK(!live(*c, a) && !live(*c, b));
  CHECK_EQ(c->seq_len(running).value(), 2);
  CHECK_EQ(c->free_cells(), 14);
  CHECK_EQ(index->stats().requests, 1);  // stats are cumulative
  CHECK_EQ(index->stats().evictions, 0);
  CHECK(miss(index->match(Tokens{1, 2, 3, 4})));
  seq_t d = cached(*c, *index, {1, 2, 3});
  CHECK(is(index->match(Tokens{1, 2, 3, 4}), d, 3));
  CHECK_INVARIANTS(*c);
}

TEST(prefix_stats_count_requests_hits_and_tokens) {
  auto c = make(8);
  auto index = make_index(*c);
  CHECK(index->stats().hit_rate() == 0.0);
  index->record(10, 0);
  index->record(10, 4);
  index->record(6, 5);
  index->record(3, 0);
  const auto& s = index->stats();
  CHECK_EQ(s.requests, 4);
  CHECK_EQ(s.hits, 2);
  CHECK_EQ(s.prompt_tokens, 29);
  CHECK_EQ(s.cached_tokens, 9);
  CHECK(s.hit_rate() == 0.5);
}

// ------------------------------------------------------------------ randomized

namespace {

int64_t lcp(const Tokens& a, const Tokens& b) {
  size_t k = 0;
  while (k < std::min(a.size(), b.size()) && a[k] == b[k]) ++k;
  return static_cast<int64_t>(k);
}

// tests/test_prefix_cache.py's Oracle: cells as identities per (sequence,
// position), entries as token lists with a last-used clock.
struct Oracle {
  int32_t n_cells;
  std::optional<int32_t> max_cells;
  std::map<seq_t, std::map<int64_t, int64_t>> cells;  // live sequence -> position -> cell
  std::map<seq_t, std::pair<Tokens, uint64_t>> entries;
  uint64_t clock = 0;
  int64_t next_cell = 0;

  void new_cells(seq_t seq, int64_t start, int64_t n) {
    for (int64_t p = start; p < start + n; ++p) cells[seq][p] = next_cell++;
  }
  void start(seq_t seq, std::optional<seq_t> src, int64_t upto) {
    cells[seq].clear();
    if (!src) return;
    for (auto [p, cell] : cells[*src]) {
      if (p < upto) cells[seq][p] = cell;
    }
  }
  std::set<int64_t> used(const std::vector<seq_t>& seqs) const {
    std::set<int64_t> out;
    for (seq_t s : seqs) {
      for (auto [p, cell] : cells.at(s)) out.insert(cell);
    }
    return out;
  }
  std::vector<seq_t> all() const {
    std::vector<seq_t> out;
    for (const auto& [s, m] : cells) out.push_back(s);
    return out;
  }
  int64_t free() const { return n_cells - static_cast<int64_t>(used(all()).size()); }
  int64_t reclaim(const std::vector<seq_t>& victims) const {
    std::vector<seq_t> others;
    for (seq_t s : all()) {
      if (std::find(victims.begin(), victims.end(), s) == victims.end()) others.push_back(s);
    }
    std::set<int64_t> mine = used(victims), theirs = used(others);
    int64_t n = 0;
    for (int64_t cell : mine) n += theirs.count(cell) ? 0 : 1;
    return n;
  }
  void free_seq(seq_t seq) {
    cells.erase(seq);
    entries.erase(seq);
  }
  void touch(seq_t seq) { entries[seq].second = ++clock; }
  std::vector<seq_t> lru() const {
    std::vector<seq_t> out;
    for (const auto& [s, e] : entries) out.push_back(s);
    std::sort(out.begin(), out.end(),
              [&](seq_t a, seq_t b) { return entries.at(a).second < entries.at(b).second; });
    return out;
  }
  seq_t latest(const std::vector<seq_t>& seqs) const {
    seq_t best = seqs[0];
    for (seq_t s : seqs) {
      if (entries.at(s).second > entries.at(best).second) best = s;
    }
    return best;
  }
  PrefixMatch match(const Tokens& prompt) {
    if (entries.empty()) return {};
    int64_t best = 0;
    for (const auto& [s, e] : entries) best = std::max(best, lcp(e.first, prompt));
    const int64_t usable = std::min<int64_t>(best, static_cast<int64_t>(prompt.size()) - 1);
    if (usable <= 0) return {};
    std::vector<seq_t> sharing;
    for (const auto& [s, e] : entries) {
      if (lcp(e.first, prompt) == best) sharing.push_back(s);
    }
    seq_t seq = latest(sharing);
    touch(seq);
    return {seq, static_cast<int32_t>(usable)};
  }
  bool evict(int64_t need, int64_t ids, std::optional<seq_t> keep, int64_t live_ids) {
    if (free() >= need && kMaxSequences - live_ids >= ids) return true;
    std::vector<seq_t> victims;
    for (seq_t s : lru()) {
      if (keep != s) victims.push_back(s);
    }
    if (free() + reclaim(victims) < need ||
        kMaxSequences - live_ids + static_cast<int64_t>(victims.size()) < ids) {
      return false;
    }
    for (seq_t s : victims) {
      free_seq(s);
      --live_ids;
      if (free() >= need && kMaxSequences - live_ids >= ids) break;
    }
    return true;
  }
  void insert(Tokens tokens, seq_t seq) {
    if (max_cells && static_cast<int64_t>(tokens.size()) > *max_cells) {
      tokens.resize(static_cast<size_t>(*max_cells));
      auto& m = cells[seq];
      for (auto it = m.begin(); it != m.end();) it = it->first >= *max_cells ? m.erase(it) : ++it;
    }
    if (tokens.empty()) {
      free_seq(seq);
      enforce_bound(std::nullopt);
      return;
    }
    std::vector<seq_t> covering;
    for (const auto& [s, e] : entries) {
      if (e.first.size() >= tokens.size() &&
          std::equal(tokens.begin(), tokens.end(), e.first.begin())) {
        covering.push_back(s);
      }
    }
    if (!covering.empty()) {
      free_seq(seq);
      touch(latest(covering));
      enforce_bound(std::nullopt);
      return;
    }
    std::vector<seq_t> covered;
    for (const auto& [s, e] : entries) {
      if (tokens.size() >= e.first.size() &&
          std::equal(e.first.begin(), e.first.end(), tokens.begin())) {
        covered.push_back(s);
      }
    }
    for (seq_t s : covered) free_seq(s);
    entries[seq] = {tokens, 0};
    touch(seq);
    enforce_bound(seq);
  }
  void enforce_bound(std::optional<seq_t> keep) {
    if (!max_cells) return;
    while (true) {
      std::vector<seq_t> es;
      for (const auto& [s, e] : entries) es.push_back(s);
      if (reclaim(es) <= *max_cells) return;
      seq_t victim = -1;
      for (seq_t s : lru()) {
        if (keep != s) {
          victim = s;
          break;
        }
      }
      if (victim < 0) return;
      free_seq(victim);
    }
  }
};

struct Machine {
  std::mt19937 rng;
  std::unique_ptr<CellCache> cache;
  std::unique_ptr<PrefixCache> index;
  Oracle oracle;
  std::vector<std::pair<seq_t, Tokens>> running;
  int failures_before;

  int64_t draw(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  }
  Tokens tokens(int64_t min_size, int64_t max_size) {
    Tokens t(static_cast<size_t>(draw(min_size, max_size)));
    for (auto& x : t) x = draw(1, 3);
    return t;
  }

  void insert(const Tokens& tokens, seq_t seq) {
    CHECK(index->insert(tokens, seq).ok());
    oracle.insert(tokens, seq);
  }

  void request() {
    Tokens prompt = tokens(1, 10);
    Tokens generated = tokens(0, 4);
    bool keep_running = draw(0, 1) && running.size() < 3;
    PrefixMatch got = index->match(prompt);
    PrefixMatch want = oracle.match(prompt);
    CHECK(got.seq == want.seq && got.length == want.length);
    std::optional<seq_t> src;
    if (got.seq >= 0) src = got.seq;
    seq_t seq = src ? cache->seq_clone(*src, got.length).value() : new_seq(*cache);
    oracle.start(seq, src, got.length);
    Tokens all = prompt;
    all.insert(all.end(), generated.begin(), generated.end());
    const int64_t need = static_cast<int64_t>(all.size()) - got.length;
    const int64_t live_ids = cache->n_sequences();
    bool ok = index->evict(need, 0, src);
    CHECK_EQ(ok, oracle.evict(need, 0, src, live_ids));
    if (!ok) {
      CHECK_OK(cache->seq_free(seq));
      oracle.free_seq(seq);
      return;
    }
    extend(*cache, seq, got.length, need);
    oracle.new_cells(seq, got.length, need);
    if (keep_running) {
      running.push_back({seq, all});
    } else {
      insert(all, seq);
    }
  }

  void step() {
    switch (draw(0, 9)) {
      case 0: case 1: case 2: case 3:
        request();
        break;
      case 4:
        if (!running.empty()) {  // finish a running request
          size_t i = static_cast<size_t>(draw(0, static_cast<int64_t>(running.size()) - 1));
          auto [seq, toks] = running[i];
          running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
          insert(toks, seq);
        }
        break;
      case 5:
        if (!running.empty() && running.size() < 4) {  // a request's n > 1 samples
          auto [seq, toks] = running[static_cast<size_t>(
              draw(0, static_cast<int64_t>(running.size()) - 1))];
          seq_t fork = cache->seq_clone(seq).value();
          oracle.start(fork, seq, static_cast<int64_t>(toks.size()));
          running.push_back({fork, toks});
        }
        break;
      case 6:
        if (!running.empty()) {  // a request stopped by an error
          size_t i = static_cast<size_t>(draw(0, static_cast<int64_t>(running.size()) - 1));
          seq_t seq = running[i].first;
          running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
          CHECK_OK(cache->seq_free(seq));
          oracle.free_seq(seq);
          index->enforce_bound();
          oracle.enforce_bound(std::nullopt);
        }
        break;
      case 7: case 8: {
        const int64_t cells = draw(0, 45);
        const int64_t ids_choice[] = {0, 0, 1, kMaxSequences - 2, kMaxSequences};
        const int64_t ids = ids_choice[draw(0, 4)];
        const int64_t live_ids = cache->n_sequences();
        CHECK_EQ(index->evict(cells, ids, std::nullopt),
                 oracle.evict(cells, ids, std::nullopt, live_ids));
        break;
      }
      default:
        if (draw(0, 1)) {  // runner.cache.clear(): the index must notice
          cache->clear();
          oracle.cells.clear();
          oracle.entries.clear();
          running.clear();
          CHECK_EQ(index->size(), 0);
        } else {
          index->clear();
          for (seq_t s : oracle.lru()) oracle.free_seq(s);
        }
    }
  }

  void agrees() {
    CHECK_INVARIANTS(*cache);
    std::vector<seq_t> lru = oracle.lru();
    CHECK(index->seqs() == lru);
    for (const auto& [seq, e] : oracle.entries) {
      CHECK(index->tokens(seq) == e.first);
      CHECK_EQ(cache->seq_len(seq).value(), static_cast<int32_t>(e.first.size()));
      CHECK_EQ(cache->next_pos(seq).value(), static_cast<int32_t>(e.first.size()));
    }
    CHECK_EQ(index->reclaimable_cells(), oracle.reclaim(lru));
    CHECK_EQ(cache->free_cells(), oracle.free());
    CHECK_EQ(cache->n_sequences(), static_cast<int32_t>(oracle.cells.size()));
    if (oracle.max_cells) CHECK(index->reclaimable_cells() <= *oracle.max_cells);
    for (const auto& [seq, toks] : running) {  // eviction never takes a running request's
      CHECK_EQ(cache->seq_len(seq).value(), static_cast<int32_t>(toks.size()));
      CHECK_EQ(cache->next_pos(seq).value(), static_cast<int32_t>(toks.size()));
      CHECK_EQ(cache->seq_len(seq).value(), static_cast<int32_t>(oracle.cells[seq].size()));
    }
  }
};

}  // namespace

TEST(prefix_randomized_agrees_with_the_brute_force_oracle) {
  for (uint32_t run = 0; run < 300; ++run) {
    Machine m;
    m.rng.seed(run);
    const int32_t n_cells = static_cast<int32_t>(m.draw(6, 40));
    std::optional<int32_t> max_cells;
    if (m.draw(0, 1)) max_cells = static_cast<int32_t>(m.draw(0, n_cells));
    m.cache = make(n_cells);
    m.index = make_index(*m.cache, max_cells);
    m.oracle.n_cells = n_cells;
    m.oracle.max_cells = max_cells;
    const int before = failures();
    for (int i = 0; i < 60 && failures() == before; ++i) {
      m.step();
      m.agrees();
    }
    if (failures() != before) {
      std::fprintf(stderr, "  (randomized run %u diverged)\n", run);
      break;
    }
  }
}
