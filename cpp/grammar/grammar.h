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
//    refused. A "required" name that "properties" does not list is listed
//    (held to additionalProperties), as XGrammar enforces only listed ones.
//  - What XGrammar would compile without enforcing is refused, naming it:
//    not, if/then/else, dependentRequired/dependentSchemas, contains,
//    uniqueItems, allOf of several schemas, a oneOf it cannot prove
//    disjoint, a $ref outside the schema (its warnings; XGrammar prints
//    nothing: cmake/text_deps/xgrammar_log.cc). A schema means what it says
//    or is an error.
//  - JSON is written as Python's json.dumps writes it: no free whitespace,
//    ", " and ": " separators, properties in the schema's order (the Python
//    server's form; small models pad free JSON with blank lines).
//  - Each mask is ANDed with the tokens that keep the output valid UTF-8
//    (XGrammar matches bytes and would accept overlong forms and
//    surrogates).
// Stop tokens (the program's EOS ids) are allowed once the grammar is
// complete; a matcher says when nothing but a stop token could follow, and
// the sample then ends on the token that completed it (finish "stop", no EOS
// emitted), as llguidance's matcher (the Python server's before) does.
//
// Errors: compile() gives a user error for an unknown kind, a schema that is
// not JSON, a grammar XGrammar refuses (its message), one that allows no
// output, a source over 128 KiB, JSON nested over 64 levels, regex groups
// nested over 64, a schema of over 4,096 subschemas; nothing throws.
// A GrammarCompiler is safe from any thread; a GrammarMatcher is one
// sample's and used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "run_status.h"

namespace cellcache::runner {

// The kinds a request may name, and what source holds for each:
//   "json_schema": a JSON schema (JSON text);
//   "grammar": GBNF / EBNF (llama.cpp's and XGrammar's syntax), root rule "root";
//   "regex": a regular expression the whole output must match;
//   "lark": a Lark grammar (XGrammar's subset of Lark; root rule "start");
//   "structural_tag": XGrammar's structural tag (JSON text; tool calls), whose
//       json_schema contents are held to our JSON form as a json_schema is.
inline constexpr const char* kGrammarKinds[] = {"json_schema", "grammar", "regex", "lark",
                                                "structural_tag"};

// The largest source compile() takes (its time grows with the source).
inline constexpr size_t kMaxGrammarBytes = size_t{128} << 10;

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
  // The vocabulary of a program's tokenizer (ProgramInfo::tokenizer_kind /
  // tokenizer_json): "hf" reads tokenizer.json's vocabulary and added tokens
  // (special ones never allowed but as stop ids) in the form XGrammar detects
  // (byte-level BPE, SentencePiece byte fallback, raw), which needs no
  // tokenizer library, so any tokenizer.json serves; "bytes": ids 0-255 are
  // bytes. Ids past the tokenizer's, up to vocab_size (the logits' width), are
  // never allowed. stop_ids: the tokens that end a complete output (the
  // program's EOS ids). User error: no tokenizer, a malformed tokenizer.json,
  // no stop ids, an id outside vocab_size.
  static Outcome<std::unique_ptr<GrammarCompiler>> create(std::string_view tokenizer_kind,
                                                          std::string_view tokenizer_json,
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
  // come next. When nothing may (the output so far admits no continuation,
  // which compile() rules out at the start), the stop ids are allowed
  // instead and dead_end() is true: the sample ends, no other. User error: a
  // row of another size.
  Outcome<> fill(std::span<uint8_t> allowed);
  bool dead_end() const;
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
