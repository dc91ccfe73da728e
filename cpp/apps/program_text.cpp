#include "program_text.h"

namespace cellcache::runner {

ProgramText load_program_text(const ProgramInfo& info) {
  ProgramText text;
  // Grammars need only the vocabulary: also for a tokenizer the C++ library
  // cannot encode with (requests then come as token ids).
  auto compiler = GrammarCompiler::create(info.tokenizer_kind, info.tokenizer_json, info.vocab_size,
                                          info.eos_ids);
  if (compiler.ok()) {
    text.grammar_compiler = std::move(compiler.value());
  } else {
    text.grammar_unavailable = compiler.error().message;
  }
  auto tokenizer = Tokenizer::create(info.tokenizer_kind, info.tokenizer_json);
  if (!tokenizer.ok()) {
    text.text_unavailable = tokenizer.error().message;
    return text;
  }
  text.tokenizer = std::move(tokenizer.value());
  const Tokenizer& tok = *text.tokenizer;
  std::optional<std::string> bos, eos;
  if (info.bos_id) bos = tok.token_name(*info.bos_id);
  if (!info.eos_ids.empty()) eos = tok.token_name(info.eos_ids.front());
  auto chat = ChatTemplate::create(info.chat_template, bos, eos);
  if (chat.ok()) {
    text.chat_template.emplace(std::move(chat.value()));
  } else {
    text.text_unavailable = chat.error().message;
  }
  return text;
}

}  // namespace cellcache::runner
