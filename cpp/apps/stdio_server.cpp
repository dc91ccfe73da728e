#include "stdio_server.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "stream_decoder.h"
#include "tool_calls.h"

namespace cellcache::runner {

namespace {

// Input lines parse into Json (objects are std::maps: a line of many fields
// costs n log n, where ordered_json's linear lookups would cost n^2); output
// lines are OutJson, which keeps fields in the order written ("id" first).
using Json = nlohmann::json;
using OutJson = nlohmann::ordered_json;

// A chat message's roles (the Python server's CHAT_ROLES).
constexpr const char* kChatRoles[] = {"system", "developer", "user", "assistant", "tool"};

constexpr const char* kRequestFields[] = {
    "id",          "prompt",      "text",        "messages",     "tools",
    "tool_choice", "parallel_tool_calls",        "chat_template_kwargs",
    "json_schema", "grammar",     "max_new_tokens",
    "n",           "temperature", "seed",        "top_k",        "top_p",
    "stop_token_ids",             "stop_on_eos", "logprobs",     "speculative"};

template <typename J>
std::string dump(const J& j) {
  // replace: a message quoting bytes that are not UTF-8 never throws.
  return j.dump(-1, ' ', false, J::error_handler_t::replace);
}

// A client's id (null, a string or an integer) as an output value.
OutJson out_id(const Json& id) {
  if (id.is_string()) return id.get<std::string>();
  if (id.is_number_unsigned()) return id.get<uint64_t>();
  if (id.is_number_integer()) return id.get<int64_t>();
  return nullptr;
}

// A value quoted in a message: its JSON text, cut short; an array or object
// by its type only (its text could be arbitrarily deep).
std::string shown(const Json& v) {
  if (v.is_structured()) return std::string("a JSON ") + v.type_name();
  std::string s = dump(v);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// A field name in a message, as JSON writes it (quoted, escaped).
std::string in_quotes(const std::string& name) { return dump(Json(name)); }

std::string request_fields_list() {
  std::string s;
  for (const char* f : kRequestFields) {
    if (!s.empty()) s += ", ";
    s += f;
  }
  return s;
}

bool is_integer(const Json& v) { return v.is_number_integer(); }  // signed or unsigned, not float

// An integer in [lo, hi], or a user error naming the field ("<name> must be
// <expected>, got <value>"; out of range: "an integer in [lo, hi]").
Outcome<int64_t> integer_in(const Json& v, const std::string& name, int64_t lo, int64_t hi,
                            const std::string& expected) {
  if (!is_integer(v)) return user_error(name + " must be " + expected + ", got " + shown(v));
  const bool in_range = v.is_number_unsigned()
                            ? v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                            : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  if (!in_range) {
    return user_error(name + " must be an integer in [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "], got " + shown(v));
  }
  return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

Outcome<std::vector<int64_t>> token_list(const Json& v, const std::string& name,
                                         bool allow_empty) {
  if (!v.is_array()) {
    return user_error(name + " must be a list of token ids, got " + shown(v));
  }
  if (v.empty() && !allow_empty) return user_error(name + " is empty");
  std::vector<int64_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const Json& t = v[i];
    if (!is_integer(t) || (t.is_number_unsigned() && t.get<uint64_t>() > static_cast<uint64_t>(kInt64Max))) {
      return user_error(name + "[" + std::to_string(i) +
                        "] must be an integer token id, got " + shown(t));
    }
    ids.push_back(t.is_number_unsigned() ? static_cast<int64_t>(t.get<uint64_t>())
                                         : t.get<int64_t>());
  }
  return ids;
}

struct ParsedRequest {
  std::vector<int64_t> prompt;
  // "text" / "messages" (+ "tools", "chat_template_kwargs") instead of "prompt":
  // encoded by the server's tokenizer; their samples' lines carry "text".
  std::optional<std::string> text;
  std::optional<std::string> messages_json, tools_json, kwargs_json;
  std::optional<GrammarSpec> grammar;  // "json_schema" or "grammar"
  std::optional<Json> tool_choice;     // as given (resolved by prepare())
  bool parallel_tool_calls = true;
  // Set by prepare() when the reply's tool calls are parsed (tools offered,
  // tool_choice not "none").
  const ToolCallFormat* tool_format = nullptr;
  SamplingParams params;
  bool speculate = true;  // "speculative": false opts out of the engine's proposals
  bool text_out() const { return text.has_value() || messages_json.has_value(); }
};

// The fields of a request line other than "id" (checked by the caller).
// Range checks beyond the types are SamplingParams::validate's and the
// engine's (engine.submit repeats them with the vocabulary and the cache).
Outcome<ParsedRequest> parse_request(const Json& j, const std::string& line) {
  // Fields whose key order matters (a schema's properties are generated in
  // their order; a chat's tools are rendered in theirs), dumped from the line
  // parsed again keeping order (Json sorts keys).
  std::optional<OutJson> ordered;
  auto in_order = [&](const char* key) {
    if (!ordered) ordered = OutJson::parse(line, nullptr, /*allow_exceptions=*/false);
    return dump((*ordered)[key]);
  };
  ParsedRequest r;
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* f : kRequestFields) known = known || key == f;
    if (!known) {
      return user_error("unknown field " + in_quotes(key) + " (a request takes " +
                        request_fields_list() + "; a cancel line only \"cancel\")");
    }
  }
  auto given = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  const int inputs = given("prompt") + given("text") + given("messages");
  if (inputs != 1) {
    return user_error(std::string(inputs == 0 ? "a request needs" : "a request takes one of") +
                      " \"prompt\" (token ids), \"text\" (a string) or \"messages\" (a chat)");
  }
  if (given("prompt")) {
    auto prompt = token_list(j["prompt"], "prompt", false);
    if (!prompt.ok()) return prompt.error();
    r.prompt = std::move(prompt.value());
  } else if (given("text")) {
    if (!j["text"].is_string()) return user_error("text must be a string, got " + shown(j["text"]));
    r.text = j["text"].get<std::string>();
    if (r.text->empty()) return user_error("text is empty");
  } else {
    const Json& m = j["messages"];
    if (!m.is_array() || m.empty()) {
      return user_error("messages must be a non-empty list of {\"role\", \"content\"} objects");
    }
    OutJson messages = OutJson::parse(in_order("messages"));
    for (size_t i = 0; i < messages.size(); ++i) {
      const std::string where = "messages[" + std::to_string(i) + "]";
      OutJson& message = messages[i];
      if (!message.is_object() || !message.contains("role") || !message["role"].is_string()) {
        return user_error(where + " must be an object with a \"role\" string");
      }
      const std::string role = message["role"].get<std::string>();
      bool known = false;
      for (const char* r : kChatRoles) known = known || role == r;
      if (!known) {
        return user_error(where + ".role must be one of system, developer, user, assistant, "
                          "tool, got " + shown(Json(role)));
      }
      // The Python server's rule (serving/completions.py): text parts joined,
      // null as "", anything else refused.
      OutJson& content = message["content"];
      if (content.is_array()) {
        std::string text;
        for (size_t k = 0; k < content.size(); ++k) {
          const OutJson& part = content[k];
          if (!part.is_object() || part.value("type", "") != "text" ||
              !part.contains("text") || !part["text"].is_string()) {
            return user_error(where + ".content[" + std::to_string(k) + "]: only text parts "
                              "({\"type\": \"text\", \"text\": ...}) are supported");
          }
          text += part["text"].get<std::string>();
        }
        content = text;
      } else if (content.is_null()) {
        content = "";
      } else if (!content.is_string()) {
        return user_error(where + ".content must be a string or a list of text parts");
      }
    }
    r.messages_json = dump(messages);
  }
  for (const char* key : {"tools", "chat_template_kwargs"}) {
    if (!given(key)) continue;
    if (!r.messages_json) return user_error(std::string(key) + " goes with \"messages\"");
    const Json& v = j[key];
    if (std::string(key) == "tools" ? !v.is_array() : !v.is_object()) {
      return user_error(std::string(key) + " must be a JSON " +
                        (std::string(key) == "tools" ? "list" : "object") + ", got " + shown(v));
    }
    (std::string(key) == "tools" ? r.tools_json : r.kwargs_json) = in_order(key);
  }
  if (given("tool_choice")) {
    if (!r.messages_json) return user_error("tool_choice goes with \"messages\" and \"tools\"");
    r.tool_choice = j["tool_choice"];
  }
  if (given("parallel_tool_calls")) {
    if (!r.messages_json) return user_error("parallel_tool_calls goes with \"messages\" and \"tools\"");
    if (!j["parallel_tool_calls"].is_boolean()) {
      return user_error("parallel_tool_calls must be true or false, got " + shown(j["parallel_tool_calls"]));
    }
    r.parallel_tool_calls = j["parallel_tool_calls"].get<bool>();
  }
  if (given("json_schema") && given("grammar")) {
    return user_error("a request takes \"json_schema\" or \"grammar\", not both");
  }
  if (given("json_schema")) {
    const Json& v = j["json_schema"];
    if (v.is_string()) {
      r.grammar = GrammarSpec{"json_schema", v.get<std::string>()};
    } else if (v.is_object() || v.is_boolean()) {
      r.grammar = GrammarSpec{"json_schema", in_order("json_schema")};
    } else {
      return user_error("json_schema must be a JSON schema (an object), got " + shown(v));
    }
  } else if (given("grammar")) {
    const Json& v = j["grammar"];
    if (!v.is_string() || v.get<std::string>().empty()) {
      return user_error("grammar must be a GBNF grammar (a string with a root rule), got " + shown(v));
    }
    r.grammar = GrammarSpec{"grammar", v.get<std::string>()};
  }

