#include "program.h"

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "cellcache/step_batch.h"
#include "cellcache_program_metadata.h"
#include "graph/graph_ops.h"
#include "graph/registry.h"

namespace cellcache::runner {
namespace {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::module::Module;
using executorch::runtime::EValue;

// The inputs of forward (see program.h).
constexpr size_t kForwardInputs = 5;

std::string quoted(const std::string& s) { return "'" + s + "'"; }

Outcome<> check_file(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return user_error("model file " + quoted(path) + " does not exist");
  }
  if (std::filesystem::is_directory(status)) {
    return user_error("model " + quoted(path) + " is a folder, expected a .pte file");
  }
  return {};
}

// Reads the constant methods ops/program_metadata.yaml names (the generated
// cellcache_program_metadata.h), as executorch_cellcache/cache/metadata.py
// does: an optional method a program lacks reads as its default.
class MetadataReader {
 public:
  MetadataReader(Module& module, std::unordered_set<std::string> names)
      : module_(module), names_(std::move(names)) {}

  bool has(const metadata::Method& m) const { return names_.count(m.name) > 0; }

  // An int or ints method's outputs (at least one).
  Outcome<std::vector<int64_t>> ints(const metadata::Method& m) {
    if (m.optional && !has(m)) return std::vector<int64_t>{m.default_int};
    auto outputs = module_.execute(m.name);
    if (!outputs.ok()) {
      return user_error("cannot run the metadata method " + quoted(m.name) + " (" +
                        executorch::runtime::to_string(outputs.error()) + ")");
    }
    std::vector<int64_t> values;
    for (const EValue& value : outputs.get()) {
      if (!value.isInt()) {
        return user_error("metadata method " + quoted(m.name) + " does not return integers");
      }
      values.push_back(value.toInt());
    }
    if (values.empty()) {
      return user_error("metadata method " + quoted(m.name) + " returns nothing");
    }
    return values;
  }

  Outcome<int64_t> integer(const metadata::Method& m) {
    auto values = ints(m);
    if (!values.ok()) return values.error();
    return values.value()[0];
  }

  // An int method in [1, int32 max].
  Outcome<int32_t> count(const metadata::Method& m) {
    auto v = integer(m);
    if (!v.ok()) return v.error();
    if (v.value() < 1 || v.value() > std::numeric_limits<int32_t>::max()) {
      return user_error("metadata " + std::string(m.name) + " = " + std::to_string(v.value()) +
                        " is out of range");
    }
    return static_cast<int32_t>(v.value());
  }

  // A text method: one uint8 tensor of UTF-8, trailing 0 bytes dropped.
  Outcome<std::string> text(const metadata::Method& m) {
    if (m.optional && !has(m)) return std::string(m.default_text);
    auto outputs = module_.execute(m.name);
    if (!outputs.ok() || outputs.get().size() != 1 || !outputs.get()[0].isTensor()) {
      return user_error("cannot read the metadata text " + quoted(m.name));
    }
    const auto& t = outputs.get()[0].toTensor();
    if (t.scalar_type() != ScalarType::Byte) {
      return user_error("metadata " + quoted(m.name) + " is not a UTF-8 byte tensor");
    }
    std::string text(t.const_data_ptr<char>(), static_cast<size_t>(t.numel()));
    while (!text.empty() && text.back() == '\0') text.pop_back();
    return text;
  }

