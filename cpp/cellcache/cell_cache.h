// CellCache: a multi-sequence KV cache's bookkeeping (SPEC section 1).
//
// The K/V tensors live elsewhere (in the exported graph); this class decides
// which cell holds which token of which sequence and which cells each token
// may attend. It has no torch and no ExecuTorch dependency.
//
// Two faces:
//  - sequence verbs (the runner's BatchControl): seq_new, seq_clone, seq_rm,
//    seq_free, clear, and the queries next_pos, seq_len, free_cells, ...
//  - the step protocol (the kernels' face), one step per forward:
//      1. declare_step(seq_ids): one id per token in graph order; the admission
//         gate. false = the tokens do not fit; nothing changed. The cells the
//         step will use are chosen here (lowest free first), so an admitted step
//         never fails for lack of space.
//      2. place_step(positions, layer): the first layer served stamps the
//         chosen cells with the positions and owner bits; later layers reuse
//         that placement. Each layer is served at most once per step.
//      3. A step only extends its sequences: per sequence, positions strictly
//         increase within the step and exceed every position already held.
//         A refused placement changes nothing and leaves the declaration
//         standing (retry with corrected positions).
//      4. A successful sequence verb between declare_step and the last layer
//         invalidates the step; its remaining layers fail with
//         kStepInvalidated instead of using stale cells.
//      5. A step placed but not served on every layer (its forward stopped
//         part-way) holds positions whose K/V later layers never wrote. The
//         next successful verb or declare_step removes them before acting,
//         so no later step attends to them.
//
// Masks: a token of sequence s at position p may attend cell c iff
// s owns c and window_sees(window(layer), pos(c), p) (window.h). A mask is
// [n_tok, used_end] bytes (1 = attend), built once per distinct window per
// step when first asked for; its buffer is reused across steps. The same rule
// in compact form, per-sequence cell lists and each token's range in its list
// (attend_plan.h), is what the attention kernel reads.
//
// Pools (issue #25): by default one pool of cells serves every layer. A cache
// configured with window_pools holds one pool per distinct window policy of
// its layers (full, W1, W2, ...), each with its own cells; a step places each
// token once in every pool (declare_step admits it only if every pool has
// room) and a layer's cells, masks and attention plan are its pool's. The
// sequence verbs act on every pool. A windowed pool reclaims the cells that
// no owner can see again, keeping a rollback margin (cell_pool.h); a verb
// that would need a reclaimed position back is refused with kBelowReclaimed.
//
// Errors: every fallible call returns a Status (status.h) naming the offending
// value; a failed call changes nothing. Not thread-safe: one thread drives a
// cache (the runner, then the forward it runs).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "cellcache/attend_plan.h"
#include "cellcache/cell_pool.h"
#include "cellcache/cell_table.h"
#include "cellcache/status.h"
#include "cellcache/window.h"

namespace cellcache {

constexpr int32_t kMaxCells = 1 << 24;   // 16M tokens: far beyond any on-device cache
constexpr int32_t kMaxLayers = 1 << 12;
// The retained rollback margin R of a windowed pool when the config names
// none. A sequence can always roll back its latest step whole, and at least
// R + 1 positions (cell_pool.h). 32 covers a speculative decoder's proposals
// (runtime/speculative.py proposes at most 7 a step by default) rolled back
// over several one-token draft steps, at a cost of 32 cells per sequence in
// each windowed pool (6% of a 512-position window).
constexpr int32_t kDefaultRetainedMargin = 32;

// The cells of one windowed pool (issue #25).
struct WindowPool {
  int32_t window = 0;   // a sliding window W of the layer list
  int32_t n_cells = 0;  // 1 .. kMaxCells, and >= W + retained_margin + 1
};

struct CacheConfig {
  CacheConfig() = default;
  CacheConfig(int32_t n_cells, int32_t n_layers, std::vector<Window> windows,
              std::vector<WindowPool> window_pools = {},
              int32_t retained_margin = kDefaultRetainedMargin)
      : n_cells(n_cells),
        n_layers(n_layers),
        windows(std::move(windows)),
        window_pools(std::move(window_pools)),
        retained_margin(retained_margin) {}

