#include "tokenizer.h"

#include "utf8.h"

#include <pthread.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <set>
#include <unordered_map>

// pytorch-tokenizers' headers bring their own nlohmann/json (the version the
// library was compiled with): this file parses tokenizer.json with that one.
#include <nlohmann/json.hpp>
#include <pytorch/tokenizers/hf_tokenizer.h>

namespace cellcache::runner {
namespace {

using nlohmann::json;

// GPT-2's byte alphabet (tokenizers' ByteLevel): printable Latin-1 bytes stand
// for themselves, the others for U+0100 + k in byte order. -> code point -> byte.
std::unordered_map<uint32_t, uint8_t> byte_level_alphabet() {
  std::unordered_map<uint32_t, uint8_t> chars;
  uint32_t extra = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    bool kept = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    chars[kept ? b : 256 + extra++] = static_cast<uint8_t>(b);
  }
  return chars;
}

// The code points of valid UTF-8 (names in tokenizer.json are).
bool code_points(std::string_view s, std::vector<uint32_t>& out) {
  out.clear();
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<uint8_t>(s[i]);
    int n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return true;
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                     : std::string("?");
}

// Why the library would encode or decode this tokenizer.json differently from
// Hugging Face `tokenizers`, or "" when it would not (tokenizer.h).
std::string unsupported_feature(const json& t) {
  const json& model = t.value("model", json());
  if (type_of(model) != "BPE") return "model type " + type_of(model) + " (only BPE)";
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    // null or "" (transformers' GGUF reader writes "") mean none
    if (model.contains(key) && !model[key].is_null() && model[key] != "") return std::string("BPE ") + key;
  }
  if (model.value("ignore_merges", false)) return "BPE ignore_merges";
  if (model.value("byte_fallback", false)) return "BPE byte_fallback";
  if (!t.value("normalizer", json()).is_null())
    return "normalizer " + type_of(t["normalizer"]);
  // Pre-tokenizers: ByteLevel (GPT-2's split), Split and Digits, in a Sequence.
  std::vector<json> todo{t.value("pre_tokenizer", json())};
  bool byte_level = false;
  while (!todo.empty()) {
    json p = todo.back();
    todo.pop_back();
    if (p.is_null()) continue;
    std::string kind = type_of(p);
    if (kind == "Sequence") {
      for (const json& q : p.value("pretokenizers", json::array())) todo.push_back(q);
    } else if (kind == "ByteLevel") {
      byte_level = true;
      if (!p.value("use_regex", true)) return "ByteLevel pre-tokenizer with use_regex false";
      if (p.value("add_prefix_space", false)) return "ByteLevel pre-tokenizer with add_prefix_space";
    } else if (kind != "Split" && kind != "Digits") {
      return "pre-tokenizer " + kind;
    }
  }
  if (!byte_level) return "no ByteLevel pre-tokenizer (only byte-level BPEs)";
  // The decoder: ByteLevel alone (decoded text = the tokens' bytes).
  std::set<std::string> decoders;
  todo = {t.value("decoder", json())};
  while (!todo.empty()) {
    json d = todo.back();
    todo.pop_back();
    if (d.is_null()) continue;
    decoders.insert(type_of(d));
    for (const json& q : d.value("decoders", json::array())) todo.push_back(q);
  }
  decoders.erase("Sequence");
  if (decoders != std::set<std::string>{"ByteLevel"}) {
    std::string names;
    for (const auto& d : decoders) names += (names.empty() ? "" : ", ") + d;
    return "decoder " + (names.empty() ? std::string("none") : names) + " (only ByteLevel)";
  }
  bool zero_is_special = false;
  for (const json& a : t.value("added_tokens", json::array())) {
    if (a.value("lstrip", false) || a.value("rstrip", false)) return "added tokens that strip spaces";
    if (a.value("single_word", false)) return "single_word added tokens";
    if (a.value("id", -1) == 0 && a.value("special", false)) zero_is_special = true;
  }
  // pytorch-tokenizers 1.0.1 drops a piece that stays several tokens when one
  // of them is id 0 (it uses 0 as "no token").
  if (!zero_is_special) return "an ordinary (not special) token at id 0";
  return "";
}