  SamplingParams& p = r.params;
  for (const auto& [key, v] : j.items()) {
    static const std::unordered_set<std::string> handled{
        "id",          "prompt",  "text",        "messages",            "tools",
        "tool_choice", "parallel_tool_calls",    "chat_template_kwargs", "json_schema",
        "grammar"};
    if (v.is_null() || handled.count(key)) continue;  // null = absent
    if (key == "max_new_tokens" || key == "n" || key == "top_k") {
      auto i = integer_in(v, key, 1, kInt32Max, "an integer >= 1");
      if (!i.ok()) return i.error();
      const auto value = static_cast<int32_t>(i.value());
      if (key == "max_new_tokens") p.max_new_tokens = value;
      if (key == "n") p.n = value;
      if (key == "top_k") p.top_k = value;
    } else if (key == "temperature" || key == "top_p") {
      if (!v.is_number()) {
        return user_error(key + " must be a number, got " + shown(v));
      }
      (key == "temperature" ? p.temperature : p.top_p.emplace()) = v.get<double>();
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) {
        return user_error("seed must be an integer >= 0, got " + shown(v));
      }
      p.seed = v.get<uint64_t>();
    } else if (key == "stop_token_ids") {
      auto ids = token_list(v, key, true);
      if (!ids.ok()) return ids.error();
      p.stop_token_ids = std::move(ids.value());
    } else if (key == "stop_on_eos") {
      if (!v.is_boolean()) {
        return user_error("stop_on_eos must be true or false, got " + shown(v));
      }
      p.stop_on_eos = v.get<bool>();
    } else if (key == "speculative") {
      if (!v.is_boolean()) {
        return user_error("speculative must be true or false, got " + shown(v));
      }
      r.speculate = v.get<bool>();
    } else if (key == "logprobs") {
      const std::string expected = "an integer in [0, " + std::to_string(kMaxTopLogprobs) +
                                   "] (how many top logprobs per token)";
      auto i = integer_in(v, key, 0, kMaxTopLogprobs, expected);
      if (!i.ok()) return i.error();
      p.logprobs = static_cast<int32_t>(i.value());
    }
  }
  if (auto valid = p.validate(); !valid.ok()) return valid.error();
  return r;
}

