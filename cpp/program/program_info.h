// ProgramInfo: what a cell-cache .pte says about itself.
//
// Read from the program's constant methods (program.cpp), the ones
// ops/program_metadata.yaml declares and executorch_cellcache/cache/metadata.py
// writes: ints, int lists, and strings carried as uint8 tensors of UTF-8.
// The runner itself works on token ids; the strings are for an app, which
// builds its tokenizer from tokenizer_kind and tokenizer_json (e.g. with
// ExecuTorch's pytorch/tokenizers, which reads a tokenizer.json) and renders
// chat_template, so the .pte alone is enough.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cellcache/cell_cache.h"
#include "cellcache/window.h"

namespace cellcache::runner {

struct ProgramInfo {
  int32_t n_cells = 0;
  int32_t n_layers = 0;
  std::vector<Window> windows;  // one per layer (or one for all); nullopt = full causal
  int64_t vocab_size = 0;
  std::optional<int64_t> bos_id;
  std::vector<int64_t> eos_ids;  // may be empty
  int32_t max_tokens_per_step = 0;
  // Pools (issue #25; the optional methods window_cells and retained_margin):
  // one {window, cells} per sliding window of the layers, in increasing
  // window order, each sizing that window's pool (n_cells then sizes the
  // full-attention pool); empty = one pool of n_cells cells for every layer
  // (the metadata's [0], and programs written before it).
  std::vector<WindowPool> window_cells;
  // R of every windowed pool: positions kept below each owner's window, so
  // a rollback of up to R + 1 positions stays possible (cell_pool.h).
  int32_t retained_margin = kDefaultRetainedMargin;
  // K/V storage dtype (one of kKvDtypes); the optional method kv_dtype, and
  // "fp32" for programs written before it existed.
  std::string kv_dtype = "fp32";
  // The attention path the graph runs (the optional method attention):
  // "cells" (cellcache::attend) or "reference" (the dense mask; programs
  // written before attention existed). A pooled program needs "cells": the
  // dense-mask path reads one extent of one pool (program.cpp refuses it).
  std::string attention = "reference";
  // Optional methods (absent in older programs: fp32). The runner needs no
  // flag for them: it refuses a mode it does not know, and the quantized
  // kernels are linked in (cpp/program/CMakeLists.txt).
  std::string quantize;            // "" (fp32), "8da4w" or "8da8w"
  int64_t group_size = 0;          // 8da4w weight group; 0 = per channel
  std::string embedding_quantize;  // "" (fp32), "8", "4,32", ...
  std::string model_type;          // config.json's model_type
  std::string model_name;
  // "hf": tokenizer_json holds a Hugging Face tokenizer.json; "bytes" (older
  // programs): UTF-8 bytes are ids 0-255, BOS 256, EOS 257; "none": ids only.
  std::string tokenizer_kind;
  std::string tokenizer_json;      // "" = none
  std::string chat_template;       // jinja2 source; "" = none (optional method)
};

// The info as one JSON object, fields named as above (and as the metadata
// methods): windows as ints with null = full causal, bos_id null when none,
// window_cells as {"W": cells, ...} or null for one pool (Python's
// ProgramInfo.window_cells, a dict or None).
std::string to_json(const ProgramInfo& info);

// The CacheConfig of the cache a program's forward runs on: its pools as
// window_cells says (the layers' K/V buffers are sized to them).
CacheConfig cache_config(const ProgramInfo& info);

// The K/V dtypes this runner (its attention kernel) supports (metadata.py:
// KV_DTYPES; int8: cpp/attention/kv_int8.h).
inline constexpr const char* kKvDtypes[] = {"fp32", "fp16", "int8"};
inline bool kv_dtype_supported(const std::string& d) {
  for (const char* k : kKvDtypes) {
    if (d == k) return true;
  }
  return false;
}

// The weight modes and embedding widths this runner runs (metadata.py:
// WEIGHT_QUANTIZE_MODES, EMBEDDING_QUANTIZE_BITS).
inline constexpr const char* kQuantizeModes[] = {"8da4w", "8da8w"};
inline constexpr int kEmbeddingBits[] = {4, 8};

}  // namespace cellcache::runner
