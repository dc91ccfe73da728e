// How deeply JSON text nests ([ and { outside strings), read without parsing
// it: the recursive parsers, printers and compilers the text layer hands JSON
// to (nlohmann's dump, llama.cpp's Jinja values, XGrammar's schema converter)
// use the C++ stack, so text past a bound is refused before any of them sees
// it. Malformed text gives some number; its parser then says what is wrong.
#pragma once

#include <string_view>

namespace cellcache::runner {

// The most JSON values may nest in the text layer's inputs (a schema, a
// chat's messages, tools and tool-call arguments); --stdio's line limit is
// the same (stdio_server.h kMaxStdioDepth).
inline constexpr int kMaxJsonNesting = 64;

inline int json_nesting(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

}  // namespace cellcache::runner