// nlohmann's parse_error text without its "[json.exception.parse_error.101]
// parse error at line 1, " prefix: "column 5: syntax error while ...".
std::string parse_error_text(const std::exception& e) {
  std::string s = e.what();
  if (const size_t bracket = s.find("] "); s.starts_with("[json.exception") &&
                                           bracket != std::string::npos) {
    s = s.substr(bracket + 2);
  }
  if (const size_t at = s.find("at line 1, "); at != std::string::npos) {
    s = s.substr(0, at) + s.substr(at + 11);
  }
  if (s.starts_with("parse error ")) s = s.substr(12);
  return s;
}

// What a chat's tools ask of its reply, as the Python server reads them
// (serving/completions.py): tool_choice "none" (text; the tools only reach
// the template), "auto" (the default with tools: free text, a call held to
// its tool's schema once the format's trigger appears, unless json_schema
// or grammar constrains the reply), "required" (one call of any tool, or
// several when parallel_tool_calls) or {"type": "function", "function":
// {"name": N}} (one call of N). Returns the reply's grammar compiled (a
// structural tag), or null; sets r.tool_format when calls are to be parsed.
Outcome<std::shared_ptr<const CompiledGrammar>> tool_grammar(
    ParsedRequest& r, const ChatTemplate& chat_template, const GrammarCompiler* compiler,
    const std::string& grammar_unavailable) {
  using Compiled = std::shared_ptr<const CompiledGrammar>;
  std::vector<Tool> tools;
  if (r.tools_json) {
    if (r.tools_json->size() > kMaxGrammarBytes) {  // before any parsing or compiling
      return user_error("tools take " + std::to_string(r.tools_json->size()) + " bytes; at most " +
                        std::to_string(kMaxGrammarBytes) + " are taken");
    }
    auto parsed = tools_from_request(*r.tools_json);
    if (!parsed.ok()) return parsed.error();
    tools = std::move(parsed.value());
  }
  std::string choice = tools.empty() ? "none" : "auto";
  std::string function;
  if (r.tool_choice) {
    const Json& c = *r.tool_choice;
    if (c.is_object()) {
      const auto fn = c.find("function");
      const bool shaped = c.value("type", Json()) == "function" && fn != c.end() &&
                          fn->is_object() && fn->contains("name") && (*fn)["name"].is_string();
      if (!shaped) {
        return user_error("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                          "\"function\", \"function\": {\"name\": NAME}}");
      }
      function = (*fn)["name"].get<std::string>();
      bool offered = false;
      for (const Tool& t : tools) offered = offered || t.name == function;
      if (!offered) {
        return user_error("tool_choice names the function " + shown(Json(function)) +
                          ", which tools does not offer");
      }
      choice = "function";
    } else if (c.is_string() && (c == "none" || c == "auto" || c == "required")) {
      choice = c.get<std::string>();
      if (choice != "none" && tools.empty()) {
        return user_error("tool_choice \"" + choice + "\" needs tools");
      }
    } else {
      return user_error("tool_choice must be \"none\", \"auto\", \"required\" or a function, got " +
                        shown(c));
    }
  }
  if (choice == "none") return Compiled();
  if (compiler == nullptr) {
    return user_error("tool calls need structured output, which is unavailable: " + grammar_unavailable);
  }
  const ToolCallFormat& format = ToolCallFormat::for_template(chat_template.source());
  r.tool_format = &format;
  if (choice == "auto" && r.grammar) return Compiled();  // calls are only parsed
  if (choice != "auto" && r.grammar) {
    return user_error(r.grammar->kind + " cannot be combined with tool_choice " +
                      shown(Json(choice == "function" ? function : choice)) +
                      ": the reply must be a tool call");
  }
  std::string tag;
  if (choice == "auto") {
    tag = format.lazy_grammar(tools, r.parallel_tool_calls);
  } else {
    std::vector<Tool> forced;
    for (const Tool& t : tools) {
      if (choice == "required" || t.name == function) forced.push_back(t);
    }
    tag = format.grammar(forced, r.parallel_tool_calls && choice == "required");
  }
  if (tag.size() > kMaxGrammarBytes) {
    return user_error("tools take " + std::to_string(tag.size()) + " bytes as a grammar; at most " +
                      std::to_string(kMaxGrammarBytes) + " are taken");
  }
  // One compile; only when it fails is each tool's schema compiled, to name the one at fault.
  auto compiled = compiler->compile({"structural_tag", tag});
  if (compiled.ok()) return std::move(compiled.value());
  for (size_t i = 0; i < tools.size(); ++i) {
    if (auto alone = compiler->compile({"json_schema", tools[i].parameters_json}); !alone.ok()) {
      return user_error("tools[" + std::to_string(i) + "].function.parameters: " + alone.error().message);
    }
  }
  return user_error("the tools cannot be used: " + compiled.error().message);
}

