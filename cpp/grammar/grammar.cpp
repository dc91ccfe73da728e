#include "grammar.h"

#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <optional>
#include <unordered_set>
#include <utility>

#include <iterator>

#include <dlpack/dlpack.h>
#include <nlohmann/json.hpp>
#include <xgrammar/xgrammar.h>
#include <cellcache_xgrammar_warnings.h>

#include "json_nesting.h"
#include "utf8.h"

namespace cellcache::runner {

// ---- UTF-8 validity (RFC 3629's table), per token and DFA state ----------
namespace {

// A state: continuation bytes still due and the range of the next one. 0
// between characters; the others after a lead byte (utf8.h) or a continuation.
struct Utf8State {
  int due;
  uint8_t lo, hi;
};
constexpr Utf8State kUtf8States[] = {{0, 0x80, 0xBF}, {1, 0x80, 0xBF}, {2, 0x80, 0xBF},
                                     {3, 0x80, 0xBF}, {2, 0xA0, 0xBF}, {2, 0x80, 0x9F},
                                     {3, 0x90, 0xBF}, {3, 0x80, 0x8F}};
constexpr int kUtf8StateCount = static_cast<int>(std::size(kUtf8States));

constexpr int utf8_state(int due, uint8_t lo, uint8_t hi) {
  for (int i = 0; i < kUtf8StateCount; ++i) {
    if (kUtf8States[i].due == due && kUtf8States[i].lo == lo && kUtf8States[i].hi == hi) return i;
  }
  return -1;
}

int utf8_step(int state, uint8_t b) {  // -> next state, or -1 (invalid)
  if (state == 0) {
    const Utf8Lead lead = utf8_lead(b);
    return lead.length == 0 ? -1 : utf8_state(lead.length - 1, lead.lo, lead.hi);
  }
  const Utf8State& s = kUtf8States[state];
  if (b < s.lo || b > s.hi) return -1;
  return utf8_state(s.due - 1, 0x80, 0xBF);
}

int utf8_run(int state, std::string_view bytes) {
  for (char c : bytes) {
    state = utf8_step(state, static_cast<uint8_t>(c));
    if (state < 0) return -1;
  }
  return state;
}

using json = nlohmann::ordered_json;

}  // namespace

// The vocabulary as the matchers need it, shared by a compiler's grammars.
struct Vocabulary {
  int64_t size = 0;
  std::vector<std::string> bytes;        // [size]; "" for special and padding ids
  std::vector<int32_t> stop_ids;
  std::vector<int32_t> valid_words;      // [kUtf8StateCount x words]: tokens valid from each state
  std::vector<int32_t> stop_words;       // [words]: the stop ids
  int32_t words = 0;
};

class CompiledGrammar {
 public:
  CompiledGrammar(xgrammar::CompiledGrammar g, std::shared_ptr<const Vocabulary> v)
      : grammar(std::move(g)), vocab(std::move(v)) {}
  xgrammar::CompiledGrammar grammar;
  std::shared_ptr<const Vocabulary> vocab;
};

// ---- the schema rewrite ---------------------------------------------------
namespace {

constexpr int64_t kMaxEnumeratedNumbers = 2048;
// A schema or grammar's text: compile time grows with it (a 400 KB enum
// takes XGrammar 14 s on 2 cores).
// Schema objects in one schema: XGrammar resolves $ref chains and converts
// subschemas recursively (on the C++ stack), and compiles in time that grows
// with the schema; a schema past this is refused.
constexpr int64_t kMaxSchemaObjects = 4096;
// How deeply a regular expression's groups may nest (the pattern of a
// string, a regex grammar); XGrammar's regex parser recurses per group.
constexpr int kMaxRegexNesting = 64;

int regex_nesting(std::string_view regex) {
  int depth = 0, deepest = 0;
  bool escaped = false, in_class = false;
  for (char c : regex) {
    if (escaped) escaped = false;
    else if (c == '\\') escaped = true;
    else if (in_class) in_class = c != ']';
    else if (c == '[') in_class = true;
    else if (c == '(') deepest = std::max(deepest, ++depth);
    else if (c == ')' && depth > 0) --depth;
  }
  return deepest;
}
// A string of non-control characters (JSON escapes what it must), lo to hi
// of them: one repetition, as XGrammar compiles it. Counts stay at most 128:
// XGrammar fails on a larger count inside a JSON string (its
// "per_rule_fsm_hashes" check), and a count written in parts costs it
// seconds to minutes per string at a 49k vocabulary (measured: maxLength
// 1000 as ten parts, 13 s; one count of 128, 1 s).
constexpr int64_t kMaxStringLengthBound = 128;
constexpr const char* kStringChar = "[^\\x00-\\x1f\\ud800-\\udfff]";

std::string string_pattern(int64_t lo, std::optional<int64_t> hi) {
  return std::string("^") + kStringChar + "{" + std::to_string(lo) + "," +
         (hi ? std::to_string(*hi) : std::string()) + "}$";
}

bool has_type(const json& s, const char* type) {
  if (!s.contains("type")) return false;
  const json& t = s["type"];
  if (t.is_string()) return t.get<std::string>() == type;
  if (t.is_array()) {
    for (const json& x : t) {
      if (x.is_string() && x.get<std::string>() == type) return true;
    }
  }
  return false;
}

struct RewriteContext {
  const json& root;     // for local $refs
  int64_t objects = 0;  // subschemas seen
};

Outcome<> rewrite(json& s, const std::string& path, RewriteContext& ctx);

Outcome<> rewrite_each(json& s, const std::string& path, RewriteContext& ctx) {
  static const char* kOne[] = {"items", "additionalItems", "contains", "not", "if", "then", "else",
                               "additionalProperties", "propertyNames", "unevaluatedProperties",
                               "unevaluatedItems"};
  static const char* kLists[] = {"allOf", "anyOf", "oneOf", "prefixItems"};
  static const char* kMaps[] = {"properties", "patternProperties", "$defs", "definitions",
                                "dependentSchemas"};
  for (const char* k : kOne) {
    if (s.contains(k) && s[k].is_object()) {
      auto r = rewrite(s[k], path + "/" + k, ctx);
      if (!r.ok()) return r;
    }
    if (s.contains(k) && s[k].is_array() && std::string(k) == "items") {  // draft-4 tuple form
      for (size_t i = 0; i < s[k].size(); ++i) {
        auto r = rewrite(s[k][i], path + "/items/" + std::to_string(i), ctx);
        if (!r.ok()) return r;
      }
    }
  }
  for (const char* k : kLists) {
    if (s.contains(k) && s[k].is_array()) {
      for (size_t i = 0; i < s[k].size(); ++i) {
        auto r = rewrite(s[k][i], path + "/" + k + "/" + std::to_string(i), ctx);
        if (!r.ok()) return r;
      }
    }
  }
  for (const char* k : kMaps) {
    if (s.contains(k) && s[k].is_object()) {
      for (auto it = s[k].begin(); it != s[k].end(); ++it) {
        auto r = rewrite(it.value(), path + "/" + k + "/" + it.key(), ctx);
        if (!r.ok()) return r;
      }
    }
  }
  return {};
}

// multipleOf with both bounds -> the enum of its values.
Outcome<> enumerate_multiples(json& s, const std::string& path) {
  const json& m = s["multipleOf"];
  if (!m.is_number() || !(m.get<double>() > 0)) {
    return user_error("the schema's multipleOf at " + path + " must be a number above 0");
  }
  double step = m.get<double>();
  auto bound = [&](const char* inclusive, const char* exclusive, bool low) -> std::optional<double> {
    std::optional<double> b;
    if (s.contains(inclusive) && s[inclusive].is_number()) b = s[inclusive].get<double>();
    if (s.contains(exclusive) && s[exclusive].is_number()) {
      double x = s[exclusive].get<double>();
      double k = low ? std::floor(x / step) + 1 : std::ceil(x / step) - 1;
      double e = k * step;
      if (!b || (low ? e > *b : e < *b)) b = e;
    }
    return b;
  };
  auto lo = bound("minimum", "exclusiveMinimum", true);
  auto hi = bound("maximum", "exclusiveMaximum", false);
  if (!lo || !hi) {
    return user_error("the schema's multipleOf at " + path + " needs a minimum and a maximum "
                      "(the grammar engine enumerates its values; unbounded it is not supported)");
  }
  double k0 = std::ceil(*lo / step - 1e-9), k1 = std::floor(*hi / step + 1e-9);
  // Multiples past 2^53 are not all doubles (k + 1 == k there).
  if (!(std::fabs(k0) < 9.0e15 && std::fabs(k1) < 9.0e15)) {
    return user_error("the schema's multipleOf at " + path + " has bounds too large for its step "
                      "(more than 2^53 steps from 0)");
  }
  if (k1 - k0 + 1 > kMaxEnumeratedNumbers) {
    return user_error("the schema's multipleOf at " + path + " allows more than " +
                      std::to_string(kMaxEnumeratedNumbers) + " values; narrow its bounds");
  }
  bool integer = has_type(s, "integer") && !has_type(s, "number");
  // The step's decimals (0.25: 2): values are rounded to them, so 3 * 0.1 is
  // written 0.3, not 0.30000000000000004.
  int decimals = 0;
  while (decimals < 15 && std::fabs(step * std::pow(10.0, decimals) -
                                    std::round(step * std::pow(10.0, decimals))) > 1e-9) {
    ++decimals;
  }
  const double scale = std::pow(10.0, decimals);
  json values = json::array();
  for (int64_t i = 0; k0 + static_cast<double>(i) <= k1; ++i) {
    const double v = (k0 + static_cast<double>(i)) * step;
    if (std::fabs(v) < 9.0e15 && std::fabs(v - std::round(v)) < 1e-9 * std::max(1.0, std::fabs(v))) {
      values.push_back(static_cast<int64_t>(std::llround(v)));  // exact in an int64
    } else if (!integer) {
      values.push_back(std::fabs(v) < 9.0e15 ? std::round(v * scale) / scale : v);
    }
  }
  if (values.empty()) return user_error("the schema at " + path + " allows no number");
  json out = json::object();
  for (auto it = s.begin(); it != s.end(); ++it) {  // keep what is not about the number
    static const std::unordered_set<std::string> dropped{
        "type", "multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
    if (!dropped.count(it.key())) out[it.key()] = it.value();
  }
  out["enum"] = values;
  s = out;
  return {};
}

// A local "$ref" ("#/..."), followed a few times over; the schema itself
// otherwise (nullptr: a ref that does not resolve).
const json* resolved(const json& s, const json& root) {
  const json* at = &s;
  for (int hops = 0; hops < 8 && at->is_object() && at->contains("$ref"); ++hops) {
    const json& ref = (*at)["$ref"];
    if (!ref.is_string() || !ref.get<std::string>().starts_with("#")) return nullptr;
    try {
      at = &root.at(json::json_pointer(ref.get<std::string>().substr(1)));
    } catch (const std::exception&) {
      return nullptr;
    }
  }
  return at;
}

// Whether no value can match two of a oneOf's options, by a rule XGrammar's
// own prover misses: every option is "type": "object" and requires one same
// property (a discriminator, as pydantic writes tagged unions) held to a
// "const" or "enum", and no value is allowed by two options. Such a oneOf is
// the anyOf of its options.
bool discriminated(const json& options, const json& root) {
  if (!options.is_array() || options.size() < 2) return false;
  std::vector<const json*> branches;
  for (const json& o : options) {
    const json* b = resolved(o, root);
    // "type": "object" too: required and properties say nothing of other values.
    if (b == nullptr || !b->is_object() || b->value("type", json()) != "object" ||
        !b->contains("required") || !(*b)["required"].is_array() ||
        !b->contains("properties") || !(*b)["properties"].is_object()) {
      return false;
    }
    branches.push_back(b);
  }
  for (const json& name : (*branches[0])["required"]) {
    if (!name.is_string()) continue;
    const std::string key = name.get<std::string>();
    std::vector<json> seen;
    bool disjoint = true;
    for (const json* b : branches) {
      bool required = false;
      for (const json& r : (*b)["required"]) required = required || r == key;
      const json* p = required && (*b)["properties"].contains(key)
                          ? resolved((*b)["properties"][key], root)
                          : nullptr;
      if (p == nullptr || !p->is_object() ||
          !(p->contains("const") || (p->contains("enum") && (*p)["enum"].is_array()))) {
        disjoint = false;
        break;
      }
      const json values = p->contains("const") ? json::array({(*p)["const"]}) : (*p)["enum"];
      for (const json& v : values) {
        for (const json& w : seen) disjoint = disjoint && v != w;
      }
      if (!disjoint) break;
      for (const json& v : values) seen.push_back(v);
    }
    if (disjoint) return true;
  }
  return false;
}

// XGrammar enforces "required" only for names "properties" lists: each other
// required name is listed, held to what the schema allows other keys
// (additionalProperties / unevaluatedProperties, else any value); refused
// where nothing allows it or patternProperties would decide.
Outcome<> require_listed(json& s, const std::string& path) {
  if (!s.contains("required")) return {};
  const json& required = s["required"];
  if (!required.is_array()) return user_error("required at " + path + " must be a list of names");
  if (!has_type(s, "object") && (s.contains("type") || !s.contains("properties"))) {
    if (s.contains("type") || required.empty()) return {};  // not about objects: nothing to do
    return user_error("the schema at " + path + " has \"required\" but no \"type\": \"object\" "
                      "or \"properties\"; add one");
  }
  for (const json& name : required) {
    if (!name.is_string()) return user_error("required at " + path + " must be a list of names");
    const std::string key = name.get<std::string>();
    if (s.contains("properties") && s["properties"].is_object() && s["properties"].contains(key)) continue;
    if (s.contains("patternProperties")) {
      return user_error("the schema at " + path + " requires \"" + key + "\", which \"properties\" "
                        "does not list; with patternProperties, list it in properties");
    }
    json extra = true;
    if (s.contains("additionalProperties")) extra = s["additionalProperties"];
    else if (s.contains("unevaluatedProperties")) extra = s["unevaluatedProperties"];
    if (extra == false) {
      return user_error("the schema at " + path + " requires \"" + key + "\", which it does not "
                        "allow (it is not in \"properties\" and other keys are forbidden)");
    }
    if (!s.contains("properties") || !s["properties"].is_object()) s["properties"] = json::object();
    s["properties"][key] = extra.is_object() ? extra : json::object();
  }
  return {};
}

Outcome<> rewrite(json& s, const std::string& path, RewriteContext& ctx) {
  if (!s.is_object()) return {};
  if (++ctx.objects > kMaxSchemaObjects) {
    return user_error("the json_schema has more than " + std::to_string(kMaxSchemaObjects) +
                      " subschemas");
  }
  if (s.contains("pattern") && s["pattern"].is_string() &&
      regex_nesting(s["pattern"].get<std::string>()) > kMaxRegexNesting) {
    return user_error("the pattern at " + path + " nests groups deeper than " +
                      std::to_string(kMaxRegexNesting) + " levels");
  }
  // Keywords XGrammar reads past without a word (its other gaps it warns of: compile()).
  for (const char* k : {"not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "contains", "minContains", "maxContains", "uniqueItems"}) {
    if (s.contains(k) && !(std::string(k) == "uniqueItems" && s[k] == false)) {
      return user_error("the schema at " + path + " uses \"" + k + "\", which the grammar engine "
                        "does not enforce; rewrite the schema without it");
    }
  }
  // Values XGrammar would reject with its own internal message (no path).
  for (const char* k : {"pattern", "format"}) {
    if (s.contains(k) && !s[k].is_string()) {
      return user_error("the schema's " + std::string(k) + " at " + path + " must be a string");
    }
  }
  for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
    if (!s.contains(k)) continue;
    if (!s[k].is_number()) {
      return user_error("the schema's " + std::string(k) + " at " + path + " must be a number" +
                        (s[k].is_boolean() ? " (draft 2020-12; draft 4's boolean form is not read)" : ""));
    }
    if (has_type(s, "integer") && !has_type(s, "number") && !(std::fabs(s[k].get<double>()) < 9.2e18)) {
      return user_error("the schema's " + std::string(k) + " at " + path +
                        " is past what a 64-bit integer holds");
    }
  }
  for (const char* k : {"allOf", "anyOf", "oneOf"}) {
    if (s.contains(k) && (!s[k].is_array() || s[k].empty())) {
      return user_error("the schema's " + std::string(k) + " at " + path +
                        " must be a non-empty list of schemas");
    }
  }
  auto each = rewrite_each(s, path, ctx);
  if (!each.ok()) return each;
  if (auto required = require_listed(s, path); !required.ok()) return required;
  if (s.contains("oneOf") && !s.contains("anyOf") && discriminated(s["oneOf"], ctx.root)) {
    s["anyOf"] = std::move(s["oneOf"]);
    s.erase("oneOf");
  }
  if (s.contains("enum") || s.contains("const")) return {};
  if (s.contains("multipleOf")) {
    if (!has_type(s, "number") && !has_type(s, "integer")) {
      return user_error("the schema's multipleOf at " + path + " needs \"type\": \"number\" or \"integer\"");
    }
    return enumerate_multiples(s, path);
  }
  if (has_type(s, "string") && (s.contains("maxLength") || s.contains("minLength"))) {
    if (s.contains("pattern") || s.contains("format")) {
      return user_error("the schema at " + path + " bounds a string's length together with a "
                        "pattern or format; the grammar engine supports one of them");
    }
    if (!s["type"].is_string()) {
      return user_error("the schema at " + path + " bounds a string's length in a type list; "
                        "use anyOf");
    }
    int64_t lo = 0;
    std::optional<int64_t> hi;
    if (s.contains("minLength")) {
      if (!s["minLength"].is_number_unsigned()) return user_error("minLength at " + path + " must be a non-negative integer");
      lo = s["minLength"].get<int64_t>();
    }
    if (s.contains("maxLength")) {
      if (!s["maxLength"].is_number_unsigned()) return user_error("maxLength at " + path + " must be a non-negative integer");
      hi = s["maxLength"].get<int64_t>();
    }
    if (hi && *hi < lo) return user_error("the schema at " + path + " has maxLength below minLength");
    if (lo > kMaxStringLengthBound || (hi && *hi > kMaxStringLengthBound)) {
      return user_error("the schema at " + path + " bounds a string's length past " +
                        std::to_string(kMaxStringLengthBound) + " characters; the grammar "
                        "engine takes at most that (leave the bound out, or lower it)");
    }
    s.erase("minLength");
    s.erase("maxLength");
    s["pattern"] = string_pattern(lo, hi);
  }
  return {};
}

}  // namespace

namespace {

// A structural tag's json_schema contents as grammars of their JSON in our form
// (rewritten, compact: json.dumps's separators); XGrammar's own json_schema
// content always allows free whitespace.
Outcome<> compact_json_contents(json& node) {
  if (node.is_array()) {
    for (json& x : node) {
      auto r = compact_json_contents(x);
      if (!r.ok()) return r;
    }
    return {};
  }
  if (!node.is_object()) return {};
  if (node.value("type", "") == "json_schema" && node.contains("json_schema")) {
    auto schema = rewrite_schema(node["json_schema"].dump());
    if (!schema.ok()) return schema.error();
    std::string ebnf = xgrammar::Grammar::FromJSONSchema(
                           schema.value(), /*any_whitespace=*/false, std::nullopt,
                           std::make_pair(std::string(", "), std::string(": ")), /*strict_mode=*/false)
                           .ToString();
    node = json{{"type", "grammar"}, {"grammar", ebnf}};
    return {};
  }
  for (auto it = node.begin(); it != node.end(); ++it) {
    auto r = compact_json_contents(it.value());
    if (!r.ok()) return r;
  }
  return {};
}

}  // namespace

Outcome<std::string> rewrite_schema(std::string_view schema_json) {
  if (json_nesting(schema_json) > kMaxJsonNesting) {
    return user_error("the json_schema nests deeper than " + std::to_string(kMaxJsonNesting) +
                      " levels");
  }
  json schema = json::parse(schema_json, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return user_error("the json_schema is not JSON");
  if (!schema.is_object() && !schema.is_boolean()) {
    return user_error("the json_schema must be a JSON object (a schema)");
  }
  try {
    RewriteContext ctx{schema};
    auto r = rewrite(schema, "#", ctx);
    if (!r.ok()) return r.error();
  } catch (const std::exception& e) {
    return user_error(std::string("the json_schema is malformed: ") + e.what());
  }
  return schema.dump();
}

// ---- the compiler ---------------------------------------------------------

struct GrammarCompiler::Impl {
  std::shared_ptr<const Vocabulary> vocab;
  std::optional<xgrammar::TokenizerInfo> info;
  std::optional<xgrammar::GrammarCompiler> compiler;
};

GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarCompiler::~GrammarCompiler() = default;
int64_t GrammarCompiler::vocab_size() const { return impl_->vocab->size; }

namespace {

// The vocabulary's strings in tokenizer.json's own form ("" for special added
// tokens and missing ids) and XGrammar's metadata for it.
Outcome<std::vector<std::string>> hf_vocabulary(std::string_view tokenizer_json, int64_t vocab_size,
                                                std::string& metadata) {
  json t = json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (!t.is_object() || !t.contains("model") || !t["model"].is_object() ||
      !t["model"].contains("vocab") || !t["model"]["vocab"].is_object()) {
    return user_error("the program's tokenizer_json is not a Hugging Face tokenizer.json with a "
                      "vocabulary");
  }
  std::vector<std::string> names(vocab_size);
  auto place = [&](int64_t id, std::string name) -> Outcome<> {
    if (id < 0 || id >= vocab_size) {
      return user_error("the tokenizer.json has id " + std::to_string(id) +
                        ", outside the program's vocabulary of " + std::to_string(vocab_size));
    }
    names[id] = std::move(name);
    return {};
  };
  try {
    for (auto it = t["model"]["vocab"].begin(); it != t["model"]["vocab"].end(); ++it) {
      auto r = place(it.value().get<int64_t>(), it.key());
      if (!r.ok()) return r.error();
    }
    for (const json& a : t.value("added_tokens", json::array())) {
      auto r = place(a.at("id").get<int64_t>(),
                     a.value("special", false) ? std::string() : a.at("content").get<std::string>());
      if (!r.ok()) return r.error();
    }
    metadata = xgrammar::TokenizerInfo::DetectMetadataFromHF(std::string(tokenizer_json));
  } catch (const std::exception& e) {
    return user_error(std::string("the program's tokenizer.json is malformed: ") + e.what());
  }
  return names;
}

}  // namespace

Outcome<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(std::string_view tokenizer_kind,
                                                                  std::string_view tokenizer_json,
                                                                  int64_t vocab_size,
                                                                  std::vector<int64_t> stop_ids) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 24)) {
    return user_error("a vocabulary of " + std::to_string(vocab_size) + " tokens");
  }
  if (stop_ids.empty()) {
    return user_error("structured output needs the program's EOS ids (it has none): a grammar "
                      "cannot end");
  }
  std::vector<std::string> names;
  xgrammar::VocabType type = xgrammar::VocabType::RAW;
  bool add_prefix_space = false;
  if (tokenizer_kind == "hf" && !tokenizer_json.empty()) {
    std::string metadata;
    auto read = hf_vocabulary(tokenizer_json, vocab_size, metadata);
    if (!read.ok()) return read.error();
    names = std::move(read.value());
    json m = json::parse(metadata, nullptr, false);
    if (m.is_object()) {
      type = static_cast<xgrammar::VocabType>(m.value("vocab_type", 0));
      add_prefix_space = m.value("add_prefix_space", false);
    }
  } else if (tokenizer_kind == "bytes") {
    names.assign(vocab_size, "");
    for (int64_t b = 0; b < std::min<int64_t>(256, vocab_size); ++b) names[b] = std::string(1, static_cast<char>(b));
  } else {
    return user_error("structured output needs the program's tokenizer (its vocabulary); this "
                      "program carries none");
  }
  auto v = std::make_shared<Vocabulary>();
  v->size = vocab_size;
  v->words = static_cast<int32_t>((vocab_size + 31) / 32);
  v->stop_words.assign(v->words, 0);
  for (int64_t s : stop_ids) {
    if (s < 0 || s >= vocab_size) return user_error("EOS id " + std::to_string(s) + " is outside the vocabulary");
    v->stop_ids.push_back(static_cast<int32_t>(s));
    v->stop_words[s / 32] |= static_cast<int32_t>(1u << (s % 32));
  }
  auto impl = std::make_unique<Impl>();
  try {
    std::vector<int32_t> stops(v->stop_ids.begin(), v->stop_ids.end());
    impl->info.emplace(names, type, static_cast<int>(vocab_size), stops, add_prefix_space);
    impl->compiler.emplace(*impl->info, /*max_threads=*/2, /*cache_enabled=*/true);
  } catch (const std::exception& e) {
    return runtime_error(std::string("the grammar engine cannot take the vocabulary: ") + e.what());
  }
  // The bytes each token writes, as XGrammar decodes them ("" for special ids).
  v->bytes = impl->info->GetDecodedVocab();
  v->bytes.resize(vocab_size);
  v->valid_words.assign(static_cast<size_t>(kUtf8StateCount) * v->words, 0);
  for (int state = 0; state < kUtf8StateCount; ++state) {
    int32_t* row = v->valid_words.data() + static_cast<size_t>(state) * v->words;
    for (int64_t t = 0; t < vocab_size; ++t) {
      // Empty tokens (special, padding) move nothing: valid, XGrammar decides.
      if (utf8_run(state, v->bytes[t]) >= 0) row[t / 32] |= static_cast<int32_t>(1u << (t % 32));
    }
  }
  impl->vocab = std::move(v);
  return std::unique_ptr<GrammarCompiler>(new GrammarCompiler(std::move(impl)));
}

