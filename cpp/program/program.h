// CellCacheProgram: a loaded cell-cache .pte, the CellCache it drives, and
// its forward.
//
// Loads the program with ExecuTorch's Module, configures a CellCache from the
// program's metadata (program_info.h), registers it so the graph's place/mask
// kernels reach it by handle, and runs one declared step per forward, the way
// executorch_cellcache/runtime/runner.py does:
//   forward(tokens     int64 [n_tok],
//           positions  int64 [n_tok],
//           logits_for int64 [n_out],
//           handle     int64 [1]              the cache's registry handle,
//           extent     uint8 [planned_used_end]  (only its length is read))
//     -> logits float32 [n_out, vocab]
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cellcache/cell_cache.h"
#include "forward.h"
#include "program_info.h"
#include "run_status.h"

namespace executorch::extension::module {
class Module;
}

namespace cellcache::runner {

class CellCacheProgram final : public Forward {
 public:
  // User errors: the file is missing, is a folder, is not an ExecuTorch
  // program, has no (or an unsupported version of) cell-cache metadata.
  static Outcome<std::unique_ptr<CellCacheProgram>> load(const std::string& pte_path);
  ~CellCacheProgram() override;
  CellCacheProgram(const CellCacheProgram&) = delete;
  CellCacheProgram& operator=(const CellCacheProgram&) = delete;

  const ProgramInfo& info() const { return info_; }
  // The cache the forward serves (the runner's BatchControl face).
  CellCache& cache() override { return *cache_; }
  const CellCache& cache() const { return *cache_; }
  int64_t vocab_size() const override { return info_.vocab_size; }
  int32_t max_tokens_per_step() const override { return info_.max_tokens_per_step; }
  const std::vector<int64_t>& eos_ids() const override { return info_.eos_ids; }
  std::string_view tokenizer_json() const override { return info_.tokenizer_json; }

  // One forward: checks the batch, declares it on the cache, runs it.
  // Returns logits float32 [logits_for.size() * vocab] row-major, valid until
  // the next forward. User errors: inconsistent lengths, more tokens than
  // max_tokens_per_step, a token outside the vocabulary, a step that does not
  // fit in the free cells. Runtime errors: the forward failed (with the
  // cache's own error when a cell-cache kernel refused the step); the
  // positions it placed are removed again, those held before stay.
  Outcome<std::span<const float>> forward(const StepBatch& batch) override;

 private:
  CellCacheProgram(std::unique_ptr<executorch::extension::module::Module> module,
                   ProgramInfo info, std::unique_ptr<CellCache> cache);
  Outcome<> check_batch(const StepBatch& batch) const;

  std::unique_ptr<executorch::extension::module::Module> module_;
  ProgramInfo info_;
  std::unique_ptr<CellCache> cache_;
  int64_t handle_ = 0;             // registry handle of cache_
  std::vector<uint8_t> extent_;    // [largest pool's cells] backing store of the extent input
};

}  // namespace cellcache::runner