// A reply's calls in OpenAI's form ({"id", "type", "function": {"name",
// "arguments"}}): what an app appends to its messages as the assistant's.
OutJson tool_calls_json(const std::vector<ParsedCall>& calls, std::mt19937_64& ids) {
  OutJson out = OutJson::array();
  for (const ParsedCall& c : calls) {
    char id[32];
    std::snprintf(id, sizeof id, "call_%016llx%08x", static_cast<unsigned long long>(ids()),
                  static_cast<unsigned>(ids() & 0xFFFFFFFFu));
    OutJson call;
    call["id"] = id;
    call["type"] = "function";
    call["function"] = {{"name", c.name}, {"arguments", c.arguments}};
    out.push_back(std::move(call));
  }
  return out;
}

class Server;

// One accepted request's lines; callbacks run on the stepping thread.
class RequestSink final : public Sink {
 public:
  // tokenizer: set when the samples' lines carry their text.
  // tool_format: set when the reply's tool calls are parsed (needs tokenizer).
  RequestSink(Server& server, const Json& id, std::string key, int32_t n,
              const Tokenizer* tokenizer, const ToolCallFormat* tool_format)
      : server_(server), id_(out_id(id)), key_(std::move(key)), unfinished_(n),
        tool_format_(tool_format) {
    if (tokenizer != nullptr) decoders_.assign(n, StreamDecoder(*tokenizer));
    if (tool_format_ != nullptr) replies_.assign(n, std::string());
  }
  void on_token(const TokenEvent& e) override;
  void on_finish(const FinishEvent& e) override;
  // Set before the server cancels it for a failure of its own: its
  // "cancelled" finishes read "error".
  std::atomic<bool> failed{false};