Outcome<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::compile(const GrammarSpec& spec) const {
  // Bounds that keep one request from stalling or crashing the server: the
  // compile's time grows with the source, and its parsers recurse.
  if (spec.source.size() > kMaxGrammarBytes) {
    return user_error("the " + spec.kind + " is " + std::to_string(spec.source.size()) +
                      " bytes; at most " + std::to_string(kMaxGrammarBytes) + " are taken");
  }
  if ((spec.kind == "structural_tag" && json_nesting(spec.source) > kMaxJsonNesting) ||
      ((spec.kind == "regex" || spec.kind == "grammar" || spec.kind == "lark") &&
       regex_nesting(spec.source) > kMaxRegexNesting)) {
    return user_error("the " + spec.kind + " nests deeper than " +
                      std::to_string(spec.kind == "structural_tag" ? kMaxJsonNesting : kMaxRegexNesting) +
                      " levels");
  }
  std::optional<xgrammar::CompiledGrammar> g;
  (void)cellcache_text_deps::take_xgrammar_warnings();  // none left from elsewhere
  try {
    if (spec.kind == "json_schema") {
      auto schema = rewrite_schema(spec.source);
      if (!schema.ok()) return schema.error();
      g = impl_->compiler->CompileJSONSchema(schema.value(), /*any_whitespace=*/false, std::nullopt,
                                             std::make_pair(std::string(", "), std::string(": ")),
                                             /*strict_mode=*/false);
    } else if (spec.kind == "grammar") {
      g = impl_->compiler->CompileGrammar(spec.source, "root");
    } else if (spec.kind == "regex") {
      g = impl_->compiler->CompileRegex(spec.source);
    } else if (spec.kind == "lark") {
      g = impl_->compiler->CompileLark(spec.source);
    } else if (spec.kind == "structural_tag") {
      json tag = json::parse(spec.source, nullptr, /*allow_exceptions=*/false);
      if (tag.is_discarded()) return user_error("the structural_tag is not JSON");
      auto compacted = compact_json_contents(tag);
      if (!compacted.ok()) return compacted.error();
      g = impl_->compiler->CompileStructuralTag(tag.dump());
    } else {
      return user_error("unknown grammar kind '" + spec.kind +
                        "' (json_schema, grammar, regex, lark, structural_tag)");
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    // XGrammar's messages start "[time] /path/to/file.cc:LINE: ": the reason follows.
    if (size_t cc = what.find(".cc:"); cc != std::string::npos) {
      if (size_t colon = what.find(": ", cc); colon != std::string::npos) what = what.substr(colon + 2);
    }
    while (!what.empty() && (what.back() == ' ' || what.back() == '\n')) what.pop_back();
    if (what.size() > 400) what = what.substr(0, 400) + "...";
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    return user_error("the " + spec.kind + " does not compile: " + what);
  }
  // What XGrammar compiled but would not enforce (its warnings) is refused, and its
  // cache forgotten (a later compile of the same source would hit it without a warning).
  if (auto warnings = cellcache_text_deps::take_xgrammar_warnings(); !warnings.empty()) {
    impl_->compiler->ClearCache();
    std::string why = warnings.front();
    for (size_t i = 1; i < warnings.size() && why.size() < 300; ++i) why += "; " + warnings[i];
    for (char& c : why) {
      if (c == '\n') c = ' ';
    }
    return user_error("the " + spec.kind + " asks for what the grammar engine would not enforce (" +
                      why + "); rewrite it without that");
  }
  auto compiled = std::make_shared<const CompiledGrammar>(std::move(*g), impl_->vocab);
  // A grammar no output can satisfy (a $ref to itself, left recursion only,
  // an empty character class) is refused here, not found out mid-request.
  GrammarMatcher probe(compiled);
  std::vector<uint8_t> row(impl_->vocab->size);
  auto first = probe.fill(row);
  if (!first.ok()) return first.error();
  if (probe.dead_end()) {
    return user_error("the " + spec.kind + " allows no output (nothing can satisfy it)");
  }
  return std::shared_ptr<const CompiledGrammar>(std::move(compiled));
}

// ---- the matcher ----------------------------------------------------------

struct GrammarMatcher::Impl {
  std::shared_ptr<const CompiledGrammar> grammar;
  xgrammar::GrammarMatcher matcher;
  std::vector<int32_t> words;
  int64_t shape[1] = {0};
  DLTensor tensor{};
  int utf8_state = 0;
  bool filled = false;  // words hold the mask for the current state
  bool dead_end = false;  // the last fill allowed nothing (so: the stop ids)

  explicit Impl(std::shared_ptr<const CompiledGrammar> g)
      : grammar(std::move(g)),
        matcher(grammar->grammar, std::vector<int>(grammar->vocab->stop_ids.begin(),
                                                   grammar->vocab->stop_ids.end())),
        words(grammar->vocab->words) {
    shape[0] = static_cast<int64_t>(words.size());
    tensor.data = words.data();
    tensor.device = DLDevice{kDLCPU, 0};
    tensor.ndim = 1;
    tensor.dtype = xgrammar::GetBitmaskDLType();
    tensor.shape = shape;
  }

  void fill_words() {
    if (filled) return;
    matcher.FillNextTokenBitmask(&tensor);
    const int32_t* valid = grammar->vocab->valid_words.data() + static_cast<size_t>(utf8_state) * words.size();
    for (size_t w = 0; w < words.size(); ++w) words[w] &= valid[w];
    filled = true;
  }
};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : impl_(std::make_unique<Impl>(std::move(grammar))) {}
GrammarMatcher::~GrammarMatcher() = default;
GrammarMatcher::GrammarMatcher(GrammarMatcher&&) noexcept = default;
GrammarMatcher& GrammarMatcher::operator=(GrammarMatcher&&) noexcept = default;

bool GrammarMatcher::complete() const { return impl_->matcher.IsCompleted(); }

Outcome<> GrammarMatcher::fill(std::span<uint8_t> allowed) {
  const int64_t vocab = impl_->grammar->vocab->size;
  if (static_cast<int64_t>(allowed.size()) != vocab) {
    return user_error("a grammar mask row of " + std::to_string(allowed.size()) +
                         " entries for a vocabulary of " + std::to_string(vocab));
  }
  try {
    impl_->fill_words();
  } catch (const std::exception& e) {
    return runtime_error(std::string("the grammar engine failed to fill a mask: ") + e.what());
  }
  // Bit t % 32 of word t / 32 (little-endian bytes: byte k holds tokens 8k..8k+7).
  static const auto spread = [] {
    std::array<uint64_t, 256> s{};
    for (int b = 0; b < 256; ++b) {
      for (int i = 0; i < 8; ++i) s[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
    }
    return s;
  }();
  const auto* bytes = reinterpret_cast<const uint8_t*>(impl_->words.data());
  int64_t full = vocab / 8;
  uint8_t any = 0;
  for (int64_t k = 0; k < full; ++k) {
    std::memcpy(allowed.data() + 8 * k, &spread[bytes[k]], 8);
    any |= bytes[k];
  }
  for (int64_t t = full * 8; t < vocab; ++t) {
    allowed[t] = (bytes[t / 8] >> (t % 8)) & 1;
    any |= allowed[t];
  }
  impl_->dead_end = !any;
  if (!any) {
    // Nowhere to go (the grammar admits no continuation of this output, e.g.
    // a lone surrogate's first byte): the stop ids only, so this sample ends
    // and no other request's step fails with it.
    const auto& v = *impl_->grammar->vocab;
    for (int32_t s : v.stop_ids) allowed[s] = 1;
  }
  return {};
}

bool GrammarMatcher::dead_end() const { return impl_->dead_end; }

Outcome<bool> GrammarMatcher::accept(int64_t token) {
  const Vocabulary& v = *impl_->grammar->vocab;
  if (token < 0 || token >= v.size) return user_error("token " + std::to_string(token) + " is outside the grammar's vocabulary");
  bool stop = (v.stop_words[token / 32] >> (token % 32)) & 1;
  if (impl_->dead_end) return stop;  // after a dead end only a stop token was allowed
  try {
    if (!impl_->matcher.AcceptToken(static_cast<int32_t>(token))) {
      return runtime_error("the grammar refused token " + std::to_string(token));
    }
    impl_->filled = false;
    if (stop) return true;
    impl_->utf8_state = utf8_run(impl_->utf8_state, v.bytes[token]);
    if (impl_->utf8_state < 0) return runtime_error("token " + std::to_string(token) + " breaks the output's UTF-8");
    if (!impl_->matcher.IsCompleted()) return false;
    // Complete: end here when nothing but a stop token may follow.
    impl_->fill_words();
    for (size_t w = 0; w < impl_->words.size(); ++w) {
      if (impl_->words[w] & ~v.stop_words[w]) return false;
    }
    return true;
  } catch (const std::exception& e) {
    return runtime_error(std::string("the grammar engine failed: ") + e.what());
  }
}

}  // namespace cellcache::runner