 private:
  Module& module_;
  std::unordered_set<std::string> names_;
};

// The quantization a program records, refused when this runner cannot run it.
Outcome<> read_quantization(MetadataReader& read, ProgramInfo& info) {
  auto mode = read.text(metadata::quantize);
  if (!mode.ok()) return mode.error();
  auto embedding = read.text(metadata::embedding_quantize);
  if (!embedding.ok()) return embedding.error();
  auto group = read.integer(metadata::group_size);
  if (!group.ok()) return group.error();
  info.quantize = mode.value();
  info.embedding_quantize = embedding.value();
  info.group_size = group.value();
  const std::string& weights = info.quantize;  // const: std::quoted must not win overload
  const std::string& rows = info.embedding_quantize;
  if (!info.quantize.empty() &&
      std::none_of(std::begin(kQuantizeModes), std::end(kQuantizeModes),
                   [&](const char* m) { return info.quantize == m; })) {
    return user_error("the weights are quantized as " + quoted(weights) +
                      ", which this runner cannot run (it knows 8da4w, 8da8w)");
  }
  if (!info.embedding_quantize.empty()) {
    const std::string bits = info.embedding_quantize.substr(0, info.embedding_quantize.find(','));
    if (std::none_of(std::begin(kEmbeddingBits), std::end(kEmbeddingBits),
                     [&](int b) { return bits == std::to_string(b); })) {
      return user_error("the embedding is quantized as " + quoted(rows) +
                        ", which this runner cannot run (bits 4, 8)");
    }
  }
  return {};
}

// The texts an app needs beside the token ids: the model's names, its
// tokenizer and chat template.
Outcome<> read_texts(MetadataReader& read, ProgramInfo& info) {
  const std::pair<const metadata::Method*, std::string*> fields[] = {
      {&metadata::model_type, &info.model_type},
      {&metadata::model_name, &info.model_name},
      {&metadata::tokenizer_kind, &info.tokenizer_kind},
      {&metadata::tokenizer_json, &info.tokenizer_json},
      {&metadata::chat_template, &info.chat_template},
  };
  for (const auto& [method, field] : fields) {
    auto value = read.text(*method);
    if (!value.ok()) return value.error();
    *field = std::move(value.value());
  }
  return {};
}

// The pools a program records (issue #25): window_cells as [W1, cells1, W2,
// cells2, ...] pairs of positive ints ([0]: one pool), and retained_margin.
// Whether the pairs fit the layer list (every sliding window sized once, no
// other) and the margin's range are the cache's checks (CellCache::create),
// whose errors name the window.
Outcome<> read_pools(MetadataReader& read, ProgramInfo& info) {
  auto pairs = read.ints(metadata::window_cells);
  if (!pairs.ok()) return pairs.error();
  auto margin = read.integer(metadata::retained_margin);
  if (!margin.ok()) return margin.error();
  if (margin.value() < 0 || margin.value() > std::numeric_limits<int32_t>::max()) {
    return user_error("metadata retained_margin = " + std::to_string(margin.value()) +
                      " is out of range");
  }
  info.retained_margin = static_cast<int32_t>(margin.value());
  auto attention = read.text(metadata::attention);
  if (!attention.ok()) return attention.error();
  info.attention = attention.value();
  const std::vector<int64_t>& v = pairs.value();
  if (v == std::vector<int64_t>{0}) return {};
  auto listed = [&] {
    std::string out;
    for (int64_t x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
    return "[" + out + "]";
  };
  const bool positive = std::all_of(v.begin(), v.end(), [](int64_t x) {
    return x >= 1 && x <= std::numeric_limits<int32_t>::max();
  });
  if (v.size() % 2 != 0 || !positive) {
    return user_error("metadata window_cells must hold (window, cells) pairs of positive "
                      "integers, got " + listed());
  }
  for (size_t i = 0; i < v.size(); i += 2) {
    info.window_cells.push_back(
        {static_cast<int32_t>(v[i]), static_cast<int32_t>(v[i + 1])});
  }
  if (info.attention != "cells") {
    // The dense-mask path reads one extent of one pool (export refuses to
    // write such a program; an altered or foreign one is refused here).
    return user_error("a program with a cell pool per window policy needs the 'cells' "
                      "attention path, this one names '" + info.attention + "'; re-export it");
  }
  return {};
}

Outcome<ProgramInfo> read_info(MetadataReader& read) {
  auto format = read.integer(metadata::cellcache_format);
  if (!format.ok()) return format.error();
  if (format.value() != metadata::kFormatVersion) {
    return user_error("cell-cache format " + std::to_string(format.value()) +
                      " is not supported (expects " + std::to_string(metadata::kFormatVersion) +
                      "); re-export the model");
  }
  ProgramInfo info;
  auto n_cells = read.count(metadata::n_cells);
  if (!n_cells.ok()) return n_cells.error();
  auto n_layers = read.count(metadata::n_layers);
  if (!n_layers.ok()) return n_layers.error();
  auto max_step = read.count(metadata::max_tokens_per_step);
  if (!max_step.ok()) return max_step.error();
  auto windows = read.ints(metadata::windows);
  if (!windows.ok()) return windows.error();
  auto vocab = read.integer(metadata::vocab_size);
  if (!vocab.ok()) return vocab.error();
  auto bos = read.integer(metadata::bos_id);
  if (!bos.ok()) return bos.error();
  auto eos = read.ints(metadata::eos_ids);
  if (!eos.ok()) return eos.error();
  info.n_cells = n_cells.value();
  info.n_layers = n_layers.value();
  info.max_tokens_per_step = max_step.value();
  for (int64_t w : windows.value()) {
    if (w < 0 || w > std::numeric_limits<int32_t>::max()) {
      return user_error("metadata window " + std::to_string(w) + " is out of range");
    }
    info.windows.push_back(w == 0 ? Window{} : Window{static_cast<int32_t>(w)});
  }
  info.vocab_size = vocab.value();
  if (info.vocab_size < 1) {
    return user_error("metadata vocab_size = " + std::to_string(info.vocab_size) +
                      " is out of range");
  }
  auto kv = read.text(metadata::kv_dtype);
  if (!kv.ok()) return kv.error();
  info.kv_dtype = kv.value();
  if (!kv_dtype_supported(info.kv_dtype)) {
    std::string known;
    for (const char* k : kKvDtypes) known += (known.empty() ? "" : ", ") + std::string(k);
    return user_error("K/V dtype '" + info.kv_dtype + "'" +
                      " is not supported by this runner (supported: " + known + "); re-export "
                      "the model");
  }
  if (bos.value() >= 0) info.bos_id = bos.value();
  for (int64_t e : eos.value()) {
    if (e >= 0) info.eos_ids.push_back(e);
  }
  if (auto pools = read_pools(read, info); !pools.ok()) return pools.error();
  if (auto quantization = read_quantization(read, info); !quantization.ok()) {
    return quantization.error();
  }
  if (auto texts = read_texts(read, info); !texts.ok()) return texts.error();
  return info;
}

Outcome<> check_forward(Module& module) {
  auto meta = module.method_meta("forward");
  if (!meta.ok() || meta->num_inputs() != kForwardInputs) {
    return user_error("the program's forward does not take the 5 cell-cache inputs "
                      "(tokens, positions, logits_for, handle, extent)");
  }
  if (module.load_method("forward") != executorch::runtime::Error::Ok) {
    return user_error("cannot load the program's forward (missing operator or backend?)");
  }
  return {};
}

// (sequence, next_pos before the step) for each distinct sequence of a step.
std::vector<std::pair<seq_t, pos_t>> held_ends(const CellCache& cache,
                                               const std::vector<seq_t>& seq_ids) {
  std::vector<std::pair<seq_t, pos_t>> ends;
  for (seq_t seq : seq_ids) {
    if (std::any_of(ends.begin(), ends.end(), [&](const auto& e) { return e.first == seq; })) {
      continue;
    }
    auto end = cache.next_pos(seq);
    if (end.is_ok()) ends.emplace_back(seq, end.value());
  }
  return ends;
}

// A forward that failed after placing left cells whose K/V some layers never
// wrote: remove the positions the step placed (those at or after each
// sequence's next_pos before the step) so no later step reads them.
void undo_partial_step(CellCache& cache, const std::vector<std::pair<seq_t, pos_t>>& held_end) {
  for (const auto& [seq, end] : held_end) {
    auto now = cache.next_pos(seq);
    if (now.is_ok() && now.value() > end) {
      // Cannot fail: seq is live and end >= 0.
      (void)cache.seq_rm(seq, end);
    }
  }
}

// "in the F free cells of C" for the first pool with fewer than n_tok free
// cells (naming the pool when the cache has several).
std::string full_pool(const CellCache& cache, int32_t n_tok) {
  for (int32_t p = 0; p < cache.n_pools(); ++p) {
    const PoolState pool = cache.pool_state(p).value();  // p < n_pools: cannot fail
    if (pool.free_cells >= n_tok) continue;
    std::string name;
    if (cache.n_pools() > 1) {
      name = pool.window ? " of the window-" + std::to_string(*pool.window) + " pool"
                         : " of the full-attention pool";
    }
    return "in the " + std::to_string(pool.free_cells) + " free cells of " +
           std::to_string(pool.capacity) + name;
  }
  return "in the free cells";  // declare_step refused: some pool lacks room
}

// The extent input's backing store: the largest pool's cells (planned_used_end
// never exceeds its pool's capacity).
size_t largest_pool(const CellCache& cache) {
  int32_t cells = 0;
  for (int32_t p = 0; p < cache.n_pools(); ++p) {
    cells = std::max(cells, cache.pool_state(p).value().capacity);
  }
  return static_cast<size_t>(cells);
}

}  // namespace

Outcome<std::unique_ptr<CellCacheProgram>> CellCacheProgram::load(const std::string& pte_path) {
  executorch::runtime::runtime_init();
  if (auto file = check_file(pte_path); !file.ok()) return file.error();
  auto module = std::make_unique<Module>(pte_path, Module::LoadMode::Mmap);
  if (module->load() != executorch::runtime::Error::Ok) {
    return user_error(quoted(pte_path) + " is not a loadable ExecuTorch program");
  }
  auto names = module->method_names();
  if (!names.ok() || !names->count(metadata::cellcache_format.name) || !names->count("forward")) {
    return user_error(quoted(pte_path) + " has no cell-cache metadata; export it with "
                      "`cellcache export` or executorch_cellcache.export");
  }
  MetadataReader reader(*module, std::move(names.get()));
  auto info = read_info(reader);
  if (!info.ok()) return user_error(pte_path + ": " + info.error().message);
  if (auto forward = check_forward(*module); !forward.ok()) {
    return user_error(pte_path + ": " + forward.error().message);
  }
  const ProgramInfo& i = info.value();
  auto cache = CellCache::create(cache_config(i));
  if (!cache.is_ok()) {
    return user_error(pte_path + ": bad cell-cache metadata: " + cache.status().message());
  }
  return std::unique_ptr<CellCacheProgram>(new CellCacheProgram(
      std::move(module), std::move(info.value()), std::move(cache.value())));
}

CellCacheProgram::CellCacheProgram(std::unique_ptr<Module> module, ProgramInfo info,
                                   std::unique_ptr<CellCache> cache)
    : module_(std::move(module)),
      info_(std::move(info)),
      cache_(std::move(cache)),
      handle_(register_cache(cache_.get())),
      extent_(largest_pool(*cache_)) {}

CellCacheProgram::~CellCacheProgram() { unregister_cache(handle_); }

Outcome<> CellCacheProgram::check_batch(const StepBatch& b) const {
  const Status checked = check_step_batch(b.seq_ids.size(), b.tokens, b.positions.size(),
                                          b.logits_for, info_.max_tokens_per_step,
                                          info_.vocab_size);
  if (!checked.is_ok()) return user_error(checked.message());
  return {};
}

Outcome<std::span<const float>> CellCacheProgram::forward(const StepBatch& b) {
  if (auto checked = check_batch(b); !checked.ok()) return checked.error();
  auto declared = cache_->declare_step(b.seq_ids);
  if (!declared.is_ok()) {
    return runtime_error("declare_step: [" +
                         std::string(status_code_name(declared.status().code())) + "] " +
                         declared.status().message());
  }
  if (!declared.value()) {
    return user_error("a step of " + std::to_string(b.tokens.size()) + " tokens does not fit " +
                      full_pool(*cache_, static_cast<int32_t>(b.tokens.size())));
  }
  // from_blob never writes through these pointers: ExecuTorch copies inputs
  // into the method's planned memory.
  auto blob = [](const std::vector<int64_t>& v) {
    return from_blob(const_cast<int64_t*>(v.data()),
                     {static_cast<executorch::aten::SizesType>(v.size())}, ScalarType::Long);
  };
  auto tokens = blob(b.tokens);
  auto positions = blob(b.positions);
  auto logits_for = blob(b.logits_for);
  auto handle = from_blob(&handle_, {1}, ScalarType::Long);
  auto extent = from_blob(extent_.data(), {cache_->planned_used_end()}, ScalarType::Byte);

  const auto held_end = held_ends(*cache_, b.seq_ids);
  clear_last_op_error();
  auto outputs = module_->execute(
      "forward", {EValue(*tokens), EValue(*positions), EValue(*logits_for), EValue(*handle),
                  EValue(*extent)});
  if (!outputs.ok()) {
    undo_partial_step(*cache_, held_end);
    const Status& op = last_op_error();
    if (!op.is_ok()) {
      return runtime_error("forward failed: [" + std::string(status_code_name(op.code())) +
                           "] " + op.message());
    }
    return runtime_error(std::string("forward failed: ") +
                         executorch::runtime::to_string(outputs.error()));
  }
  const size_t n_out = b.logits_for.size();
  if (outputs->empty() || !(*outputs)[0].isTensor()) {
    return runtime_error("forward returned no logits tensor");
  }
  const auto& logits = (*outputs)[0].toTensor();
  if (logits.scalar_type() != ScalarType::Float || logits.dim() != 2 ||
      static_cast<size_t>(logits.size(0)) != n_out || logits.size(1) != info_.vocab_size) {
    return runtime_error("forward returned logits of an unexpected dtype or shape (expected "
                         "float32 [" + std::to_string(n_out) + ", " +
                         std::to_string(info_.vocab_size) + "])");
  }
  const float* data = logits.const_data_ptr<float>();
  // The output lives in the method's memory until the next execute: no copy
  // (at B=8 and a 49k vocabulary a copy is 1.5 MB a step).
  return std::span<const float>(data, n_out * static_cast<size_t>(info_.vocab_size));
}

}  // namespace cellcache::runner