// tokenizer.json's post_processor as the ids it puts before and after the
// text (TemplateProcessing's "single"); false for a kind it cannot express.
bool post_processor_ids(const json& p, std::vector<int64_t>& before, std::vector<int64_t>& after,
                        std::string& why) {
  if (p.is_null() || type_of(p) == "ByteLevel") return true;
  if (type_of(p) == "Sequence") {
    for (const json& q : p.value("processors", json::array())) {
      if (!post_processor_ids(q, before, after, why)) return false;
    }
    return true;
  }
  if (type_of(p) != "TemplateProcessing") {
    why = "post-processor " + type_of(p);
    return false;
  }
  bool seen_text = false;
  for (const json& piece : p.value("single", json::array())) {
    if (piece.contains("Sequence")) {
      seen_text = true;
    } else if (piece.contains("SpecialToken")) {
      std::string name = piece["SpecialToken"].value("id", "");
      const json& special = p.value("special_tokens", json::object());
      if (!special.contains(name) || !special[name].contains("ids")) {
        why = "post-processor token " + name + " without ids";
        return false;
      }
      for (const json& id : special[name]["ids"]) (seen_text ? after : before).push_back(id.get<int64_t>());
    }
  }
  return true;
}

// The library's pre-tokenizer matches each piece (a run of letters, digits,
// spaces or other characters) with std::regex, which recurses per character:
// a run of ~30,000 characters overflows an 8 MiB stack. Long texts are
// encoded on a thread of their own with a stack that holds the longest run of
// the longest text taken.
constexpr size_t kMaxTextBytes = size_t{512} << 10;
// Its BPE merges a piece in time quadratic in the piece's length (100,000
// spaces in a row: 270 s on one core; tokenizers: 0.04 s), so a run of one
// kind of character (ASCII letters, digits, whitespace, other ASCII, or
// non-ASCII) is refused past this: at most a few seconds.
constexpr size_t kMaxRunBytes = size_t{16} << 10;

int char_kind(unsigned char c) {
  if (c >= 0x80) return 0;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
  if (c >= '0' && c <= '9') return 2;
  if (c == ' ' || (c >= '\t' && c <= '\r')) return 3;
  return 4;
}

// The longest run of one kind of character, in bytes.
size_t longest_run(std::string_view text) {
  size_t longest = 0, run = 0;
  int kind = -1;
  for (char c : text) {
    int k = char_kind(static_cast<unsigned char>(c));
    run = k == kind ? run + 1 : 1;
    kind = k;
    longest = std::max(longest, run);
  }
  return longest;
}
constexpr size_t kInlineTextBytes = size_t{8} << 10;
constexpr size_t kEncodeStackBytes = size_t{512} << 20;  // reserved, touched as used

class HfTokenizer final : public Tokenizer {
 public:
  Outcome<std::vector<int64_t>> encode(std::string_view text, bool add_special_tokens) const override {
    auto utf8 = check_utf8(text, "the text");
    if (!utf8.ok()) return utf8.error();
    if (text.size() > kMaxTextBytes) {
      return user_error("the text is " + std::to_string(text.size()) + " bytes; the C++ tokenizer "
                        "takes at most " + std::to_string(kMaxTextBytes) +
                        " (longer than any cache holds)");
    }
    if (size_t run = longest_run(text); run > kMaxRunBytes) {
      return user_error("the text has " + std::to_string(run) + " bytes of one kind of character "
                        "in a row (letters, digits, spaces, punctuation or non-ASCII); the C++ "
                        "tokenizer takes at most " + std::to_string(kMaxRunBytes));
    }
    if (text.size() <= kInlineTextBytes) return encode_here(text, add_special_tokens);
    struct Job {
      const HfTokenizer* self;
      std::string_view text;
      bool add_special_tokens;
      Outcome<std::vector<int64_t>> out;
    } job{this, text, add_special_tokens, std::vector<int64_t>{}};
    pthread_attr_t attr;
    pthread_t thread;
    bool started = pthread_attr_init(&attr) == 0;
    started = started && pthread_attr_setstacksize(&attr, kEncodeStackBytes) == 0 &&
              pthread_create(&thread, &attr, [](void* p) -> void* {
                auto* j = static_cast<Job*>(p);
                j->out = j->self->encode_here(j->text, j->add_special_tokens);
                return nullptr;
              }, &job) == 0;
    pthread_attr_destroy(&attr);
    if (!started) return runtime_error("cannot start the tokenizer's thread for a long text");
    pthread_join(thread, nullptr);
    return job.out;
  }

