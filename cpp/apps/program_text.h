// ProgramText: the text side of a program, from what the .pte carries
// (ProgramInfo::tokenizer_kind / tokenizer_json / chat_template / eos_ids):
// its tokenizer, its chat template and a grammar compiler over its
// vocabulary, for an app that takes text, chats and schemas (--stdio does).
// A program without a tokenizer (or one the C++ library cannot reproduce)
// still runs on token ids: the parts are then null and *_unavailable says
// why, for the error of a request that needs them.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "chat_template.h"
#include "grammar.h"
#include "program_info.h"
#include "tokenizer.h"

namespace cellcache::runner {

struct ProgramText {
  std::unique_ptr<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;  // the program's, or kPlainTemplate
  std::unique_ptr<GrammarCompiler> grammar_compiler;
  std::string text_unavailable;     // why tokenizer is null ("" when it is not)
  std::string grammar_unavailable;  // why grammar_compiler is null
};

// Never fails: what cannot be built is null with its reason.
ProgramText load_program_text(const ProgramInfo& info);

}  // namespace cellcache::runner