 private:
  Server& server_;
  const OutJson id_;
  const std::string key_;
  int32_t unfinished_;
  bool usage_counted_ = false;
  std::vector<StreamDecoder> decoders_;  // per sample; empty = ids only
  const ToolCallFormat* tool_format_;
  std::vector<std::string> replies_;     // per sample's text, when calls are parsed
};

class Server {
 public:
  Server(Engine& engine, const StdioOutput& out, const StdioOptions& options)
      : engine_(engine), out_(out), options_(options) {}

  Outcome<StdioSummary> run(std::istream& in);

  // Stepping thread (sink callbacks).
  void append(const OutJson& line) {
    pending_ += dump(line);
    pending_ += '\n';
  }
  void count_finish(const FinishEvent& e, bool first_of_request) {
    ++finishes_;
    if (first_of_request) {
      summary_.prompt_tokens += e.usage.prompt_tokens;
      summary_.cached_tokens += e.usage.cached_tokens;
    }
    summary_.completion_tokens += e.usage.completion_tokens;
  }
  bool speculative() const { return engine_.speculative(); }
  OutJson tool_calls(const std::vector<ParsedCall>& calls) { return tool_calls_json(calls, call_ids_); }
  // The request's last finish is out: its id is free again.
  void forget(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(key);
  }

 private:
  struct Live {
    RequestId id;
    std::shared_ptr<RequestSink> sink;
  };

  void read_input(std::istream& in);
  void handle_line(const std::string& line, int64_t number);
  void handle_request(Json& j, const std::string& line, int64_t number);
  // The request's prompt from its text or messages, and its grammar compiled
  // (into compiled_); a user error naming what is missing or wrong.
  Outcome<> prepare(ParsedRequest& r);
  void handle_cancel(const Json& j, int64_t number);
  void refuse(const Json& id, int64_t number, const std::string& message);
  bool write(std::string_view lines);
  // Ends every live request (their finishes read "error" when `failed`).
  void cancel_all(bool failed);
  void log(const std::string& message) const {
    if (options_.log) options_.log(message);
  }

  Engine& engine_;
  const StdioOutput& out_;
  const StdioOptions& options_;

  std::mutex mutex_;  // guards the members below it
  std::condition_variable wake_;
  std::unordered_map<std::string, Live> live_;  // key: the client's id as JSON text
  bool work_ = false;        // something was queued since the stepper last looked
  bool input_done_ = false;
  int64_t lines_ = 0;
  int64_t refused_ = 0;
  int64_t accepted_ = 0;
  // Reader thread only: the grammar prepare() compiled for the request at hand.
  std::shared_ptr<const CompiledGrammar> compiled_;

  std::mutex out_mutex_;  // one writer at a time
  std::atomic<bool> output_failed_{false};

  // Stepping thread only.
  std::string pending_;
  StdioSummary summary_;
  int64_t finishes_ = 0;
  std::mt19937_64 call_ids_{std::random_device{}()};
};

void RequestSink::on_token(const TokenEvent& e) {
  OutJson line;
  line["id"] = id_;
  line["sample"] = e.sample;
  line["token"] = e.token;
  if (!decoders_.empty()) {
    std::string text = decoders_[e.sample].push(e.token);
    if (!replies_.empty()) replies_[e.sample] += text;
    line["text"] = std::move(text);
  }
  if (e.logprobs != nullptr) {
    line["logprob"] = e.logprobs->logprob;
    OutJson top = OutJson::array();
    for (const auto& [token, lp] : e.logprobs->top) top.push_back(OutJson::array({token, lp}));
    line["top_logprobs"] = std::move(top);
  }
  server_.append(line);
}