  Outcome<std::vector<int64_t>> encode_here(std::string_view text, bool add_special_tokens) const {
    auto ids = library_.encode(std::string(text), 0, 0);
    if (!ids.ok()) {
      return runtime_error("the tokenizer failed on the text (pytorch-tokenizers error " +
                           std::to_string(static_cast<int>(ids.error())) + ")");
    }
    std::vector<int64_t> out;
    out.reserve(ids.get().size() + before_.size() + after_.size());
    if (add_special_tokens) out.insert(out.end(), before_.begin(), before_.end());
    for (uint64_t id : ids.get()) out.push_back(static_cast<int64_t>(id));
    if (add_special_tokens) out.insert(out.end(), after_.begin(), after_.end());
    return out;
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(names_.size()); }
  std::string_view token_bytes(int64_t token) const override {
    return in_vocab(token) && !special_[token] ? std::string_view(bytes_[token]) : std::string_view();
  }
  bool is_special(int64_t token) const override { return in_vocab(token) && special_[token]; }
  std::optional<std::string> token_name(int64_t token) const override {
    if (!in_vocab(token) || !present_[token]) return std::nullopt;
    return names_[token];
  }

  static Outcome<std::unique_ptr<Tokenizer>> create(std::string_view text) {
    json t = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!t.is_object() || !t.contains("model") || !t["model"].is_object() ||
        !t["model"].contains("vocab") || !t["model"]["vocab"].is_object()) {
      return user_error("the program's tokenizer_json is not a Hugging Face tokenizer.json");
    }
    try {
      std::string why = unsupported_feature(t);
      auto tok = std::make_unique<HfTokenizer>();
      if (why.empty()) {  // sets why when it cannot
        post_processor_ids(t.value("post_processor", json()), tok->before_, tok->after_, why);
      }
      if (!why.empty()) {
        return user_error("the C++ tokenizer (pytorch-tokenizers 1.0.1) cannot reproduce this "
                          "tokenizer.json: " + why + "; use the Python runtime, or token ids");
      }
      Outcome<> names = tok->read_vocabulary(t);
      if (!names.ok()) return names.error();
      Outcome<> loaded = tok->load(text);
      if (!loaded.ok()) return loaded.error();
      return std::unique_ptr<Tokenizer>(std::move(tok));
    } catch (const std::exception& e) {  // a field of the wrong JSON type
      return user_error(std::string("the program's tokenizer.json is malformed: ") + e.what());
    }
  }

 private:
  bool in_vocab(int64_t token) const {
    return token >= 0 && token < static_cast<int64_t>(names_.size());
  }

  Outcome<> read_vocabulary(const json& t) {
    const json& vocab = t["model"]["vocab"];
    const json& added = t.value("added_tokens", json::array());
    int64_t n = 0;
    for (const auto& [name, id] : vocab.items()) n = std::max<int64_t>(n, id.get<int64_t>() + 1);
    for (const json& a : added) n = std::max<int64_t>(n, a.at("id").get<int64_t>() + 1);
    if (n > (int64_t{1} << 24)) return user_error("the tokenizer.json's ids exceed 2^24");
    names_.assign(n, "");
    bytes_.assign(n, "");
    special_.assign(n, false);
    present_.assign(n, false);
    static const auto alphabet = byte_level_alphabet();
    std::vector<uint32_t> cps;
    for (const auto& [name, id_json] : vocab.items()) {
      int64_t id = id_json.get<int64_t>();
      if (id < 0) return user_error("the tokenizer.json has a negative id for " + name);
      names_[id] = name;
      present_[id] = true;
      std::string bytes;
      bool mapped = code_points(name, cps);
      for (uint32_t cp : cps) {
        auto it = alphabet.find(cp);
        if (it == alphabet.end()) {
          mapped = false;
          break;
        }
        bytes.push_back(static_cast<char>(it->second));
      }
      bytes_[id] = mapped ? bytes : name;
    }
    for (const json& a : added) {
      int64_t id = a.at("id").get<int64_t>();
      if (id < 0) return user_error("the tokenizer.json has a negative added-token id");
      names_[id] = a.at("content").get<std::string>();
      bytes_[id] = names_[id];  // added tokens decode as their text
      special_[id] = a.value("special", false);
      present_[id] = true;
    }
    return {};
  }

  // The library reads a file only: a private temporary one ("x": created
  // here, never an existing file), removed after the load.
  Outcome<> load(std::string_view text) {
    std::error_code ec;
    std::filesystem::path dir = std::filesystem::temp_directory_path(ec);
    if (ec) return runtime_error("no temporary folder for the tokenizer: " + ec.message());
    std::random_device entropy;
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::string path = (dir / ("cellcache_tokenizer_" + std::to_string(entropy()) + ".json")).string();
      std::FILE* f = std::fopen(path.c_str(), "wbx");
      if (f == nullptr) continue;  // taken: another name
      bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
      written = std::fclose(f) == 0 && written;
      tokenizers::Error e = written ? library_.load(path) : tokenizers::Error::LoadFailure;
      std::remove(path.c_str());
      if (!written) return runtime_error("cannot write the tokenizer to " + path);
      if (e != tokenizers::Error::Ok) {
        return user_error("the C++ tokenizer (pytorch-tokenizers) cannot load the program's "
                          "tokenizer.json (error " + std::to_string(static_cast<int>(e)) + ")");
      }
      return {};
    }
    return runtime_error("cannot create a temporary file for the tokenizer in " + dir.string());
  }

  tokenizers::HFTokenizer library_;
  std::vector<int64_t> before_, after_;
  std::vector<std::string> names_, bytes_;
  std::vector<bool> special_, present_;
};

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int64_t kBos = 256, kEos = 257;
  Outcome<std::vector<int64_t>> encode(std::string_view text, bool add_special_tokens) const override {
    auto utf8 = check_utf8(text, "the text");
    if (!utf8.ok()) return utf8.error();
    std::vector<int64_t> out;
    if (add_special_tokens) out.push_back(kBos);
    for (char c : text) out.push_back(static_cast<uint8_t>(c));
    return out;
  }
  int64_t vocab_size() const override { return 258; }
  std::string_view token_bytes(int64_t token) const override {
    return token >= 0 && token < 256 ? std::string_view(&table()[token], 1) : std::string_view();
  }
  bool is_special(int64_t token) const override { return token == kBos || token == kEos; }
  std::optional<std::string> token_name(int64_t token) const override {
    if (token >= 0 && token < 256) return std::string(1, static_cast<char>(token));
    if (token == kBos) return "<bos>";
    if (token == kEos) return "<eos>";
    return std::nullopt;
  }

 private:
  static const char* table() {
    static const std::string bytes = [] {
      std::string s(256, '\0');
      for (int i = 0; i < 256; ++i) s[i] = static_cast<char>(i);
      return s;
    }();
    return bytes.data();
  }
};

}  // namespace

