// Grammars for structured output: what a request's tokens must spell (a JSON
// schema, a GBNF/EBNF grammar, a regular expression, or XGrammar's
// structural tags for tool calls), compiled against a program's vocabulary,
// and a matcher per sample that says which tokens may come next.
//
// The engine is XGrammar (0.2.8, built from its PyPI sdist by
// scripts/text_deps.py; the library behind vLLM's, SGLang's and Ollama's
// structured output), with three rules of ours on top, where XGrammar alone
// would let invalid JSON or text through:
//  - JSON schemas are rewritten before compiling (rewrite_schema): a string
//    with maxLength/minLength becomes a pattern of non-control characters
//    (XGrammar's own bounded-string rule admits raw control characters and
//    no escapes); a number with multipleOf and both bounds becomes the enum
//    of its values (XGrammar ignores multipleOf); an unbounded one is
//    refused.
//  - JSON is written as Python's json.dumps writes it: no free whitespace,
//    ", " and ": " separators, properties in the schema's order (the Python
//    server's form; small models pad free JSON with blank lines).
//  - Each mask is ANDed with the tokens that keep the output valid UTF-8
//    (XGrammar matches bytes and would accept overlong forms and
//    surrogates).
// Stop tokens (the program's EOS ids) are allowed once the grammar is
// complete; a matcher says when nothing but a stop token could follow, and
// the sample then ends on the token that completed it (finish "stop", no EOS
// emitted), as the Python server's llguidance matcher does.
//
// Errors: compile() gives a user error for an unknown kind, a schema that is
// not JSON, a grammar XGrammar refuses (its message); nothing throws.
// A GrammarCompiler is safe from any thread; a GrammarMatcher is one
// sample's and used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "run_status.h"
#include "tokenizer.h"

namespace cellcache::runner {

// The kinds a request may name, and what source holds for each:
//   "json_schema": a JSON schema (JSON text);
//   "grammar": GBNF / EBNF (llama.cpp's and XGrammar's syntax), root rule "root";
//   "regex": a regular expression the whole output must match;
//   "structural_tag": XGrammar's structural tag (JSON text; tool calls).
inline constexpr const char* kGrammarKinds[] = {"json_schema", "grammar", "regex", "structural_tag"};

struct GrammarSpec {
  std::string kind;
  std::string source;
};

// A JSON schema as this layer compiles it (see above): the rewrite, or a user
// error naming a keyword it cannot honour (with its JSON path).
Outcome<std::string> rewrite_schema(std::string_view schema_json);

class CompiledGrammar;  // XGrammar's, with the vocabulary's UTF-8 tables

class GrammarCompiler {
 public:
  ~GrammarCompiler();
  // The vocabulary: the tokenizer's names, padded with unusable ids up to
  // vocab_size (the logits' width, >= tokenizer.vocab_size()); stop_ids: the
  // tokens that end a complete output (the program's EOS ids). User error:
  // no stop ids, a vocab_size below the tokenizer's.
  static Outcome<std::unique_ptr<GrammarCompiler>> create(const Tokenizer& tokenizer,
                                                          int64_t vocab_size,
                                                          std::vector<int64_t> stop_ids);
  Outcome<std::shared_ptr<const CompiledGrammar>> compile(const GrammarSpec& spec) const;
  int64_t vocab_size() const;

 private:
  struct Impl;
  explicit GrammarCompiler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);
  ~GrammarMatcher();
  GrammarMatcher(GrammarMatcher&&) noexcept;
  GrammarMatcher& operator=(GrammarMatcher&&) noexcept;

  // allowed: uint8 [vocab_size], every entry written: 1 where the token may
  // come next. Runtime error when nothing may (a grammar with no way on).
  Outcome<> fill(std::span<uint8_t> allowed);
  // Takes token (one fill allowed it). true: the output is complete and only
  // a stop token could follow, or token is a stop token: the sample ends.
  // Runtime error: the grammar refuses the token.
  Outcome<bool> accept(int64_t token);
  bool complete() const;  // the grammar accepts the output as it stands

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cellcache::runner