void RequestSink::on_finish(const FinishEvent& e) {
  // A request the engine could not start after accepting it (never expected:
  // submit checks what the scheduler checks) gets one error finish for sample
  // 0 and no usage; finish its other samples here so each gets its line.
  const bool never_started = e.reason == FinishReason::kError && e.usage.prompt_tokens == 0;
  const int32_t last = never_started ? unfinished_ : 1;
  for (int32_t k = 0; k < last && unfinished_ > 0; ++k) {
    FinishReason reason = e.reason;
    if (reason == FinishReason::kCancelled && failed.load()) reason = FinishReason::kError;
    OutJson line;
    line["id"] = id_;
    line["sample"] = never_started ? k : e.sample;
    line["finish"] = finish_reason_name(reason);
    const int32_t sample = never_started ? k : e.sample;
    if (!decoders_.empty()) {
      // Bytes still held (an unfinished character): their U+FFFD, as Python's flush.
      if (std::string rest = decoders_[sample].flush(); !rest.empty()) {
        if (!replies_.empty()) replies_[sample] += rest;
        line["text"] = rest;
      }
    }
    if (!replies_.empty() && (reason == FinishReason::kStop || reason == FinishReason::kLength)) {
      ParsedReply reply = tool_format_->parse(replies_[sample]);
      if (!reply.calls.empty()) {
        line["finish"] = "tool_calls";
        line["content"] = reply.content ? OutJson(*reply.content) : OutJson(nullptr);
        line["tool_calls"] = server_.tool_calls(reply.calls);
      }
    }
    line["usage"] = {{"prompt_tokens", e.usage.prompt_tokens},
                     {"cached_tokens", e.usage.cached_tokens},
                     {"completion_tokens", e.usage.completion_tokens}};
    if (server_.speculative()) {
      line["usage"]["proposed_tokens"] = e.usage.proposed_tokens;
      line["usage"]["accepted_tokens"] = e.usage.accepted_tokens;
    }
    server_.append(line);
    server_.count_finish(e, !usage_counted_);
    usage_counted_ = true;
    --unfinished_;
  }
  if (unfinished_ == 0) server_.forget(key_);
}

bool Server::write(std::string_view lines) {
  if (lines.empty()) return true;
  if (output_failed_.load()) return false;
  bool ok = false;
  {
    std::lock_guard<std::mutex> lock(out_mutex_);
    ok = out_(lines);
  }
  if (!ok && !output_failed_.exchange(true)) {
    log("the output closed; cancelling every request and reading the input to its end");
    cancel_all(false);
  }
  return ok;
}

void Server::cancel_all(bool failed) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [key, live] : live_) {
    if (failed) live.sink->failed.store(true);
    (void)engine_.cancel(live.id);  // an error: it finished meanwhile
  }
  work_ = true;
  wake_.notify_one();
}

void Server::refuse(const Json& id, int64_t number, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++refused_;
  }
  OutJson line;
  line["id"] = out_id(id);
  line["error"] = "line " + std::to_string(number) + ": " + message;
  write(dump(line) + "\n");
}

void Server::handle_line(const std::string& line, int64_t number) {
  // Duplicate top-level fields would silently keep the last value: refuse them.
  // Values nested deeper than any field needs are dropped while parsing (never
  // built), and the line refused.
  std::string duplicate;
  bool too_deep = false;
  std::unordered_set<std::string> keys;
  const Json::parser_callback_t check_keys = [&](int depth, Json::parse_event_t event,
                                                 Json& parsed) {
    if (depth > kMaxStdioDepth) {
      too_deep = true;
      return false;
    }
    if (depth == 1 && event == Json::parse_event_t::key && parsed.is_string()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  Json j;
  try {
    j = Json::parse(line, check_keys);
  } catch (const Json::exception& e) {  // parse_error, out_of_range (a number like 1e400)
    refuse(nullptr, number, "not valid JSON: " + parse_error_text(e));
    return;
  }
  if (!j.is_object()) {
    refuse(nullptr, number,
           std::string("expected a JSON object (a request or a cancel), got ") + j.type_name());
    return;
  }
  Json id = nullptr;
  if (const auto it = j.find("id"); it != j.end() && (it->is_string() || is_integer(*it))) id = *it;
  if (const auto it = j.find("cancel"); it != j.end() && (it->is_string() || is_integer(*it))) {
    id = *it;
  }
  if (too_deep) {
    refuse(id, number, "a value is nested deeper than " + std::to_string(kMaxStdioDepth) +
                           " levels; no field takes that");
    return;
  }
  if (!duplicate.empty()) {
    refuse(id, number, "field " + in_quotes(duplicate) + " appears more than once");
    return;
  }
  if (j.contains("cancel")) {
    handle_cancel(j, number);
    return;
  }
  handle_request(j, line, number);
}

void Server::handle_cancel(const Json& j, int64_t number) {
  const Json& target = j["cancel"];
  const bool readable = target.is_string() || is_integer(target);
  const Json id = readable ? target : Json(nullptr);
  if (!readable) {
    refuse(nullptr, number,
           "\"cancel\" must be the id of a request (a string or an integer), got " +
               shown(target));
    return;
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "cancel") {
      refuse(id, number, "unknown field " + in_quotes(key) + " in a cancel line (it takes only "
                         "\"cancel\": the id of the request to end)");
      return;
    }
  }
  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(dump(target));
    if (it == live_.end()) {
      refusal = "cannot cancel " + shown(target) +
                ": no request with this id is waiting or running (unknown, or already finished)";
    } else if (auto cancelled = engine_.cancel(it->second.id); !cancelled.ok()) {
      refusal = "cannot cancel " + shown(target) + ": " + cancelled.error().message;
    } else {
      work_ = true;
      wake_.notify_one();
      return;
    }
  }
  refuse(id, number, refusal);
}

