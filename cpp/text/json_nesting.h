// How deeply JSON text nests ([ and { outside strings), read without parsing
// it: the recursive parsers, printers and compilers the text layer hands JSON
// to (nlohmann's dump, llama.cpp's Jinja values, XGrammar's schema converter)
// use the C++ stack, so text past a bound is refused before any of them sees
// it. Malformed text gives some number; its parser then says what is wrong.
#pragma once

#include <cstddef>
#include <string_view>

namespace cellcache::runner {

// The most JSON values may nest in the text layer's inputs (a schema, a
// chat's messages, tools and tool-call arguments); --stdio's line limit is
// the same (stdio_server.h kMaxStdioDepth).
inline constexpr int kMaxJsonNesting = 64;

// Reads JSON text a byte at a time, telling brackets inside strings from
// those outside.
struct JsonBrackets {
  bool in_string = false, escaped = false;
  // +1 for an opening bracket outside strings, -1 for a closing one, else 0.
  int step(char c) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      return 0;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') return 1;
    if (c == ']' || c == '}') return -1;
    return 0;
  }
};

inline int json_nesting(std::string_view text) {
  JsonBrackets brackets;
  int depth = 0, deepest = 0;
  for (char c : text) {
    const int d = brackets.step(c);
    if (d > 0 && ++depth > deepest) deepest = depth;
    if (d < 0 && depth > 0) --depth;
  }
  return deepest;
}

// One past the bracket that closes the one at text[start] ('{' or '['), or
// npos when it does not close.
inline size_t json_closing(std::string_view text, size_t start) {
  JsonBrackets brackets;
  int depth = 0;
  for (size_t i = start; i < text.size(); ++i) {
    depth += brackets.step(text[i]);
    if (depth == 0) return i + 1;
  }
  return std::string_view::npos;
}

}  // namespace cellcache::runner
