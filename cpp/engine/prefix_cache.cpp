// PrefixCache: the C++ twin of executorch_cellcache/runtime/prefix_cache.py
// (see prefix_cache.h). Each function mirrors the Python one of the same name
// (underscore dropped) step by step, so both make the same choices.
#include "prefix_cache.h"

#include <algorithm>
#include <limits>
#include <string>

namespace cellcache::runner {

struct PrefixCache::Node {
  std::vector<int64_t> edge;  // tokens from the parent to this node
  Node* parent = nullptr;
  std::unordered_map<int64_t, std::unique_ptr<Node>> children;  // by first edge token
  Entry* entry = nullptr;     // on leaves; on an inner node only in a pooled cache
};

struct PrefixCache::Entry {
  seq_t seq = -1;
  uint64_t serial = 0;    // the id's lifetime when the cache took it (seq_serial)
  int32_t length = 0;     // positions held: 0 .. length-1
  Node* node = nullptr;
  uint64_t last_used = 0; // the index's clock when last inserted or matched
  std::list<Entry*>::iterator lru_pos;
};

namespace {

int64_t common_prefix_len(const std::vector<int64_t>& edge, std::span<const int64_t> tokens,
                          int64_t start) {
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(edge.size()),
                                      static_cast<int64_t>(tokens.size()) - start);
  int64_t k = 0;
  while (k < n && edge[k] == tokens[start + k]) ++k;
  return k;
}

}  // namespace

PrefixCache::PrefixCache(CellCache& cache, std::optional<int32_t> max_cells)
    : cache_(cache), max_cells_(max_cells), root_(std::make_unique<Node>()) {}

PrefixCache::~PrefixCache() = default;

Outcome<std::unique_ptr<PrefixCache>> PrefixCache::create(CellCache& cache,
                                                          std::optional<int32_t> max_cells) {
  // The bound holds in every pool: up to the largest pool's cells it bounds
  // something (a smaller pool is then bounded by its own size).
  int32_t largest = 0;
  for (int32_t p = 0; p < cache.n_pools(); ++p) {
    largest = std::max(largest, cache.pool_state(p).value().capacity);
  }
  if (max_cells && (*max_cells < 0 || *max_cells > largest)) {
    return user_error("prefix_cache_cells must be an integer in [0, " + std::to_string(largest) +
                      "] (the cache's cells" +
                      std::string(cache.n_pools() > 1 ? " in its largest pool" : "") +
                      "), got " + std::to_string(*max_cells) + "; omit it for no bound");
  }
  return std::unique_ptr<PrefixCache>(new PrefixCache(cache, max_cells));
}

// ------------------------------------------------------------------ queries

int32_t PrefixCache::size() {
  prune();
  return static_cast<int32_t>(lru_.size());
}

std::vector<seq_t> PrefixCache::seqs() {
  prune();
  std::vector<seq_t> out;
  out.reserve(lru_.size());
  for (const Entry* e : lru_) out.push_back(e->seq);
  return out;
}

std::optional<std::vector<int64_t>> PrefixCache::tokens(seq_t seq) const {
  auto it = entries_.find(seq);
  if (it == entries_.end()) return std::nullopt;
  std::vector<int64_t> out;
  for (const Node* node = it->second->node; node != nullptr; node = node->parent) {
    out.insert(out.begin(), node->edge.begin(), node->edge.end());
  }
  return out;
}

int32_t PrefixCache::reclaimable_cells() {
  int32_t total = 0;
  for (int32_t n : reclaimable_cells_per_pool()) total += n;
  return total;
}

std::vector<int32_t> PrefixCache::reclaimable_cells_per_pool() {
  prune();
  std::vector<seq_t> seqs;
  seqs.reserve(lru_.size());
  for (const Entry* e : lru_) seqs.push_back(e->seq);
  std::vector<int32_t> out;
  for (int32_t p = 0; p < cache_.n_pools(); ++p) {
    auto n = cache_.cells_owned_only_by(seqs, p);
    out.push_back(n.is_ok() ? n.value() : 0);  // cannot fail: every entry is live after prune()
  }
  return out;
}

PrefixMatch PrefixCache::match(std::span<const int64_t> prompt) {
  prune();
  while (true) {
    Entry* broken = nullptr;
    // Deepest match first; an entry failing holds_prefix at a length fails at
    // every shorter one too (the reclaim check is monotone in upto), so going
    // up a level only finds other entries.
    for (const auto& [top, depth] : levels(prompt)) {
      const int64_t usable = std::min<int64_t>(depth, static_cast<int64_t>(prompt.size()) - 1);
      if (usable <= 0) return {};
      for (Entry* entry : entries_below(top)) {
        if (!holds_exactly(entry->seq, entry->length)) {
          broken = entry;
          break;
        }
        if (holds(entry->seq, usable)) {
          touch(*entry);
          return {entry->seq, static_cast<int32_t>(usable)};
        }
      }
      if (broken != nullptr) break;
    }
    if (broken == nullptr) return {};
    const seq_t seq = broken->seq;
    remove(*broken);  // someone changed our sequence: never serve it
    (void)cache_.seq_free(seq);
  }
}