Outcome<> Server::prepare(ParsedRequest& r) {
  compiled_.reset();
  if (r.text_out() || r.grammar) {
    if (options_.tokenizer == nullptr) {
      return user_error((r.grammar ? std::string("structured output") : std::string("text input")) +
                        " needs the program's tokenizer: " + options_.text_unavailable);
    }
  }
  if (r.text) {
    auto ids = options_.tokenizer->encode(*r.text, /*add_special_tokens=*/true);
    if (!ids.ok()) return ids.error();
    r.prompt = std::move(ids.value());
  } else if (r.messages_json) {
    if (options_.chat_template == nullptr) {
      return user_error("messages need a chat template: " + options_.text_unavailable);
    }
    auto text = options_.chat_template->render(*r.messages_json, r.tools_json.value_or(""),
                                               /*add_generation_prompt=*/true,
                                               r.kwargs_json.value_or(""));
    if (!text.ok()) return text.error();
    auto ids = options_.tokenizer->encode(text.value(), options_.chat_template->builtin());
    if (!ids.ok()) return ids.error();
    r.prompt = std::move(ids.value());
  }
  if (r.text_out() && r.prompt.empty()) return user_error("the text encodes to no tokens");
  if (r.messages_json && (r.tools_json || r.tool_choice)) {
    auto tools = tool_grammar(r, *options_.chat_template,
                              options_.grammar_hooks ? options_.grammar_compiler : nullptr,
                              options_.grammar_unavailable);
    if (!tools.ok()) return tools.error();
    compiled_ = std::move(tools.value());
  }
  if (r.grammar) {
    if (options_.grammar_compiler == nullptr || options_.grammar_hooks == nullptr) {
      return user_error("structured output is unavailable: " + options_.grammar_unavailable);
    }
    auto compiled = options_.grammar_compiler->compile(*r.grammar);
    if (!compiled.ok()) return compiled.error();
    compiled_ = std::move(compiled.value());
  }
  return {};
}

void Server::handle_request(Json& j, const std::string& line, int64_t number) {
  const auto it = j.find("id");
  if (it == j.end() || it->is_null()) {
    refuse(nullptr, number, "a request needs an \"id\" (a string or an integer) to tag its "
                            "output lines");
    return;
  }
  if (!it->is_string() && !is_integer(*it)) {
    refuse(nullptr, number, "\"id\" must be a string or an integer, got " + shown(*it));
    return;
  }
  const Json id = *it;
  auto parsed = parse_request(j, line);
  if (!parsed.ok()) {
    refuse(id, number, parsed.error().message);
    return;
  }
  if (auto prepared = prepare(parsed.value()); !prepared.ok()) {
    refuse(id, number, prepared.error().message);
    return;
  }
  if (output_failed_.load()) return;  // nobody reads the answer
  const std::string key = dump(id);
  const int32_t n = parsed->params.n;
  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (live_.count(key) != 0) {
      refusal = "id " + shown(id) + " belongs to a request that is still running; use another";
    } else if (live_.size() >= options_.max_live_requests) {
      refusal = "too many requests in flight (" + std::to_string(live_.size()) +
                " waiting or running, the limit of --stdio); send more as some finish";
    } else {
      auto sink = std::make_shared<RequestSink>(
          *this, id, key, n, parsed->text_out() ? options_.tokenizer : nullptr,
          parsed->tool_format);
      SubmitOptions submit_options{.label = "request " + shown(id), .speculate = parsed->speculate};
      auto submitted =
          compiled_ ? options_.grammar_hooks->submit(engine_, std::move(parsed->prompt),
                                                    std::move(parsed->params), sink,
                                                    std::move(submit_options), std::move(compiled_))
                    : engine_.submit(std::move(parsed->prompt), std::move(parsed->params), sink,
                                     std::move(submit_options));
      if (submitted.ok()) {
        live_.emplace(key, Live{submitted.value(), std::move(sink)});
        ++accepted_;
        work_ = true;
        wake_.notify_one();
        return;
      }
      refusal = submitted.error().message;
    }
  }
  refuse(id, number, refusal);
}

