#include "chat_template.h"

#include "json_nesting.h"

#include <exception>
#include <utility>

// llama.cpp's common/ (scripts/text_deps.py installs it as include/llama_common).
#include <llama_common/jinja/lexer.h>
#include <llama_common/jinja/parser.h>
#include <llama_common/jinja/runtime.h>
#include <llama_common/json.h>

namespace cellcache::runner {

struct ChatTemplate::Impl {
  std::string source;
  bool builtin = false;
  jinja::program program;
  std::optional<std::string> bos_token, eos_token;
};

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;

bool ChatTemplate::builtin() const { return impl_->builtin; }
const std::string& ChatTemplate::source() const { return impl_->source; }

Outcome<ChatTemplate> ChatTemplate::create(std::string_view source, std::optional<std::string> bos_token,
                                           std::optional<std::string> eos_token) {
  auto impl = std::make_unique<Impl>();
  impl->builtin = source.empty();
  impl->source = impl->builtin ? kPlainTemplate : std::string(source);
  impl->bos_token = std::move(bos_token);
  impl->eos_token = std::move(eos_token);
  try {
    jinja::lexer lexer;
    impl->program = jinja::parse_from_tokens(lexer.tokenize(impl->source));
  } catch (const std::exception& e) {
    return user_error(std::string("the program's chat template does not parse: ") + e.what());
  }
  return ChatTemplate(std::move(impl));
}

namespace {

// An assistant message's tool_calls[].function.arguments given as JSON text
// that holds an object -> the object (the templates write `arguments | tojson`).
void decode_arguments(common_json& message) {
  if (!message.contains("tool_calls") || !message["tool_calls"].is_array()) return;
  for (size_t i = 0; i < message["tool_calls"].size(); ++i) {
    common_json& call = message["tool_calls"][i];
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
    common_json& fn = call["function"];
    if (!fn.contains("arguments") || !fn["arguments"].is_string()) continue;
    if (json_nesting(fn["arguments"].get<std::string>()) > kMaxJsonNesting) continue;  // kept as text
    try {
      common_json args = common_json::parse(fn["arguments"].get<std::string>());
      if (args.is_object()) fn["arguments"] = args;
    } catch (const std::exception&) {
      // not JSON: left as the text it is
    }
  }
}

common_json without_nulls(const common_json& message) {
  common_json out = common_json::object();
  for (auto it = message.begin(); it != message.end(); ++it) {
    if (!it.value().is_null()) out[it.key()] = it.value();
  }
  return out;
}

}  // namespace

Outcome<std::string> ChatTemplate::render(std::string_view messages_json, std::string_view tools_json,
                                          bool add_generation_prompt, std::string_view extra_json) const {
  for (std::string_view part : {messages_json, tools_json, extra_json}) {
    if (json_nesting(part) > kMaxJsonNesting) {
      return user_error("the chat's JSON nests deeper than " + std::to_string(kMaxJsonNesting) +
                        " levels");
    }
  }
  common_json vars = common_json::object();
  try {
    if (!extra_json.empty()) {
      common_json extra = common_json::parse(std::string(extra_json));
      if (!extra.is_object()) return user_error("chat_template_kwargs must be a JSON object");
      for (auto it = extra.begin(); it != extra.end(); ++it) vars[it.key()] = it.value();
    }
    common_json messages = common_json::parse(std::string(messages_json));
    if (!messages.is_array()) return user_error("messages must be a JSON list of messages");
    common_json cleaned = common_json::array();
    for (size_t i = 0; i < messages.size(); ++i) {
      if (!messages[i].is_object()) {
        return user_error("messages[" + std::to_string(i) + "] must be an object with a role");
      }
      common_json m = without_nulls(messages[i]);
      decode_arguments(m);
      cleaned.push_back(m);
    }
    vars["messages"] = cleaned;
    common_json tools;  // null
    if (!tools_json.empty()) tools = common_json::parse(std::string(tools_json));
    if (tools.is_array() && tools.empty()) tools = common_json();
    vars["tools"] = tools;
    vars["documents"] = common_json();
    vars["add_generation_prompt"] = add_generation_prompt;
    if (impl_->bos_token) vars["bos_token"] = *impl_->bos_token;
    if (impl_->eos_token) vars["eos_token"] = *impl_->eos_token;
  } catch (const std::exception& e) {
    return user_error(std::string("the chat messages are not valid JSON: ") + e.what());
  }
  try {
    jinja::context ctx(impl_->source);
    jinja::global_from_json(ctx, vars, true);
    jinja::runtime runtime(ctx);
    return jinja::runtime::gather_string_parts(runtime.execute(impl_->program))->as_string().str();
  } catch (const std::exception& e) {
    // The engine's message is several lines: where (the template's line and
    // column), the source, then "Error: ...". One line: the error and where.
    std::string what = e.what(), where;
    if (size_t at = what.find(" at line "); at != std::string::npos) {
      size_t end = what.find(" in source", at);
      where = what.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1);
    }
    if (size_t error = what.rfind("Error: "); error != std::string::npos) what = what.substr(error + 7);
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    const std::string kRaised = "Jinja Exception: ";
    if (what.starts_with(kRaised)) {  // the template's raise_exception
      return user_error("the chat template refused the messages: " + what.substr(kRaised.size()));
    }
    return user_error("the chat template failed on the messages (" + what +
                      (where.empty() ? "" : ", " + where) + ")");
  }
}

}  // namespace cellcache::runner