  int32_t n_cells = 0;          // 1 .. kMaxCells: the one pool's cells, or, with
                                // window_pools, the full-attention pool's (unused
                                // when no layer has full attention)
  int32_t n_layers = 0;         // 1 .. kMaxLayers
  std::vector<Window> windows;  // 1 entry (all layers) or n_layers entries
  // Empty (the default): one pool of n_cells cells for every layer, nothing
  // reclaimed. Otherwise one entry per distinct sliding window of `windows`
  // (and none for a window no layer has): one pool per window policy, each
  // windowed pool reclaiming cells no owner can see again (cell_pool.h).
  std::vector<WindowPool> window_pools;
  int32_t retained_margin = kDefaultRetainedMargin;  // R >= 0, windowed pools only
};

// One served layer of a placed step. The spans point into the cache and stay
// valid until the next declare_step, sequence verb, or clear. Cell indices are
// those of the layer's pool.
struct LayerStep {
  std::span<const cell_t> cells;  // [n_tok] the cell of each token
  std::span<const uint8_t> mask;  // [n_tok * used_end] row-major, 1 = attend
  int32_t n_tok = 0;
  int32_t used_end = 0;           // mask row length: the pool's used_end at placement
};

// One pool at a glance (pool_state). Spans as LayerStep's.
struct PoolState {
  Window window;                         // the pool's policy (nullopt = full causal,
                                         // or the one pool of several policies)
  bool reclaims = false;                 // a windowed pool of a pooled cache
  int32_t capacity = 0;                  // cells: a layer's K/V buffers hold as many
  int32_t free_cells = 0;
  cell_t used_end = 0;                   // one past the highest occupied cell
  cell_t written_end = 0;                // as CellCache::written_end, for this pool
  cell_t planned_used_end = 0;           // as CellCache::planned_used_end
  std::span<const pos_t> cell_positions; // [capacity] position per cell, -1 = empty
  std::span<const cell_t> step_cells;    // [n_tok] the declared step's cells here
};

class CellCache {
 public:
  // kInvalidConfig when validate(config) fails.
  static Result<std::unique_ptr<CellCache>> create(const CacheConfig& config);

  // ---- sequence verbs (BatchControl); each acts on every pool ----
  // Lowest unused id. kCapacity when all kMaxSequences ids are live.
  Result<seq_t> seq_new();
  // New sequence owning src's cells with position < upto (all when nullopt).
  // Shares cells (one more owner bit each); allocates no cell.
  // kUnknownSequence, kPositionConflict (upto < 0), kCapacity (no free id),
  // kBelowReclaimed (a windowed pool no longer holds what the prefix needs:
  // refused exactly when seq_rm(src, upto) would be).
  Result<seq_t> seq_clone(seq_t src, std::optional<pos_t> upto = std::nullopt);
  // seq stops owning positions in [p0, p1) (p1 nullopt = to the end); cells
  // left with no owner free. kUnknownSequence; kPositionConflict when p0 < 0
  // or p1 < p0; kBelowReclaimed when a windowed pool reclaimed positions of
  // seq that the result would need (CellPool::check_keeps_window): a tail
  // rollback deeper than the pool still holds, or a middle range starting
  // below what it holds (unless from 0 past it); an empty range (p1 == p0)
  // removes nothing and is never refused.
  Status seq_rm(seq_t seq, pos_t p0 = 0, std::optional<pos_t> p1 = std::nullopt);
  // Removes every position of seq and releases its id. kUnknownSequence.
  Status seq_free(seq_t seq);
  // Empties every cell and releases every id.
  void clear();