Outcome<std::unique_ptr<Tokenizer>> Tokenizer::create(std::string_view kind, std::string_view json) {
  if (kind == "hf") {
    if (json.empty()) return user_error("the program's tokenizer kind is hf but it carries no tokenizer.json");
    return HfTokenizer::create(json);
  }
  if (kind == "bytes") return std::unique_ptr<Tokenizer>(std::make_unique<ByteTokenizer>());
  if (kind.empty() || kind == "none") {
    return user_error("the program carries no tokenizer (export it from a checkpoint with a "
                      "tokenizer.json), so it takes token ids only");
  }
  return user_error("unknown tokenizer kind '" + std::string(kind) + "' (this runner knows hf, bytes)");
}

Outcome<> check_utf8(std::string_view s, std::string_view what) {
  for (size_t i = 0; i < s.size();) {
    const Utf8Lead lead = utf8_lead(static_cast<uint8_t>(s[i]));
    bool ok = lead.length > 0 && i + lead.length <= s.size();
    for (int k = 1; ok && k < lead.length; ++k) {
      auto b = static_cast<uint8_t>(s[i + k]);
      ok = k == 1 ? (b >= lead.lo && b <= lead.hi) : (b >= 0x80 && b <= 0xBF);
    }
    if (!ok) {
      return user_error(std::string(what) + " is not valid UTF-8 (at byte " + std::to_string(i) + ")");
    }
    i += lead.length;
  }
  return {};
}

}  // namespace cellcache::runner
