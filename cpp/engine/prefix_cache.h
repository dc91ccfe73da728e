// PrefixCache: finished requests' sequences stay in the cell cache, indexed by
// their token ids, so a later request that starts with the same tokens clones
// their cells (seq_clone(cached, upto=L): no K/V copied, no cell allocated)
// and prefills only the rest (SPEC section 9). The C++ twin of
// executorch_cellcache/runtime/prefix_cache.py: the same rules, the same
// choices (which entry serves, which is evicted), so both runtimes plan the
// same steps.
//
// A radix tree over token ids (edges are runs of tokens). Each entry is a
// sequence id of the CellCache holding the K/V of exactly positions
// 0 .. length-1 of its tokens.
//
// Rules (see prefix_cache.py for the reasons):
//  - match: the longest common prefix L of the prompt with any entry, capped
//    at len(prompt) - 1; of the entries below that point the most recently
//    used one that still holds what the prefix needs in every pool
//    (CellCache::holds_prefix(seq, L); a windowed pool that reclaimed an
//    entry's early cells cannot serve short prefixes of it, issue #25) serves
//    and is marked used; when none does, the next shorter match point up the
//    tree (other entries), down to a miss. An entry whose sequence no longer
//    holds exactly 0..length-1 is dropped (and freed) instead of served. With
//    one pool holds_prefix is always true: the rule is the one before pools.
//  - insert (dedupe): a sequence whose tokens are a prefix of (or equal to) an
//    entry's is freed when that entry covers it, and the most recently used
//    covering entry marked used; an entry whose tokens are a prefix of the
//    new one is freed when the new one covers it. An entry covers a shorter
//    one when it serves every prefix the shorter one can (holds_prefix at the
//    shorter one's shortest servable length; holds_prefix is monotone in the
//    length, so a binary search finds it): always in a cache that reclaims
//    nothing, where entries are exactly the tree's leaves; in a pooled cache
//    a short entry a reclaimed long one does not cover stays, at an inner
//    node.
//  - LRU eviction; evicting frees the entry's sequence, so only cells no other
//    sequence owns become free: a cell a running request shares is never
//    freed. evict() evicts nothing when even evicting every entry (but keep)
//    would not suffice.
//  - bound (max_cells): in every pool, the cells only the cache holds stay <=
//    max_cells after every insert; an entry holding more than max_cells cells
//    in some pool is first cut to the longest prefix within the bound
//    (max_cells + the lowest of its pools' reclaimed horizons,
//    CellCache::reclaimed; with one pool its first max_cells positions, as
//    before pools), or freed (not
//    cached) when a windowed pool no longer holds that prefix (holds_prefix).
//  - pools (issue #25): room and eviction count each pool's free cells and
//    the cells only cached sequences own there (cells_owned_only_by per pool).
//  - ids: an entry holds a sequence id; an id freed or cleared by someone
//    else is recognised by its serial (seq_serial) and dropped, freeing
//    nothing.
//
// Not thread-safe: the engine's stepping thread drives it, like the cache.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "cellcache/cell_cache.h"
#include "run_status.h"

namespace cellcache::runner {

struct PrefixCacheStats {
  int64_t requests = 0;        // requests admitted with this prefix cache
  int64_t hits = 0;            // of them, those that reused at least one cached token
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;   // prompt tokens served from cached cells
  int64_t evictions = 0;       // entries evicted for room or for the bound

  double hit_rate() const { return requests ? static_cast<double>(hits) / requests : 0.0; }
};

// The result of match(): the entry to clone from and the usable prefix length
// (seq = -1 and length = 0 on a miss).
struct PrefixMatch {
  seq_t seq = -1;
  int32_t length = 0;
};

class PrefixCache {
 public:
  // max_cells: nullopt = no bound, else in [0, the largest pool's capacity]
  // (user error otherwise, checked by create).
  static Outcome<std::unique_ptr<PrefixCache>> create(CellCache& cache,
                                                      std::optional<int32_t> max_cells);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Number of entries.
  int32_t size();
  // Cached sequence ids, least recently used first.
  std::vector<seq_t> seqs();
  // The token ids cached sequence seq holds (nullopt when seq is no entry).
  // Inspection; like the Python tokens(), it does not prune.
  std::optional<std::vector<int64_t>> tokens(seq_t seq) const;
  // Cells only cached sequences own, summed over the pools.
  int32_t reclaimable_cells();
  // [n_pools] those of each pool.
  std::vector<int32_t> reclaimable_cells_per_pool();
  std::optional<int32_t> max_cells() const { return max_cells_; }
  const PrefixCacheStats& stats() const { return stats_; }

