// Smoke test of the text-deps prefix: the tokenizer (pytorch-tokenizers' HFTokenizer, with its
// PCRE2 lookahead fallback), the grammar engine (xgrammar) and the chat-template engine
// (llama.cpp's Jinja), each used once through the installed headers and archive.
//   text_deps_smoke tokenizer.json tokenizer_config.json
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <absl/log/globals.h>
#include <dlpack/dlpack.h>
#include <llama_common/jinja/lexer.h>
#include <llama_common/jinja/parser.h>
#include <llama_common/jinja/runtime.h>
#include <llama_common/json.h>
#include <nlohmann/json.hpp>
#include <pytorch/tokenizers/hf_tokenizer.h>
#include <pytorch/tokenizers/regex.h>
#include <xgrammar/xgrammar.h>

using nlohmann::json;

static std::string slurp(const char* path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

static int fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 3) return fail("usage: text_deps_smoke tokenizer.json tokenizer_config.json");
  const std::string tokenizer_json = slurp(argv[1]);
  const json config = json::parse(slurp(argv[2]));

  // 1. Tokenizer: encode and decode a string; the PCRE2 fallback must have registered itself
  //    (a static initializer inside the archive) for a lookahead pattern to compile.
  tokenizers::HFTokenizer tok;
  if (tok.load(argv[1]) != tokenizers::Error::Ok) return fail("HFTokenizer::load");
  const std::string text = "Hello, world! Grüße 123 \xF0\x9F\x99\x82 end";
  auto ids = tok.encode(text, 0, 0);
  if (!ids.ok() || ids->empty()) return fail("HFTokenizer::encode");
  std::string back;
  uint64_t prev = tok.bos_tok();
  for (uint64_t id : *ids) {
    auto piece = tok.decode(prev, id);
    if (!piece.ok()) return fail("HFTokenizer::decode");
    back += *piece;
    prev = id;
  }
  if (back != text) return fail("decode(encode(text)) != text: '" + back + "'");
  // RE2 rejects the lookahead first and logs that through abseil; a consumer silences it so.
  // (pytorch-tokenizers' own "E tokenizers:re2_regex.cpp" line still prints: errors only.)
  absl::SetMinLogLevel(absl::LogSeverityAtLeast::kInfinity);
  if (!tokenizers::create_regex("\\s+(?!\\S)").ok())
    return fail("lookahead regex: the PCRE2 fallback is not registered");
  std::printf("tokenizer: vocab %llu, %zu ids for %zu bytes, round trip ok, lookahead regex ok\n",
              (unsigned long long)tok.vocab_size(), ids->size(), text.size());

  // 2. Grammar: a JSON schema compiled against the tokenizer's vocabulary, one bitmask filled.
  const json tj = json::parse(tokenizer_json);
  int vocab = 0;
  for (auto& [k, v] : tj["model"]["vocab"].items()) vocab = std::max(vocab, v.get<int>() + 1);
  for (auto& a : tj["added_tokens"]) vocab = std::max(vocab, a["id"].get<int>() + 1);
  std::vector<std::string> encoded(vocab);
  for (auto& [k, v] : tj["model"]["vocab"].items()) encoded[v.get<int>()] = k;
  std::vector<int32_t> stops;
  for (auto& a : tj["added_tokens"]) {
    encoded[a["id"].get<int>()] = a["content"].get<std::string>();
    if (a["content"] == config.value("eos_token", "</s>")) stops.push_back(a["id"].get<int>());
  }
  const json meta = json::parse(xgrammar::TokenizerInfo::DetectMetadataFromHF(tokenizer_json));
  xgrammar::TokenizerInfo info(encoded, static_cast<xgrammar::VocabType>(meta["vocab_type"].get<int>()),
                               vocab, stops, meta["add_prefix_space"].get<bool>());
  xgrammar::GrammarCompiler compiler(info, 1);
  const std::string schema =
      R"({"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false})";
  xgrammar::GrammarMatcher matcher(compiler.CompileJSONSchema(
      schema, /*any_whitespace=*/false, std::nullopt, std::make_pair(std::string(", "), std::string(": "))));
  std::vector<int32_t> words(xgrammar::GetBitmaskSize(vocab));
  int64_t shape[1] = {static_cast<int64_t>(words.size())};
  DLTensor t{};
  t.data = words.data();
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = xgrammar::GetBitmaskDLType();
  t.shape = shape;
  matcher.FillNextTokenBitmask(&t);
  int allowed = 0;
  for (int i = 0; i < vocab; ++i) allowed += (static_cast<uint32_t>(words[i / 32]) >> (i % 32)) & 1u;
  if (allowed <= 0 || allowed >= vocab) return fail("bitmask allows " + std::to_string(allowed) + " tokens");
  if (!matcher.AcceptString("{\"n\": 42}") || !matcher.IsCompleted()) return fail("matcher on {\"n\": 42}");
  std::printf("grammar: vocab type %d, first mask allows %d of %d tokens, {\"n\": 42} accepted\n",
              meta["vocab_type"].get<int>(), allowed, vocab);

  // 3. Chat template: the model's own, one user message.
  const std::string src = config.at("chat_template").get<std::string>();
  json vars = {{"messages", json::array({{{"role", "user"}, {"content", "Hello"}}})},
               {"add_generation_prompt", true},
               {"bos_token", config.value("bos_token", "")},
               {"eos_token", config.value("eos_token", "")}};
  jinja::lexer lexer;
  jinja::program prog = jinja::parse_from_tokens(lexer.tokenize(src));
  jinja::context ctx(src);
  jinja::global_from_json(ctx, common_json::parse(vars.dump()), true);
  jinja::runtime rt(ctx);
  const std::string rendered = rt.gather_string_parts(rt.execute(prog))->as_string().str();
  if (rendered.find("Hello") == std::string::npos) return fail("chat template rendered " + rendered);
  std::printf("chat template: %s\n", json(rendered).dump().c_str());
  std::printf("ok\n");
  return 0;
}
