// cellcache_text_consumer MODEL.pte MAX_NEW_TOKENS TEXT [JSON_SCHEMA]: one
// greedy request of text through the installed engine, with the program's own
// tokenizer, optionally held to a JSON schema; prints the reply's text.
#include <cellcache/runner/engine.h>
#include <cellcache/runner/grammar_hooks.h>
#include <cellcache/runner/program.h>
#include <cellcache/runner/program_text.h>
#include <cellcache/runner/stream_decoder.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

using namespace cellcache::runner;

struct Collect : Sink {
  explicit Collect(const Tokenizer& tokenizer) : decoder(tokenizer) {}
  StreamDecoder decoder;
  std::string text;
  bool finished = false;
  void on_token(const TokenEvent& event) override { text += decoder.push(event.token); }
  void on_finish(const FinishEvent&) override {
    text += decoder.flush();
    finished = true;
  }
};

static int fail(const RunError& error) {
  std::fprintf(stderr, "error: %s\n", error.message.c_str());
  return error.kind == ErrorKind::kUser ? 2 : 1;
}

int main(int argc, char** argv) {
  if (argc < 4 || argc > 5) {
    std::fprintf(stderr, "usage: %s MODEL.pte MAX_NEW_TOKENS TEXT [JSON_SCHEMA]\n", argv[0]);
    return 2;
  }
  auto program = CellCacheProgram::load(argv[1]);
  if (!program.ok()) return fail(program.error());
  ProgramText text = load_program_text(program.value()->info());
  if (!text.tokenizer) return fail(user_error(text.text_unavailable));
  GrammarHooks hooks;  // outlives the engine
  EngineOptions options;
  options.hooks = &hooks;
  auto engine = Engine::create(*program.value(), options);
  if (!engine.ok()) return fail(engine.error());

  auto prompt = text.tokenizer->encode(argv[3], /*add_special_tokens=*/true);
  if (!prompt.ok()) return fail(prompt.error());
  SamplingParams params;  // temperature 0: greedy
  params.max_new_tokens = std::atoi(argv[2]);
  auto sink = std::make_shared<Collect>(*text.tokenizer);
  Outcome<RequestId> id = RequestId{0};
  if (argc == 5) {
    if (!text.grammar_compiler) return fail(user_error(text.grammar_unavailable));
    auto grammar = text.grammar_compiler->compile({"json_schema", argv[4]});
    if (!grammar.ok()) return fail(grammar.error());
    id = hooks.submit(*engine.value(), prompt.value(), params, sink, {}, grammar.value());
  } else {
    id = engine.value()->submit(prompt.value(), params, sink);
  }
  if (!id.ok()) return fail(id.error());
  while (!sink->finished) {
    auto stepped = engine.value()->step();
    if (!stepped.ok()) return fail(stepped.error());
  }
  std::printf("%s\n", sink->text.c_str());
  return 0;
}