void PrefixCache::record(int32_t prompt_len, int32_t cached) {
  stats_.requests += 1;
  stats_.hits += cached > 0 ? 1 : 0;
  stats_.prompt_tokens += prompt_len;
  stats_.cached_tokens += cached;
}

// ------------------------------------------------------------------ changes

Outcome<> PrefixCache::insert(std::span<const int64_t> tokens, seq_t seq) {
  const std::string name = "sequence " + std::to_string(seq);
  prune();  // an entry whose id was freed and handed out again is not seq's
  if (entries_.count(seq)) return user_error(name + " is already cached");
  auto len = cache_.seq_len(seq);
  auto next = cache_.next_pos(seq);
  if (!len.is_ok()) return runtime_error("prefix cache insert: " + len.status().message());
  if (!next.is_ok()) return runtime_error("prefix cache insert: " + next.status().message());
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (!(len.value() == next.value() && next.value() == n)) {
    return user_error(name + " holds " + std::to_string(len.value()) + " positions below " +
                      std::to_string(next.value()) +
                      "; a cached sequence must hold exactly positions 0.." +
                      std::to_string(n - 1) + " of its " + std::to_string(n) + " tokens");
  }
  Outcome<> placed = place(std::vector<int64_t>(tokens.begin(), tokens.end()), seq);
  if (!placed.ok()) return placed;
  // Also when seq was freed: cells it shared with entries are theirs alone now.
  enforce_bound(entries_.count(seq) ? std::optional<seq_t>(seq) : std::nullopt);
  return {};
}

bool PrefixCache::evict(int64_t cells_needed, int64_t ids_needed, std::optional<seq_t> keep) {
  const std::vector<int64_t> every(static_cast<size_t>(cache_.n_pools()), cells_needed);
  return evict(every, ids_needed, keep);
}

bool PrefixCache::evict(std::span<const int64_t> cells_needed, int64_t ids_needed,
                        std::optional<seq_t> keep) {
  prune();
  if (room(cells_needed, ids_needed)) return true;
  std::vector<seq_t> victims;
  victims.reserve(lru_.size());
  for (const Entry* e : lru_) {
    if (keep != e->seq) victims.push_back(e->seq);
  }
  for (size_t p = 0; p < cells_needed.size(); ++p) {
    const auto pool = static_cast<int32_t>(p);
    auto owned = cache_.cells_owned_only_by(victims, pool);
    auto state = cache_.pool_state(pool);
    // cells_owned_only_by cannot fail on live entries; a pool out of range can.
    if (!owned.is_ok() || !state.is_ok() ||
        static_cast<int64_t>(state.value().free_cells) + owned.value() < cells_needed[p]) {
      return false;
    }
  }
  if (static_cast<int64_t>(kMaxSequences) - cache_.n_sequences() +
          static_cast<int64_t>(victims.size()) < ids_needed) {
    return false;
  }
  for (seq_t seq : victims) {
    evict_one(seq);
    if (room(cells_needed, ids_needed)) break;
  }
  return true;
}

void PrefixCache::enforce_bound(std::optional<seq_t> keep) {
  if (!max_cells_) return;
  // cut() keeps an entry within the bound in every pool: keep alone fits.
  auto over = [&] {
    const std::vector<int32_t> per_pool = reclaimable_cells_per_pool();
    return *std::max_element(per_pool.begin(), per_pool.end()) > *max_cells_;
  };
  while (over()) {
    const Entry* victim = nullptr;
    for (const Entry* e : lru_) {
      if (keep != e->seq) {
        victim = e;
        break;
      }
    }
    // Only keep is left (the Python raises StopIteration here). Unreachable
    // while keep holds exactly its <= max_cells positions.
    if (victim == nullptr) return;
    evict_one(victim->seq);
  }
}

void PrefixCache::clear() {
  prune();
  for (const Entry* e : lru_) (void)cache_.seq_free(e->seq);
  root_ = std::make_unique<Node>();
  lru_.clear();
  entries_.clear();
}

// ------------------------------------------------------------------ internals