// Reads one line into `line` (without its '\n'), keeping at most `cap` bytes
// and dropping the rest. false: the input ended before any byte.
bool read_line(std::streambuf& in, std::string& line, size_t cap, bool& too_long, bool& ended) {
  using Traits = std::streambuf::traits_type;
  line.clear();
  too_long = false;
  ended = false;
  bool any = false;
  while (true) {
    const auto c = in.sbumpc();
    if (Traits::eq_int_type(c, Traits::eof())) {
      ended = true;
      break;
    }
    any = true;
    if (c == '\n') break;
    if (line.size() < cap) {
      line.push_back(Traits::to_char_type(c));
    } else {
      too_long = true;
    }
  }
  return any;
}

bool blank(const std::string& line) {
  return line.find_first_not_of(" \t\r") == std::string::npos;
}

void Server::read_input(std::istream& in) {
  std::streambuf* buf = in.rdbuf();  // not `in`: its tie (cout) would be flushed from here
  std::string line;
  int64_t number = 0;
  try {
    bool too_long = false;
    bool ended = buf == nullptr;
    while (!ended && read_line(*buf, line, options_.max_line_bytes, too_long, ended)) {
      ++number;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        lines_ = number;
      }
      if (output_failed_.load()) continue;  // drain: nobody reads the answers
      if (too_long) {
        refuse(nullptr, number, "longer than the limit of " +
                                    std::to_string(options_.max_line_bytes) +
                                    " bytes; skipped");
        continue;
      }
      if (blank(line)) continue;
      try {
        handle_line(line, number);
      } catch (const std::exception& e) {  // std::bad_alloc: refuse this line alone
        refuse(nullptr, number, std::string("internal error: ") + e.what());
      }
    }
  } catch (const std::exception& e) {
    log(std::string("reading the input failed: ") + e.what() + "; finishing what runs");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  input_done_ = true;
  wake_.notify_one();
}

Outcome<StdioSummary> Server::run(std::istream& in) {
  std::thread reader([this, &in] { read_input(in); });
  while (true) {
    try {
      const int64_t finishes_before = finishes_;
      auto stepped = engine_.step();
      std::string lines;
      lines.swap(pending_);
      write(lines);
      if (!stepped.ok()) {
        ++summary_.failed_steps;
        if (finishes_ > finishes_before) {
          log("a step failed (" + stepped.error().message +
              "); its requests finished with \"error\", serving on");
        } else {
          // Nothing was ended: end everything, or the same failure comes back.
          log("a step failed (" + stepped.error().message +
              "); ending every request with \"error\", serving on");
          cancel_all(true);
        }
        continue;
      }
      if (stepped.value()) continue;
      std::unique_lock<std::mutex> lock(mutex_);
      if (!work_ && input_done_) break;
      wake_.wait(lock, [this] { return work_ || input_done_; });
      work_ = false;
    } catch (const std::exception& e) {  // std::bad_alloc
      log(std::string("internal error: ") + e.what() + "; ending every request");
      pending_.clear();
      cancel_all(true);
    }
  }
  reader.join();
  summary_.lines = lines_;
  summary_.requests = accepted_;
  summary_.refused = refused_;
  if (output_failed_.load()) {
    return runtime_error("the output closed before every answer was written");
  }
  return summary_;
}

}  // namespace

Outcome<StdioSummary> serve_stdio(Engine& engine, std::istream& in, const StdioOutput& out,
                                  const StdioOptions& options) {
  try {
    Server server(engine, out, options);
    return server.run(in);
  } catch (const std::exception& e) {
    return runtime_error(std::string("the stdio server failed: ") + e.what());
  }
}

}  // namespace cellcache::runner
