// Tokenizer: text <-> token ids for an app on a device, built from what the
// program carries (ProgramInfo::tokenizer_kind / tokenizer_json), so the .pte
// alone is enough. The same ids as the Python runtime's tokenizer
// (executorch_cellcache/runtime/tokenizer.py, Hugging Face `tokenizers`).
//
// Kinds:
//  - "hf": a Hugging Face tokenizer.json, encoded by ExecuTorch's C++
//    tokenizer library (pytorch-tokenizers 1.0.1, HFTokenizer, built from its
//    PyPI sdist: scripts/text_deps.py). That library reproduces `tokenizers`
//    for byte-level BPEs (GPT-2's byte alphabet: SmolLM2, the default model);
//    create() refuses a tokenizer.json it would encode differently (another
//    model type, decoder or pre-tokenizer, ByteLevel with use_regex false
//    (Llama 3, Qwen 2), an ordinary token at id 0, added tokens that strip
//    spaces), naming the feature, rather than give other ids than Python.
//  - "bytes": UTF-8 bytes are ids 0-255, BOS 256, EOS 257 (older programs).
//
// Special tokens: added tokens marked "special" (BOS, EOS, chat markers) are
// matched in the text as Python matches them, and decode to nothing.
//
// Errors are user errors (run_status.h) naming the problem; nothing throws.
// A Tokenizer is immutable after create(): encode and the lookups are safe
// from any number of threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "run_status.h"

namespace cellcache::runner {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // kind and json as ProgramInfo holds them. User error: kind "none" or ""
  // (the program carries no tokenizer), an unknown kind, json that is not a
  // tokenizer.json, or one the library cannot reproduce (which feature).
  static Outcome<std::unique_ptr<Tokenizer>> create(std::string_view kind,
                                                    std::string_view json);

  // Token ids of UTF-8 text. add_special_tokens: the post-processor's tokens
  // (tokenizer.json's TemplateProcessing "single", e.g. BOS first), as
  // Python's encode(text, add_special_tokens=True); false for text a chat
  // template rendered (it carries them itself). User error: text that is not
  // valid UTF-8 (the byte offset), over 512 KiB, or with a run of one kind of
  // character (letters, digits, whitespace, punctuation, non-ASCII) over 16
  // KiB: the library's regex and BPE take time quadratic in a run's length.
  virtual Outcome<std::vector<int64_t>> encode(std::string_view text,
                                               bool add_special_tokens) const = 0;

  // Ids 0 .. vocab_size() - 1 (the tokenizer's; the program's logits may be
  // wider).
  virtual int64_t vocab_size() const = 0;

  // The bytes a token stands for in decoded text: a byte-level BPE token's
  // bytes (possibly part of a multi-byte character); "" for a special token
  // and an id outside the vocabulary.
  virtual std::string_view token_bytes(int64_t token) const = 0;

  // An added token marked special (decoding leaves it out).
  virtual bool is_special(int64_t token) const = 0;

  // The vocabulary's string for a token (tokenizer.json's spelling: GPT-2's
  // byte alphabet for a byte-level BPE; a special token's text); nullopt
  // outside the vocabulary.
  virtual std::optional<std::string> token_name(int64_t token) const = 0;
};

// Checks that text is UTF-8 (RFC 3629: no overlong forms, surrogates or code
// points past U+10FFFF). User error naming `what` and the first bad byte's
// offset.
Outcome<> check_utf8(std::string_view text, std::string_view what);

}  // namespace cellcache::runner
