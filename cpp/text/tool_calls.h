// Tool calls (OpenAI's "tools"): how a model writes a call, the structural
// tag that forces one or holds a lazily triggered one to its tool's schema
// (compiled by grammar.h), and the parser that turns a reply into calls.
// The one implementation: cellcache_runner --stdio uses it, and so does the
// Python server (executorch_cellcache/serving/tool_calls.py binds it).
//
// A format is chosen from the program's chat template source
// (ToolCallFormat::for_template):
//  - hermes: each call is `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`,
//    calls separated by "\n" (Hermes 2 Pro, Qwen 2.5 / 3: their templates
//    mention <tool_call>); text before the first call is the reply's content.
//  - llama3_json: the whole reply is `{"name": N, "parameters": {...}}`,
//    optionally after <|python_tag|>, several separated by ";" as vLLM's
//    llama3_json parser reads them (Llama 3.1-3.3: their templates mention
//    "parameters" and the ipython role); a reply that does not start with
//    "{" is content.
//  - any other template: hermes.
//
// Parsing never fails: a reply whose call text does not parse (broken JSON,
// no name, arguments that are not an object, JSON nested past
// kMaxJsonNesting) is content, whole. A call's arguments come back as JSON
// text written as Python's json.dumps(ensure_ascii=False) writes it (", ",
// ": ", keys in the reply's order, a repeated key's last value), so both
// runtimes give the same text; numbers as nlohmann reads them (integers past
// 64 bits become doubles).
//
// Forcing (grammar(), tool_choice "required" or a named function): a
// structural tag for the whole reply, each call `{"name": N, "arguments":
// <the tool's parameters>}` ("parameters" for llama3_json), nothing before
// or after. tool_choice "auto" (lazy_grammar()): free text until the
// format's trigger, then the call is held to its tool's schema, as
// llama.cpp's lazy grammars do.
//
// Offsets and lengths are in bytes of UTF-8 text. Nothing throws.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "run_status.h"

namespace cellcache::runner {

// One function a request offers: its name (OpenAI's rule: 1-64 of
// [A-Za-z0-9_-]) and its parameters' JSON schema as its calls are held to it
// (closed_objects of the request's; {"type": "object", "properties": {},
// "additionalProperties": false} when the request gave none).
struct Tool {
  std::string name;
  std::string parameters_json;
};

// OpenAI's tools list (JSON text: [{"type": "function", "function": {"name",
// "description"?, "parameters"?, "strict"?}}, ...], distinct names) ->
// Tools. User error naming the entry at fault ("tools[1].function.name
// ..."). The schemas are not compiled here.
Outcome<std::vector<Tool>> tools_from_request(std::string_view tools_json);

// `schema_json` with "additionalProperties": false on every object schema
// that lists "properties" and says nothing of other keys (no
// additionalProperties, unevaluatedProperties or patternProperties), at any
// depth. A small model held to a schema that lets an object carry any other
// key runs on inventing keys; llama.cpp's json-schema-to-grammar and
// XGrammar's strict mode read a schema the same way. User error: not JSON.
Outcome<std::string> closed_objects(std::string_view schema_json);

struct ParsedCall {
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ParsedReply {
  std::optional<std::string> content;  // text before the first call; nullopt: none
  std::vector<ParsedCall> calls;
};

struct ToolCallFormat {
  std::string_view name;           // "hermes" / "llama3_json"
  std::string_view trigger;        // what a call starts with
  std::string_view closer;         // what a call ends with ("" for llama3_json)
  bool at_start;                   // a call counts only at the reply's start
  std::string_view arguments_key;  // "arguments" / "parameters"
  std::string_view prefix;         // text allowed before an at-start call

  // The format a chat template's model writes calls in ("" = none: hermes).
  static const ToolCallFormat& for_template(std::string_view template_source);

  // Where the first call (with its prefix) starts in `text`, or -1. For an
  // at-start format: 0 when the reply, without leading whitespace and the
  // prefix, begins with the trigger.
  std::ptrdiff_t call_start(std::string_view text) const;
  // How many bytes at the end of `text` (which holds no call start) could
  // still begin one: a stream holds them back.
  size_t undecided(std::string_view text) const;
  // A whole reply -> content and calls; no calls (all content) when the
  // reply has none or any call text does not parse.
  ParsedReply parse(std::string_view text) const;

  // Structural tags (JSON text; GrammarSpec kind "structural_tag"). grammar:
  // the whole reply is a call of one of `tools` (one, or several separated
  // by "\n" when `parallel`; llama3_json replies hold one). lazy_grammar:
  // free text until the trigger (hermes: "<tool_call>" anywhere; llama3_json:
  // '{"name": ' at any point, its <|python_tag|> prefix not allowed), then a
  // call as grammar() holds it, then the end of text (or, when `parallel`,
  // free text and more calls). `tools` must not be empty.
  std::string grammar(const std::vector<Tool>& tools, bool parallel) const;
  std::string lazy_grammar(const std::vector<Tool>& tools, bool parallel) const;
};

inline constexpr ToolCallFormat kHermes{"hermes", "<tool_call>", "</tool_call>", false,
                                        "arguments", ""};
inline constexpr ToolCallFormat kLlama3Json{"llama3_json", "{", "", true, "parameters",
                                            "<|python_tag|>"};

}  // namespace cellcache::runner