  // ---- queries ----
  // One past the highest position seq holds (0 when empty).
  Result<pos_t> next_pos(seq_t seq) const;
  // Number of positions seq holds, counting those a windowed pool reclaimed
  // (their K/V is gone but they are still the sequence's).
  Result<int32_t> seq_len(seq_t seq) const;
  // Whether seq_clone(seq, upto) (and seq_rm(seq, upto)) would pass every
  // pool's reclaim check: every pool still holds what a continuation of
  // seq's positions below upto needs. A prefix cache asks before it serves a
  // prefix. kUnknownSequence, kPositionConflict (upto < 0).
  Result<bool> holds_prefix(seq_t seq, pos_t upto) const;
  // The single-pool queries below answer for pool 0 (the pool of layer 0);
  // a pooled cache's other pools answer through pool_state.
  int32_t capacity() const { return pools_[0].capacity(); }
  int32_t free_cells() const { return pools_[0].free_cells(); }
  cell_t used_end() const { return pools_[0].used_end(); }
  // One past the highest cell any step ever placed into (never decreases,
  // not reset by clear): cells below it hold K/V some forward wrote, so an
  // attention extent up to it never reads uninitialized cache memory.
  cell_t written_end() const { return pools_[0].written_end(); }
  // Whether a step of n_tok tokens fits in every pool's free cells.
  bool can_extend(int32_t n_tok) const;
  int32_t n_layers() const { return static_cast<int32_t>(layer_policy_.size()); }
  // Pools: 1 unless configured with window_pools; then one per distinct
  // window of the layer list, numbered in order of first appearance.
  int32_t n_pools() const { return static_cast<int32_t>(pools_.size()); }
  // The pool whose cells a layer reads and writes. kLayerOutOfRange.
  Result<int32_t> pool_of(int32_t layer) const;
  // A pool's state; kInvalidConfig naming a pool index out of range.
  Result<PoolState> pool_state(int32_t pool) const;
  // What `pool` has reclaimed of seq. kUnknownSequence, kInvalidConfig (pool).
  Result<Reclaimed> reclaimed(seq_t seq, int32_t pool) const;
  int32_t retained_margin() const { return retained_margin_; }
  // Live sequence ids (handed out and not freed).
  int32_t n_sequences() const;
  // Occupied cells of `pool` whose every owner is in `seqs` (duplicates
  // allowed): the cells that seq_free of all of `seqs` would free there. A
  // prefix cache counts with it the cells it alone holds. O(used_end).
  // kUnknownSequence, kInvalidConfig (pool out of range).
  Result<int32_t> cells_owned_only_by(std::span<const seq_t> seqs, int32_t pool = 0) const;
  // A number naming this lifetime of the id `seq`: each seq_new/seq_clone
  // hands out a larger one, never reused by this cache (not even after
  // clear), so a holder of (id, serial) can tell that its id was freed and
  // handed out again. kUnknownSequence.
  Result<uint64_t> seq_serial(seq_t seq) const;
  // [n_cells] the position held by each cell of pool 0, -1 = empty.
  std::span<const pos_t> cell_positions() const { return pools_[0].table().positions(); }
  // The window of a layer; kLayerOutOfRange.
  Result<Window> window(int32_t layer) const;

