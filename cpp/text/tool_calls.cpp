#include "tool_calls.h"

#include <charconv>
#include <exception>
#include <utility>

#include <nlohmann/json.hpp>

#include "json_nesting.h"
#include "utf8.h"

namespace cellcache::runner {

namespace {

using Json = nlohmann::ordered_json;

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// JSON text -> value; nullopt when it is not JSON or nests past kMaxJsonNesting
// (the recursive walks below stay bounded).
std::optional<Json> parse_json(std::string_view text) {
  if (json_nesting(text) > kMaxJsonNesting) return std::nullopt;
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// A finite double as Python's repr writes it: the shortest digits that read
// back the same, the closest of them (std::to_chars; nlohmann's grisu2 is
// not always the closest), fixed notation for decimal exponents -4..15
// (with ".0" when integral), else d.ddde+XX.
std::string python_float(double x) {
  char buffer[64];
  const auto written = std::to_chars(buffer, buffer + sizeof buffer, x, std::chars_format::scientific);
  const std::string s(buffer, written.ptr);
  std::string digits;
  int point = -1;  // digits before the decimal point
  int exponent = 0;
  size_t i = 0;
  const bool negative = !s.empty() && s[0] == '-';
  if (negative) ++i;
  for (; i < s.size() && s[i] != 'e' && s[i] != 'E'; ++i) {
    if (s[i] == '.') point = static_cast<int>(digits.size());
    else digits += s[i];
  }
  if (i < s.size()) exponent = std::stoi(s.substr(i + 1));
  if (point < 0) point = static_cast<int>(digits.size());
  int decpt = point + exponent;  // value = 0.DIGITS x 10^decpt
  const size_t first = digits.find_first_not_of('0');
  if (first == std::string::npos) return negative ? "-0.0" : "0.0";
  decpt -= static_cast<int>(first);
  digits = digits.substr(first, digits.find_last_not_of('0') - first + 1);
  const int n = static_cast<int>(digits.size());
  std::string out = negative ? "-" : "";
  const int exp10 = decpt - 1;
  if (exp10 >= -4 && exp10 < 16) {
    if (decpt <= 0) {
      out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(static_cast<size_t>(decpt - n), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int e = exp10 < 0 ? -exp10 : exp10;
    out += std::string("e") + (exp10 < 0 ? "-" : "+") + (e < 10 ? "0" : "") + std::to_string(e);
  }
  return out;
}

// Python's json.dumps(v, ensure_ascii=False): ", " and ": " between items,
// floats as python_float; nlohmann writes the rest as json.dumps does (the
// same escapes, lowercase \u00XX).
void python_dumps(const Json& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, value] : v.items()) {
      if (!first) out += ", ";
      first = false;
      out += dump(Json(key));
      out += ": ";
      python_dumps(value, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out += ", ";
      python_dumps(v[i], out);
    }
    out += ']';
  } else if (v.is_number_float()) {
    out += python_float(v.get<double>());
  } else {
    out += dump(v);
  }
}

// The byte length of the whitespace character (Python's str.isspace) at
// text[i], or 0.
size_t space_at(std::string_view text, size_t i) {
  const auto b = static_cast<uint8_t>(text[i]);
  if (b < 0x80) return (b >= 0x09 && b <= 0x0D) || (b >= 0x1C && b <= 0x20) ? 1 : 0;
  const Utf8Lead lead = utf8_lead(b);
  if (lead.length < 2 || i + lead.length > text.size()) return 0;
  uint32_t cp = b & (0xFF >> (lead.length + 1));
  for (int k = 1; k < lead.length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[i + k]) & 0x3F);
  const bool space = cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
                     cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
  return space ? static_cast<size_t>(lead.length) : 0;
}

size_t skip_space(std::string_view text, size_t i) {
  while (i < text.size()) {
    const size_t n = space_at(text, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}

bool only_space(std::string_view text) { return skip_space(text, 0) == text.size(); }

// A decoded call object -> ParsedCall, or nullopt when it is not one: an
// object with a string "name" and an object of arguments (under
// arguments_key, else "arguments", else "parameters"; absent = {}; JSON text
// of an object is read as that object, as some models write it).
std::optional<ParsedCall> call_of(const Json& obj, std::string_view arguments_key) {
  if (!obj.is_object() || !obj.contains("name") || !obj["name"].is_string()) return std::nullopt;
  Json args = Json::object();
  for (std::string_view key : {arguments_key, std::string_view("arguments"), std::string_view("parameters")}) {
    auto it = obj.find(std::string(key));
    if (it != obj.end()) {
      args = *it;
      break;
    }
  }
  if (args.is_string()) {
    auto decoded = parse_json(args.get<std::string>());
    if (!decoded) return std::nullopt;
    args = std::move(*decoded);
  }
  if (!args.is_object()) return std::nullopt;
  ParsedCall call{obj["name"].get<std::string>(), {}};
  python_dumps(args, call.arguments);
  return call;
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

// A JSON value's kind in a message ("a string", "a list", ...).
std::string kind_of(const Json& v) {
  if (v.is_string()) return "a string";
  if (v.is_number()) return "a number";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "a list";
  return "an object";
}

std::string shown(const Json& v) {
  if (v.is_structured()) return kind_of(v);
  std::string s = dump(v);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

constexpr const char* kSubschema[] = {"items", "additionalItems", "contains", "not", "if", "then",
                                      "else", "additionalProperties", "propertyNames",
                                      "unevaluatedProperties"};
constexpr const char* kSubschemaLists[] = {"allOf", "anyOf", "oneOf", "prefixItems"};
constexpr const char* kSubschemaMaps[] = {"properties", "patternProperties", "$defs", "definitions",
                                          "dependentSchemas"};

void close_objects(Json& schema) {
  if (!schema.is_object()) return;
  for (const char* key : kSubschema) {
    auto it = schema.find(key);
    if (it != schema.end() && it->is_object()) close_objects(*it);
  }
  for (const char* key : kSubschemaLists) {
    auto it = schema.find(key);
    if (it != schema.end() && it->is_array()) {
      for (Json& s : *it) close_objects(s);
    }
  }
  for (const char* key : kSubschemaMaps) {
    auto it = schema.find(key);
    if (it != schema.end() && it->is_object()) {
      for (auto& [name, s] : it->items()) close_objects(s);
    }
  }
  auto props = schema.find("properties");
  if (props == schema.end() || !props->is_object() || schema.contains("additionalProperties") ||
      schema.contains("unevaluatedProperties") || schema.contains("patternProperties")) {
    return;
  }
  // An object that requires a key it does not list stays open (closed, it could not be written).
  if (auto req = schema.find("required"); req != schema.end() && req->is_array()) {
    for (const Json& name : *req) {
      if (!name.is_string() || !props->contains(name.get<std::string>())) return;
    }
  }
  schema["additionalProperties"] = false;
}

Json tag(const ToolCallFormat& f, const Tool& tool) {
  const std::string head = f.at_start ? "" : std::string(f.trigger) + "\n";
  Json tag = Json::object();
  tag["type"] = "tag";
  tag["begin"] = head + "{\"name\": " + dump(Json(tool.name)) + ", " +
                 dump(Json(std::string(f.arguments_key))) + ": ";
  Json content = Json::object();
  content["type"] = "json_schema";
  content["json_schema"] = parse_json(tool.parameters_json).value_or(Json::object());
  tag["content"] = std::move(content);
  tag["end"] = f.at_start ? "}" : "}\n" + std::string(f.closer);
  return tag;
}

Json tags(const ToolCallFormat& f, const std::vector<Tool>& tools) {
  Json out = Json::array();
  for (const Tool& t : tools) out.push_back(tag(f, t));
  return out;
}

std::string structural_tag(Json format) {
  Json out = Json::object();
  out["type"] = "structural_tag";
  out["format"] = std::move(format);
  return dump(out);
}

}  // namespace

Outcome<std::string> closed_objects(std::string_view schema_json) {
  if (json_nesting(schema_json) > kMaxJsonNesting) {
    return user_error("the schema nests deeper than " + std::to_string(kMaxJsonNesting) + " levels");
  }
  auto schema = parse_json(schema_json);
  if (!schema) return user_error("the schema is not JSON (NaN and Infinity are not JSON numbers)");
  close_objects(*schema);
  return dump(*schema);
}

Outcome<std::vector<Tool>> tools_from_request(std::string_view tools_json) {
  // The parameters sit 3 levels into the list (list, entry, function).
  if (json_nesting(tools_json) > kMaxJsonNesting + 3) {
    return user_error("tools nest deeper than " + std::to_string(kMaxJsonNesting) +
                      " levels in a function's parameters");
  }
  Json raw = Json::parse(tools_json.begin(), tools_json.end(), nullptr, /*allow_exceptions=*/false);
  if (raw.is_discarded()) return user_error("tools is not JSON (NaN and Infinity are not JSON numbers)");
  if (!raw.is_array()) return user_error("tools must be a list of functions, got " + shown(raw));
  std::vector<Tool> tools;
  for (size_t i = 0; i < raw.size(); ++i) {
    const std::string where = "tools[" + std::to_string(i) + "]";
    const Json& entry = raw[i];
    if (!entry.is_object() || entry.value("type", Json()) != "function") {
      return user_error(where + " must be {\"type\": \"function\", \"function\": {...}}");
    }
    auto fn_it = entry.find("function");
    if (fn_it == entry.end() || !fn_it->is_object()) {
      return user_error(where + ".function must be an object with a name");
    }
    const Json& fn = *fn_it;
    auto name_it = fn.find("name");
    const Json name = name_it == fn.end() ? Json() : *name_it;
    bool valid_name = name.is_string() && !name.get<std::string>().empty() &&
                      name.get<std::string>().size() <= 64;
    if (valid_name) {
      for (char c : name.get<std::string>()) valid_name = valid_name && is_name_char(c);
    }
    if (!valid_name) {
      return user_error(where + ".function.name must be 1 to 64 letters, digits, '_' or '-', got " +
                        shown(name));
    }
    const std::string n = name.get<std::string>();
    for (const Tool& t : tools) {
      if (t.name == n) return user_error(where + ".function.name '" + n + "' is offered twice");
    }
    // null = absent (OpenAI's schema allows it for both).
    if (fn.contains("description") && !fn["description"].is_string() && !fn["description"].is_null()) {
      return user_error(where + ".function.description must be a string");
    }
    if (fn.contains("strict") && !fn["strict"].is_boolean() && !fn["strict"].is_null()) {
      return user_error(where + ".function.strict must be a boolean");
    }
    Json params = Json::object();
    if (auto p = fn.find("parameters"); p != fn.end()) {
      if (!p->is_object()) {
        return user_error(where + ".function.parameters must be a JSON schema object, got " +
                          kind_of(*p));
      }
      params = *p;
    } else {
      params["type"] = "object";
      params["properties"] = Json::object();
      params["additionalProperties"] = false;
    }
    close_objects(params);
    tools.push_back(Tool{n, dump(params)});
  }
  return tools;
}

const ToolCallFormat& ToolCallFormat::for_template(std::string_view source) {
  if (source.find("<tool_call>") != std::string_view::npos) return kHermes;
  if (source.find("\"parameters\"") != std::string_view::npos &&
      source.find("ipython") != std::string_view::npos) {
    return kLlama3Json;
  }
  return kHermes;
}

std::ptrdiff_t ToolCallFormat::call_start(std::string_view text) const {
  if (!at_start) {
    const size_t at = text.find(trigger);
    return at == std::string_view::npos ? -1 : static_cast<std::ptrdiff_t>(at);
  }
  std::string_view body = text.substr(skip_space(text, 0));
  if (!prefix.empty() && body.starts_with(prefix)) {
    body = body.substr(prefix.size());
    body = body.substr(skip_space(body, 0));
  }
  return body.starts_with(trigger) ? 0 : -1;
}

size_t ToolCallFormat::undecided(std::string_view text) const {
  if (at_start) {
    const std::string_view body = text.substr(skip_space(text, 0));
    const bool could = body.empty() || prefix.starts_with(body) ||
                       (!prefix.empty() && body.starts_with(prefix) &&
                        only_space(body.substr(prefix.size())));
    return could ? text.size() : 0;
  }
  for (size_t k = std::min(trigger.size() - 1, text.size()); k > 0; --k) {
    if (trigger.starts_with(text.substr(text.size() - k))) return k;
  }
  return 0;
}

ParsedReply ToolCallFormat::parse(std::string_view text) const {
  ParsedReply as_content;
  if (!text.empty()) as_content.content = std::string(text);
  const std::ptrdiff_t start = call_start(text);
  if (start < 0) return as_content;
  std::vector<ParsedCall> calls;
  const std::string_view rest = text.substr(static_cast<size_t>(start));
  try {
    if (at_start) {
      // One or more objects separated by ";", nothing else.
      std::string_view body = rest.substr(skip_space(rest, 0));
      if (!prefix.empty() && body.starts_with(prefix)) body = body.substr(prefix.size());
      size_t i = 0;
      while (true) {
        i = skip_space(body, i);
        if (i >= body.size() || body[i] != '{') return as_content;
        const size_t end = json_closing(body, i);
        if (end == std::string_view::npos) return as_content;
        auto obj = parse_json(body.substr(i, end - i));
        if (!obj) return as_content;
        auto call = call_of(*obj, arguments_key);
        if (!call) return as_content;
        calls.push_back(std::move(*call));
        i = skip_space(body, end);
        if (i == body.size()) break;
        if (body[i] != ';') return as_content;
        ++i;
      }
    } else {
      // Each call: the trigger, a JSON object (its end found by its brackets, so
      // a string holding the closer stays inside it), then the closer or the
      // end of the reply, with whitespace between.
      size_t at = rest.find(trigger);
      while (at != std::string_view::npos) {
        const size_t from = skip_space(rest, at + trigger.size());
        if (from >= rest.size() || rest[from] != '{') return as_content;
        const size_t end = json_closing(rest, from);
        if (end == std::string_view::npos) return as_content;
        auto obj = parse_json(rest.substr(from, end - from));
        if (!obj) return as_content;
        auto call = call_of(*obj, arguments_key);
        if (!call) return as_content;
        calls.push_back(std::move(*call));
        const size_t after = skip_space(rest, end);
        if (after == rest.size()) break;
        if (!rest.substr(after).starts_with(closer)) return as_content;
        at = rest.find(trigger, after + closer.size());
      }
    }
  } catch (const std::exception&) {  // allocation failure: the reply stays text
    return as_content;
  }
  if (calls.empty()) return as_content;
  ParsedReply reply;
  if (start > 0) reply.content = std::string(text.substr(0, static_cast<size_t>(start)));
  reply.calls = std::move(calls);
  return reply;
}

std::string ToolCallFormat::grammar(const std::vector<Tool>& tools, bool parallel) const {
  Json format = Json::object();
  format["type"] = "tags_with_separator";
  format["tags"] = tags(*this, tools);
  format["separator"] = "\n";
  format["at_least_one"] = true;
  format["stop_after_first"] = !parallel;
  return structural_tag(std::move(format));
}

std::string ToolCallFormat::lazy_grammar(const std::vector<Tool>& tools, bool parallel) const {
  Json format = Json::object();
  format["type"] = "triggered_tags";
  format["triggers"] = Json::array({at_start ? std::string("{\"name\": ") : std::string(trigger)});
  format["tags"] = tags(*this, tools);
  format["stop_after_first"] = !parallel;
  return structural_tag(std::move(format));
}

}  // namespace cellcache::runner
