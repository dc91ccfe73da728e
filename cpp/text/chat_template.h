// ChatTemplate: chat messages -> the prompt text, rendered from the program's
// own Jinja chat template (ProgramInfo::chat_template) the way transformers'
// apply_chat_template renders it, and the Python server's ChatTemplate
// (executorch_cellcache/serving/chat_template.py): trim_blocks and
// lstrip_blocks, loop controls, tojson keeping non-ASCII text,
// raise_exception and strftime_now; the template sees `messages` (keys whose
// value is null left out; an assistant message's tool_calls[].function.
// arguments given as JSON object text decoded to the object, as vLLM does),
// `add_generation_prompt`, `tools` (null when none), `documents` (null),
// `bos_token` / `eos_token`, and any extra variables the caller passes
// (chat_template_kwargs).
//
// The engine is llama.cpp's own Jinja implementation (common/jinja, from the
// llama-cpp-python 0.3.36 sdist: scripts/text_deps.py); it renders 380 of
// the 383 templates in llama.cpp's collection byte for byte as transformers
// does (the 3 others: a template that relies on Python's HTML escaping).
//
// A program without a template gets kPlainTemplate ("role: content" lines,
// then "assistant:"), whose text is then encoded with the tokenizer's own
// special tokens (builtin()).
//
// Errors (user errors, one line): a template that does not parse (at
// create), messages that are not a JSON list of objects, a template that
// refuses the conversation (its raise_exception message) or fails on it.
// Nothing throws; render is safe from any number of threads.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "run_status.h"

namespace cellcache::runner {

inline constexpr const char* kPlainTemplate =
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

class ChatTemplate {
 public:
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;

  // source: the template ("" = kPlainTemplate). bos_token / eos_token: their
  // text (the tokenizer's names for the program's BOS and first EOS ids),
  // nullopt = undefined in the template.
  static Outcome<ChatTemplate> create(std::string_view source, std::optional<std::string> bos_token,
                                      std::optional<std::string> eos_token);

  // messages_json: [{"role": ..., "content": ..., "tool_calls"?: [...],
  // "tool_call_id"?: ...}, ...]. tools_json: the request's tools list (OpenAI
  // form) or "" / "null" for none. extra_json: a JSON object of further
  // variables, or "".
  Outcome<std::string> render(std::string_view messages_json, std::string_view tools_json,
                              bool add_generation_prompt, std::string_view extra_json = "") const;

  // The program had no template (kPlainTemplate): encode its text with the
  // tokenizer's special tokens (Tokenizer::encode add_special_tokens).
  bool builtin() const;
  // The template's source (kPlainTemplate when the program had none): what
  // ToolCallFormat::for_template reads.
  const std::string& source() const;

 private:
  struct Impl;
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cellcache::runner