Outcome<> PrefixCache::place(std::vector<int64_t> tokens, seq_t seq) {
  if (max_cells_) {
    auto kept = cut(tokens, seq);
    if (!kept.ok()) return kept.error();
    if (!kept.value()) return {};
  }
  if (tokens.empty()) {
    Status s = cache_.seq_free(seq);
    if (!s.is_ok()) return runtime_error("prefix cache insert: " + s.message());
    return {};
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  Walk w = walk(tokens);
  if (w.depth == n) {  // a prefix of (or equal to) a cached path
    if (Entry* cover = covering(w.partial ? w.partial : w.node, seq, n)) {
      Status s = cache_.seq_free(seq);
      if (!s.is_ok()) return runtime_error("prefix cache insert: " + s.message());
      touch(*cover);
      return {};
    }
    Node* node = w.node;
    if (w.partial == nullptr && node->entry != nullptr) {
      // The same tokens, in an entry that serves fewer prefixes: take its place.
      const seq_t old = node->entry->seq;
      lru_.erase(node->entry->lru_pos);
      node->entry = nullptr;
      entries_.erase(old);
      Status s = cache_.seq_free(old);
      if (!s.is_ok()) return runtime_error("prefix cache insert: " + s.message());
    } else if (w.partial != nullptr) {
      node = split(w.partial, w.depth - depth(node));
    }
    return set_entry(node, seq, n);
  }
  Node* node = w.node;
  if (w.partial != nullptr) node = split(w.partial, w.depth - depth(node));
  auto leaf_owner = std::make_unique<Node>();
  Node* leaf = leaf_owner.get();
  leaf->edge.assign(tokens.begin() + w.depth, tokens.end());
  leaf->parent = node;
  node->children[tokens[w.depth]] = std::move(leaf_owner);
  if (auto set = set_entry(leaf, seq, n); !set.ok()) return set;
  Entry* old = node->entry;  // an entry that is a prefix of the new one
  if (old != nullptr && holds(seq, shortest_held(old->seq, old->length))) {
    const seq_t old_seq = old->seq;
    remove(*old);
    Status s = cache_.seq_free(old_seq);
    if (!s.is_ok()) return runtime_error("prefix cache insert: " + s.message());
  }
  return {};
}

Outcome<> PrefixCache::set_entry(Node* node, seq_t seq, int64_t length) {
  auto serial = cache_.seq_serial(seq);
  if (!serial.is_ok()) return runtime_error("prefix cache insert: " + serial.status().message());
  auto owner = std::make_unique<Entry>();
  Entry* entry = owner.get();
  entry->seq = seq;
  entry->serial = serial.value();
  entry->length = static_cast<int32_t>(length);
  entry->node = node;
  entry->lru_pos = lru_.insert(lru_.end(), entry);
  node->entry = entry;
  entries_[seq] = std::move(owner);
  touch(*entry);
  return {};
}

bool PrefixCache::holds(seq_t seq, int64_t upto) const {
  auto held = cache_.holds_prefix(seq, static_cast<pos_t>(upto));
  return held.is_ok() && held.value();
}

int64_t PrefixCache::shortest_held(seq_t seq, int64_t length) const {
  int64_t lo = 1, hi = length;  // holds_prefix(seq, length) always: nothing is cut
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (holds(seq, mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

PrefixCache::Entry* PrefixCache::covering(Node* top, seq_t seq, int64_t length) const {
  const int64_t shortest = shortest_held(seq, length);
  for (Entry* entry : entries_below(top)) {
    if (holds(entry->seq, shortest)) return entry;
  }
  return nullptr;
}

Outcome<bool> PrefixCache::cut(std::vector<int64_t>& tokens, seq_t seq) {
  // A pool that gave up seq's positions below `below` holds len - below of
  // them: the longest prefix within the bound everywhere is max_cells + the
  // smallest below (max_cells in a pool that reclaims nothing).
  pos_t below = std::numeric_limits<pos_t>::max();
  for (int32_t p = 0; p < cache_.n_pools(); ++p) {
    auto gone = cache_.reclaimed(seq, p);
    if (!gone.is_ok()) return runtime_error("prefix cache insert: " + gone.status().message());
    below = std::min(below, gone.value().below);
  }
  const int64_t keep = int64_t{*max_cells_} + below;
  if (static_cast<int64_t>(tokens.size()) <= keep) return true;
  if (!holds(seq, keep)) {  // a windowed pool gave up what that prefix needs: not cached
    Status s = cache_.seq_free(seq);
    if (!s.is_ok()) return runtime_error("prefix cache insert: " + s.message());
    return false;
  }
  Status s = cache_.seq_rm(seq, static_cast<pos_t>(keep));
  if (!s.is_ok()) return runtime_error("prefix cache insert: " + s.message());
  tokens.resize(static_cast<size_t>(keep));
  return true;
}

bool PrefixCache::room(std::span<const int64_t> cells, int64_t ids) const {
  for (size_t p = 0; p < cells.size(); ++p) {
    auto state = cache_.pool_state(static_cast<int32_t>(p));
    if (!state.is_ok() || state.value().free_cells < cells[p]) return false;
  }
  return static_cast<int64_t>(kMaxSequences) - cache_.n_sequences() >= ids;
}

bool PrefixCache::holds_exactly(seq_t seq, int64_t length) const {
  auto len = cache_.seq_len(seq);
  auto next = cache_.next_pos(seq);
  return len.is_ok() && next.is_ok() && len.value() == next.value() && next.value() == length;
}

void PrefixCache::prune() {
  std::vector<Entry*> stale;
  for (Entry* e : lru_) {
    auto serial = cache_.seq_serial(e->seq);  // fails only for an unknown sequence
    if (!serial.is_ok() || serial.value() != e->serial) stale.push_back(e);
  }
  for (Entry* e : stale) remove(*e);
}

PrefixCache::Levels PrefixCache::levels(std::span<const int64_t> tokens) const {
  Levels out;
  Node* node = root_.get();
  int64_t depth = 0;
  const int64_t n = static_cast<int64_t>(tokens.size());
  while (depth < n) {
    auto it = node->children.find(tokens[depth]);
    if (it == node->children.end()) break;
    Node* child = it->second.get();
    const int64_t k = common_prefix_len(child->edge, tokens, depth);
    if (k < static_cast<int64_t>(child->edge.size())) {
      out.emplace_back(child, depth + k);
      break;
    }
    node = child;
    depth += k;
    out.emplace_back(node, depth);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

PrefixCache::Walk PrefixCache::walk(std::span<const int64_t> tokens) const {
  const Levels found = levels(tokens);
  if (found.empty()) return {root_.get(), 0, nullptr};
  const auto [top, depth] = found[0];
  const int64_t above = found.size() > 1 ? found[1].second : 0;
  if (depth - above < static_cast<int64_t>(top->edge.size())) {
    return {top->parent, depth, top};  // the match ended inside top's edge
  }
  return {top, depth, nullptr};
}

int64_t PrefixCache::depth(const Node* node) {
  int64_t d = 0;
  for (; node != nullptr; node = node->parent) d += static_cast<int64_t>(node->edge.size());
  return d;
}

std::vector<PrefixCache::Entry*> PrefixCache::entries_below(Node* node) {
  std::vector<Entry*> found;
  std::vector<Node*> stack{node};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (n->entry != nullptr) found.push_back(n->entry);
    for (auto& [token, child] : n->children) stack.push_back(child.get());
  }
  std::sort(found.begin(), found.end(),
            [](const Entry* a, const Entry* b) { return a->last_used > b->last_used; });
  return found;
}

PrefixCache::Node* PrefixCache::split(Node* child, int64_t k) {
  Node* parent = child->parent;
  const int64_t key = child->edge[0];
  std::unique_ptr<Node> child_owner = std::move(parent->children[key]);
  auto mid = std::make_unique<Node>();
  mid->edge.assign(child->edge.begin(), child->edge.begin() + k);
  mid->parent = parent;
  child->edge.erase(child->edge.begin(), child->edge.begin() + k);
  child->parent = mid.get();
  mid->children[child->edge[0]] = std::move(child_owner);
  Node* out = mid.get();
  parent->children[key] = std::move(mid);
  return out;
}

void PrefixCache::touch(Entry& entry) {
  ++clock_;
  entry.last_used = clock_;
  lru_.splice(lru_.end(), lru_, entry.lru_pos);
}

void PrefixCache::remove(Entry& entry) {
  lru_.erase(entry.lru_pos);
  Node* node = entry.node;
  node->entry = nullptr;
  const seq_t seq = entry.seq;  // a copy: erase destroys entry
  entries_.erase(seq);
  Node* root = root_.get();
  while (node != root && node->entry == nullptr && node->children.empty()) {
    Node* parent = node->parent;
    const int64_t key = node->edge[0];  // a copy: erase destroys node
    parent->children.erase(key);
    node = parent;
  }
  if (node != root && node->entry == nullptr && node->children.size() == 1) {
    std::unique_ptr<Node> child = std::move(node->children.begin()->second);
    node->children.clear();
    node->edge.insert(node->edge.end(), child->edge.begin(), child->edge.end());
    node->children = std::move(child->children);
    for (auto& [token, grandchild] : node->children) grandchild->parent = node;
    node->entry = child->entry;
    if (node->entry != nullptr) node->entry->node = node;
  }
}

void PrefixCache::evict_one(seq_t seq) {
  auto it = entries_.find(seq);
  if (it == entries_.end()) return;
  remove(*it->second);
  (void)cache_.seq_free(seq);
  stats_.evictions += 1;
}

}  // namespace cellcache::runner
