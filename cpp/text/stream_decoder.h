// StreamDecoder: the text of a growing token list, piece by piece, as a
// streaming client gets it (the Python server's StreamDecoder,
// executorch_cellcache/runtime/tokenizer.py): a piece never ends inside a
// multi-byte character (its bytes wait for the rest), special tokens add
// nothing, and invalid bytes come out as U+FFFD at once, one per maximal
// invalid subsequence, as Python's UTF-8 decoder with errors="replace" does
// (the Unicode Standard's "U+FFFD substitution of maximal subparts", ch. 3.9),
// with CPython's timing (a truncated surrogate waits for the next byte).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tokenizer.h"

namespace cellcache::runner {

class Utf8Stream {
 public:
  // Bytes in, whole UTF-8 out (U+FFFD for what cannot be one).
  std::string push(std::string_view bytes);
  // What is still held, as U+FFFD ("" when nothing is).
  std::string flush();

 private:
  void feed(uint8_t b, std::string& out);
  std::string held_;
  int need_ = 0;               // bytes of the character held_ starts
  // held_ is ED A0-BF: invalid (a surrogate), but CPython's incremental
  // decoder (Objects/unicodeobject.c, "truncated surrogate") holds it until
  // the next byte rather than replace it at once; so do we.
  bool surrogate_ = false;
  uint8_t lo_ = 0x80, hi_ = 0xBF;  // the range of the next byte
};

class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  // The text token completes ("" while a character waits for its next bytes).
  std::string push(int64_t token) {
    return tokenizer_->is_special(token) ? std::string() : utf8_.push(tokenizer_->token_bytes(token));
  }
  std::string flush() { return utf8_.flush(); }

 private:
  const Tokenizer* tokenizer_;
  Utf8Stream utf8_;
};

}  // namespace cellcache::runner
