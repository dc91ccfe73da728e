#include "program_info.h"

#include <cstdio>

namespace cellcache::runner {

namespace {

// A JSON string: quotes, backslashes and control characters escaped, every
// other byte (UTF-8 included) as is.
void append_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned char>(c));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void append_key(std::string& out, const char* key) {
  if (out.size() > 1) out += ", ";
  append_string(out, key);
  out += ": ";
}

}  // namespace

std::string to_json(const ProgramInfo& info) {
  std::string out = "{";
  auto integer = [&](const char* key, int64_t v) {
    append_key(out, key);
    out += std::to_string(v);
  };
  auto text = [&](const char* key, const std::string& v) {
    append_key(out, key);
    append_string(out, v);
  };
  integer("n_cells", info.n_cells);
  integer("n_layers", info.n_layers);
  append_key(out, "windows");
  out += '[';
  for (size_t i = 0; i < info.windows.size(); ++i) {
    if (i) out += ", ";
    out += info.windows[i] ? std::to_string(*info.windows[i]) : "null";
  }
  out += ']';
  integer("vocab_size", info.vocab_size);
  append_key(out, "bos_id");
  out += info.bos_id ? std::to_string(*info.bos_id) : "null";
  append_key(out, "eos_ids");
  out += '[';
  for (size_t i = 0; i < info.eos_ids.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(info.eos_ids[i]);
  }
  out += ']';
  integer("max_tokens_per_step", info.max_tokens_per_step);
  append_key(out, "window_cells");
  if (info.window_cells.empty()) {
    out += "null";
  } else {
    out += '{';
    for (size_t i = 0; i < info.window_cells.size(); ++i) {
      if (i) out += ", ";
      append_string(out, std::to_string(info.window_cells[i].window));
      out += ": " + std::to_string(info.window_cells[i].n_cells);
    }
    out += '}';
  }
  integer("retained_margin", info.retained_margin);
  text("kv_dtype", info.kv_dtype);
  text("attention", info.attention);
  text("quantize", info.quantize);
  integer("group_size", info.group_size);
  text("embedding_quantize", info.embedding_quantize);
  text("model_type", info.model_type);
  text("model_name", info.model_name);
  text("tokenizer_kind", info.tokenizer_kind);
  text("tokenizer_json", info.tokenizer_json);
  text("chat_template", info.chat_template);
  return out + "}";
}

CacheConfig cache_config(const ProgramInfo& info) {
  return CacheConfig(info.n_cells, info.n_layers, info.windows, info.window_cells,
                     info.retained_margin);
}

}  // namespace cellcache::runner
