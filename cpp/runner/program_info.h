// ProgramInfo: what a cell-cache .pte says about itself.
//
// Read from the program's constant methods (executorch_cellcache/cache/metadata.py
// writes them): each is a method with no inputs returning ints. Strings
// (model name, tokenizer) are not needed here: the runner works on token ids.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cellcache/window.h"

namespace cellcache::runner {

// The metadata format this runner reads (metadata.FORMAT_VERSION).
constexpr int64_t kFormatVersion = 1;

struct ProgramInfo {
  int32_t n_cells = 0;
  int32_t n_layers = 0;
  std::vector<Window> windows;  // one per layer (or one for all); nullopt = full causal
  int64_t vocab_size = 0;
  std::optional<int64_t> bos_id;
  std::vector<int64_t> eos_ids;  // may be empty
  int32_t max_tokens_per_step = 0;
  // K/V storage dtype ("fp32" or "fp16"); the optional method kv_dtype, and
  // "fp32" for programs written before it existed.
  std::string kv_dtype = "fp32";
};

// The K/V dtypes this runner (its attention kernel) supports.
inline bool kv_dtype_supported(const std::string& d) { return d == "fp32" || d == "fp16"; }

}  // namespace cellcache::runner
