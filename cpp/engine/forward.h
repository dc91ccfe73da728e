// Forward: what the engine runs one step on. A StepBatch goes in, one logits
// row per requested token comes out.
//
// CellCacheProgram (program.h) is the real one: a cell-cache .pte run by
// ExecuTorch. Tests and the Python binding supply synthetic ones (logits from
// a formula), so the scheduler and the engine are exercised without a model.
// An implementation declares the batch on its cache (cache().declare_step)
// and serves every layer, exactly as the exported graph does, so the cache's
// bookkeeping is the one a real program would leave.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "cellcache/cell_cache.h"
#include "run_status.h"

namespace cellcache::runner {

// One forward's tokens, in graph order.
struct StepBatch {
  std::vector<seq_t> seq_ids;        // [n_tok] sequence of each token
  std::vector<int64_t> tokens;       // [n_tok]
  std::vector<int64_t> positions;    // [n_tok]
  std::vector<int64_t> logits_for;   // [n_out] token indices whose logits come back

  void clear() {
    seq_ids.clear();
    tokens.clear();
    positions.clear();
    logits_for.clear();
  }
};

class Forward {
 public:
  virtual ~Forward() = default;
  // The cache every step is declared on; it outlives the Forward's users.
  virtual CellCache& cache() = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t max_tokens_per_step() const = 0;
  // The program's stop tokens (EOS ids; may be empty).
  virtual const std::vector<int64_t>& eos_ids() const = 0;
  // The tokenizer.json the program embeds; empty when none (speculative
  // decoding refuses a draft whose tokenizer differs: speculative.h).
  virtual std::string_view tokenizer_json() const { return {}; }
  // Runs one step: returns float32 [logits_for.size() * vocab_size()]
  // row-major, valid until the next call. User errors: a batch that breaks
  // the step rules (lengths, budget, vocabulary) or does not fit in the free
  // cells. Runtime errors: the forward failed; the positions it placed are
  // removed again, those held before stay.
  virtual Outcome<std::span<const float>> forward(const StepBatch& batch) = 0;
};

}  // namespace cellcache::runner