  // The entry holding the longest usable prefix of prompt (L <= size - 1);
  // marks it used. The caller clones it before anything may evict it.
  PrefixMatch match(std::span<const int64_t> prompt);
  // Counts one admitted request (hit rate, cached-token totals).
  void record(int32_t prompt_len, int32_t cached);

  // Takes ownership of seq, which must hold exactly the K/V of tokens at
  // positions 0 .. tokens.size()-1 (user error otherwise; seq stays the
  // caller's). It becomes an entry or is freed (dedupe); then the bound is
  // enforced.
  Outcome<> insert(std::span<const int64_t> tokens, seq_t seq);
  // Frees least-recently-used entries (never keep) until every pool p has
  // cells_needed[p] free cells (cells_needed: one entry per pool of the
  // cache) and ids_needed ids are free. Returns whether it has them; evicts
  // nothing when even evicting every other entry would not do.
  bool evict(std::span<const int64_t> cells_needed, int64_t ids_needed,
             std::optional<seq_t> keep);
  // evict with cells_needed free cells in every pool.
  bool evict(int64_t cells_needed, int64_t ids_needed, std::optional<seq_t> keep);
  // Evicts LRU entries (never keep) until reclaimable_cells_per_pool() <=
  // max_cells in every pool.
  void enforce_bound(std::optional<seq_t> keep = std::nullopt);
  // Frees every cached sequence still this cache's and empties the index.
  void clear();

 private:
  struct Node;
  struct Entry;
  PrefixCache(CellCache& cache, std::optional<int32_t> max_cells);
  // The nodes along a walk, deepest first, each with the tokens its entries
  // share with the walked tokens (prefix_cache.py _levels).
  using Levels = std::vector<std::pair<Node*, int64_t>>;
  Levels levels(std::span<const int64_t> tokens) const;
  // Where a walk down the tree stopped (see walk()).
  struct Walk {
    Node* node;       // the deepest node whose whole path is a prefix of the tokens
    int64_t depth;    // tokens matched
    Node* partial;    // the child of node inside whose edge the match ended, or null
  };

  // (implementation's own helpers, named after prefix_cache.py's)
  // After prune() every entry's id is live with the serial it was taken
  // with, so the cache calls on entries below cannot fail; were one to fail
  // anyway, the entry is dropped (as prune would drop it), never an abort.
  void prune();
  bool holds_exactly(seq_t seq, int64_t length) const;
  bool room(std::span<const int64_t> cells, int64_t ids) const;
  // The bound's cut of a new entry (the rule above): tokens cut to what seq
  // keeps, or false when seq was freed instead. prefix_cache.py _cut.
  Outcome<bool> cut(std::vector<int64_t>& tokens, seq_t seq);
  // The shortest prefix length >= 1 that seq (holding 0..length-1) can still
  // serve (binary search: holds_prefix is monotone). prefix_cache.py _shortest_held.
  int64_t shortest_held(seq_t seq, int64_t length) const;
  // The most recently used entry at or below top that serves every prefix
  // seq (of `length` tokens) can, or null. prefix_cache.py _covering.
  Entry* covering(Node* top, seq_t seq, int64_t length) const;
  bool holds(seq_t seq, int64_t upto) const;  // holds_prefix, false on error
  // Makes seq the entry of node (LRU newest). prefix_cache.py _set_entry.
  Outcome<> set_entry(Node* node, seq_t seq, int64_t length);
  Outcome<> place(std::vector<int64_t> tokens, seq_t seq);
  Walk walk(std::span<const int64_t> tokens) const;
  static int64_t depth(const Node* node);
  // Every entry below node, most recently used first.
  static std::vector<Entry*> entries_below(Node* node);
  static Node* split(Node* child, int64_t k);
  void touch(Entry& entry);
  // Takes entry out of the index and destroys it (copy its seq first).
  void remove(Entry& entry);
  void evict_one(seq_t seq);

  CellCache& cache_;
  std::optional<int32_t> max_cells_;
  PrefixCacheStats stats_;
  std::unique_ptr<Node> root_;
  std::list<Entry*> lru_;  // oldest first
  std::unordered_map<seq_t, std::unique_ptr<Entry>> entries_;
  uint64_t clock_ = 0;
};

}  // namespace cellcache::runner
