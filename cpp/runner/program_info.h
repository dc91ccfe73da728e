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
  // Optional methods (absent in older programs: fp32). The runner needs no
  // flag for them: it refuses a mode it does not know, and the quantized
  // kernels are linked in (cpp/runner/CMakeLists.txt).
  std::string quantize;            // "" (fp32), "8da4w" or "8da8w"
  int64_t group_size = 0;          // 8da4w weight group; 0 = per channel
  std::string embedding_quantize;  // "" (fp32), "8", "4,32", ...
};

// The K/V dtypes this runner (its attention kernel) supports.
inline bool kv_dtype_supported(const std::string& d) { return d == "fp32" || d == "fp16"; }

// The weight modes and embedding widths this runner runs (metadata.py:
// WEIGHT_QUANTIZE_MODES, EMBEDDING_QUANTIZE_BITS).
inline constexpr const char* kQuantizeModes[] = {"8da4w", "8da8w"};
inline constexpr int kEmbeddingBits[] = {4, 8};

}  // namespace cellcache::runner