  // ---- step protocol (kernels) ----
  // true = admitted and declared (replacing a declared step that has not
  // finished): every pool has a free cell for every token. false = some
  // pool has not; nothing changed. kUnknownSequence.
  Result<bool> declare_step(std::span<const seq_t> seq_ids);
  // used_end of pool 0 once the declared step has placed (the attention
  // extent a forward needs). Meaningful after declare_step returned true.
  cell_t planned_used_end() const { return pools_[0].planned_used_end(); }
  // [n_tok] the cells of pool 0 chosen for the declared step's tokens.
  std::span<const cell_t> step_cells() const { return pools_[0].step_cells(); }
  // Serves `layer` of the declared step; see the protocol above. Cells and
  // mask are in the layer's pool. When the last layer is served the step is
  // complete and each windowed pool reclaims (cell_pool.h).
  // kLayerOutOfRange, kStepNotDeclared (none declared, or layer already
  // served), kStepInvalidated, kPositionConflict (count differs from the
  // declaration, a position out of range / rewriting / not increasing, or
  // positions differing from those the step placed with).
  Result<LayerStep> place_step(std::span<const int64_t> positions, int32_t layer);
  // place_step without building the layer's mask: the cells of each token.
  Result<std::span<const cell_t>> serve_layer(std::span<const int64_t> positions,
                                              int32_t layer);
  // The placement and mask of a layer already served in the current step
  // (builds the mask of its window on first use).
  // kLayerOutOfRange, kStepNotDeclared (layer not served), kStepInvalidated.
  Result<LayerStep> served_layer(int32_t layer);
  // The attention plan (attend_plan.h) of a layer already served in the
  // current step, in its pool's cells, built once per window per step.
  // Errors as served_layer. The spans stay valid until the next
  // declare_step, verb or clear.
  Result<AttendPlan> attend_plan(int32_t layer);

  // Recomputes all derived state from the cells and compares (tests).
  Status check_invariants() const;

 private:
  explicit CellCache(const CacheConfig& config);

  enum class StepState { kNone, kDeclared, kInvalidated };

  Status check_live(seq_t seq) const;
  Status check_pool(int32_t pool) const;
  Result<seq_t> lowest_unused_id() const;
  // Tokens of seq in a step placed but not finished (rule 5 abandons them).
  int32_t pending_tokens(seq_t seq) const;
  // Every pool's CellPool::check_keeps_window for seq.
  Status check_keeps_windows(seq_t seq, pos_t p0, std::optional<pos_t> p1,
                             const std::string& what) const;
  // Rule 5 of the step protocol: removes a partly served step's placement.
  void abandon_partial_step();
  // A step served on every layer: each windowed pool reclaims.
  void finish_step();
  Status check_layer(int32_t layer) const;
  Status check_served(int32_t layer) const;
  Status check_step_positions(std::span<const int64_t> positions) const;
  void place_declared(std::span<const int64_t> positions);
  void build_mask(int32_t policy);
  LayerStep layer_step(int32_t layer) const;
  CellPool& layer_pool(int32_t layer) { return pools_[policy_pool_[layer_policy_[layer]]]; }
  // Called by every successful verb before it acts: abandons a partly served
  // step; a declared step can no longer run; served masks go stale.
  void invalidate_step();
  // Highest position of seq, re-read from pool 0.
  void rescan_sequence(seq_t seq);
  Status check_pools_agree(seq_t seq) const;
  Status check_window_kept(seq_t seq) const;

  // Pools: one (every policy) or one per policy (window_pools configured).
  std::vector<CellPool> pools_;
  int32_t retained_margin_ = 0;

  SeqSet live_;                       // ids handed out and not freed
  std::vector<pos_t> seq_max_pos_;    // [kMaxSequences] highest held, -1 none
  std::vector<uint64_t> seq_serial_;  // [kMaxSequences] serial of each live id
  uint64_t last_serial_ = 0;          // the latest serial handed out

  // Layer policies: layer_policy_[l] indexes policies_ (distinct windows);
  // policy_pool_[p] is the pool of policy p.
  std::vector<Window> policies_;
  std::vector<int32_t> layer_policy_;
  std::vector<int32_t> policy_pool_;

  // The current step.
  StepState step_state_ = StepState::kNone;
  std::vector<seq_t> step_seqs_;   // [n_tok] declared sequence of each token
  std::vector<pos_t> step_pos_;    // [n_tok] positions once placed
  bool step_placed_ = false;
  std::vector<uint8_t> layer_served_;  // [n_layers]
  int32_t n_served_ = 0;
  std::vector<std::vector<uint8_t>> policy_mask_;  // [n_policies] buffers
  std::vector<uint8_t> policy_built_;              // [n_policies] this step
};

}  // namespace cellcache
