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
// step; its buffer is reused across steps.
//
// Errors: every fallible call returns a Status (status.h) naming the offending
// value; a failed call changes nothing. Not thread-safe: one thread drives a
// cache (the runner, then the forward it runs).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cellcache/cell_table.h"
#include "cellcache/status.h"
#include "cellcache/window.h"

namespace cellcache {

constexpr int32_t kMaxCells = 1 << 24;   // 16M tokens: far beyond any on-device cache
constexpr int32_t kMaxLayers = 1 << 12;

struct CacheConfig {
  int32_t n_cells = 0;          // 1 .. kMaxCells
  int32_t n_layers = 0;         // 1 .. kMaxLayers
  std::vector<Window> windows;  // 1 entry (all layers) or n_layers entries
};

// Checks a config; kInvalidConfig naming the problem, or ok.
Status validate(const CacheConfig& config);

// One served layer of a placed step. The spans point into the cache and stay
// valid until the next declare_step, sequence verb, or clear.
struct LayerStep {
  std::span<const cell_t> cells;  // [n_tok] the cell of each token
  std::span<const uint8_t> mask;  // [n_tok * used_end] row-major, 1 = attend
  int32_t n_tok = 0;
  int32_t used_end = 0;           // mask row length
};

class CellCache {
 public:
  // kInvalidConfig when validate(config) fails.
  static Result<std::unique_ptr<CellCache>> create(const CacheConfig& config);

  // ---- sequence verbs (BatchControl) ----
  // Lowest unused id. kCapacity when all kMaxSequences ids are live.
  Result<seq_t> seq_new();
  // New sequence owning src's cells with position < upto (all when nullopt).
  // Shares cells (one more owner bit each); allocates no cell.
  // kUnknownSequence, kPositionConflict (upto < 0), kCapacity (no free id).
  Result<seq_t> seq_clone(seq_t src, std::optional<pos_t> upto = std::nullopt);
  // seq stops owning positions in [p0, p1) (p1 nullopt = to the end); cells
  // left with no owner free. kUnknownSequence; kPositionConflict when p0 < 0
  // or p1 < p0.
  Status seq_rm(seq_t seq, pos_t p0 = 0, std::optional<pos_t> p1 = std::nullopt);
  // Removes every position of seq and releases its id. kUnknownSequence.
  Status seq_free(seq_t seq);
  // Empties every cell and releases every id.
  void clear();

  // ---- queries ----
  // One past the highest position seq holds (0 when empty).
  Result<pos_t> next_pos(seq_t seq) const;
  // Number of positions seq holds.
  Result<int32_t> seq_len(seq_t seq) const;
  int32_t capacity() const { return table_.size(); }
  int32_t free_cells() const { return table_.free_count(); }
  cell_t used_end() const { return table_.used_end(); }
  // One past the highest cell any step ever placed into (never decreases,
  // not reset by clear): cells below it hold K/V some forward wrote, so an
  // attention extent up to it never reads uninitialized cache memory.
  cell_t written_end() const { return written_end_; }
  bool can_extend(int32_t n_tok) const { return n_tok >= 0 && n_tok <= free_cells(); }
  int32_t n_layers() const { return static_cast<int32_t>(layer_policy_.size()); }
  // Live sequence ids (handed out and not freed).
  int32_t n_sequences() const;
  // Occupied cells whose every owner is in `seqs` (duplicates allowed): the
  // cells that seq_free of all of `seqs` would free. A prefix cache counts
  // with it the cells it alone holds. O(used_end). kUnknownSequence.
  Result<int32_t> cells_owned_only_by(std::span<const seq_t> seqs) const;
  // A number naming this lifetime of the id `seq`: each seq_new/seq_clone
  // hands out a larger one, never reused by this cache (not even after
  // clear), so a holder of (id, serial) can tell that its id was freed and
  // handed out again. kUnknownSequence.
  Result<uint64_t> seq_serial(seq_t seq) const;
  // [n_cells] the position held by each cell, -1 = empty (inspection).
  std::span<const pos_t> cell_positions() const { return table_.positions(); }
  // The window of a layer; kLayerOutOfRange.
  Result<Window> window(int32_t layer) const;

  // ---- step protocol (kernels) ----
  // true = admitted and declared (replacing a declared step that has not
  // finished); false = does not fit, nothing changed. kUnknownSequence.
  Result<bool> declare_step(std::span<const seq_t> seq_ids);
  // used_end once the declared step has placed (the attention extent a
  // forward needs). Meaningful after declare_step returned true.
  cell_t planned_used_end() const { return planned_used_end_; }
  // Serves `layer` of the declared step; see the protocol above.
  // kLayerOutOfRange, kStepNotDeclared (none declared, or layer already
  // served), kStepInvalidated, kPositionConflict (count differs from the
  // declaration, a position out of range / rewriting / not increasing, or
  // positions differing from those the step placed with).
  Result<LayerStep> place_step(std::span<const int64_t> positions, int32_t layer);
  // The placement and mask of a layer already served in the current step.
  // kLayerOutOfRange, kStepNotDeclared (layer not served), kStepInvalidated.
  Result<LayerStep> served_layer(int32_t layer) const;

  // Recomputes all derived state from the cells and compares (tests).
  Status check_invariants() const;

 private:
  explicit CellCache(const CacheConfig& config);

  enum class StepState { kNone, kDeclared, kInvalidated };

  Status check_live(seq_t seq) const;
  Result<seq_t> lowest_unused_id() const;
  // Rule 5 of the step protocol: removes a partly served step's placement.
  void abandon_partial_step();
  Status check_layer(int32_t layer) const;
  Status check_step_positions(std::span<const int64_t> positions) const;
  void place_declared(std::span<const int64_t> positions);
  void build_mask(int32_t policy);
  LayerStep layer_step(int32_t layer) const;
  // Called by every successful verb before it acts: abandons a partly served
  // step; a declared step can no longer run; served masks go stale.
  void invalidate_step();
  // Per-sequence count and highest position, rescanned from the cells.
  void rescan_sequence(seq_t seq);

  CellTable table_;

  SeqSet live_;                       // ids handed out and not freed
  std::vector<int32_t> seq_count_;    // [kMaxSequences] positions held
  std::vector<pos_t> seq_max_pos_;    // [kMaxSequences] highest held, -1 none
  std::vector<uint64_t> seq_serial_;  // [kMaxSequences] serial of each live id
  uint64_t last_serial_ = 0;          // the latest serial handed out

  // Layer policies: layer_policy_[l] indexes policies_ (distinct windows).
  std::vector<Window> policies_;
  std::vector<int32_t> layer_policy_;

  // The current step.
  StepState step_state_ = StepState::kNone;
  std::vector<seq_t> step_seqs_;   // [n_tok] declared sequence of each token
  std::vector<cell_t> step_cells_; // [n_tok] chosen at declare, stamped at place
  std::vector<pos_t> step_pos_;    // [n_tok] positions once placed
  bool step_placed_ = false;
  cell_t planned_used_end_ = 0;
  cell_t written_end_ = 0;
  std::vector<uint8_t> layer_served_;  // [n_layers]
  int32_t n_served_ = 0;
  std::vector<std::vector<uint8_t>> policy_mask_;  // [n_policies] buffers
  std::vector<uint8_t> policy_built_;              // [n_policies] this step
};

}  // namespace cellcache
