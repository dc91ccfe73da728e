// cellcache_runner: generation from a cell-cache .pte, without Python.
//
//   cellcache_runner --model M.pte --prompts FILE [--n N] [--max-new-tokens K]
//                    [--temperature T] [--seed S] [--no-stop-on-eos]
//                    [--no-prefix-cache | --prefix-cache-cells C] [--threads T] [--verbose]
//   cellcache_runner --model M.pte --stdio [--no-prefix-cache | --prefix-cache-cells C]
//                    [--threads T]
//   cellcache_runner --model M.pte --print-info
// Batch and --stdio also take [--speculative lookup|draft [--draft-model D.pte]
// [--draft-max K|auto] [--lookup-min-ngram M] [--lookup-max-ngram M]].
//
// Batch mode: FILE holds one prompt per line as whitespace-separated token ids
// (prompts_file.h). stdout: one line per sample, "prompt_index sample_index:
// ids...", sorted by prompt then sample. stderr: a summary line (prefill/decode
// tokens/s, peak cells).
// --stdio: JSON lines on stdin and stdout (stdio_server.h) until stdin ends.
// --print-info: the program's metadata as one JSON object (program_info.h).
// Exit status: 0 done, 2 user error (one "error:" line on stderr), 1 runtime
// failure (batch: a forward failed; --stdio: stdout closed early).
#include <charconv>
#include <csignal>
#include <cstdio>
#include <exception>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "batch_runner.h"
#include "et_log.h"
#include "kernel_threads.h"
#include "pool_executor.h"
#include "program.h"
#include "program_text.h"
#include "prompts_file.h"
#include "stdio_server.h"
#include "stream_decoder.h"

namespace {

using cellcache::runner::ErrorKind;
using cellcache::runner::Outcome;
using cellcache::runner::RunError;
using cellcache::runner::user_error;

constexpr const char* kUsage =
    "usage: cellcache_runner --model M.pte --prompts FILE [--n N] [--max-new-tokens K]\n"
    "                        [--temperature T] [--seed S] [--no-stop-on-eos]\n"
    "                        [--no-prefix-cache | --prefix-cache-cells C] [--threads T]\n"
    "                        [--verbose]\n"
    "       cellcache_runner --model M.pte --stdio\n"
    "                        [--no-prefix-cache | --prefix-cache-cells C] [--threads T]\n"
    "                        [--verbose]\n"
    "       cellcache_runner --model M.pte --print-info\n"
    "\n"
    "Generation from a cell-cache .pte without Python (continuous batching; the n samples\n"
    "of a prompt share its cached prefix).\n"
    "  --model M.pte            a .pte written by `cellcache export`\n"
    "  --no-prefix-cache        free a request's cells when it ends (by default they stay\n"
    "                           cached, and a later prompt that starts with the same tokens\n"
    "                           reuses their K/V; least recently used evicted first)\n"
    "  --prefix-cache-cells C   at most C cells held only by the prefix cache\n"
    "  --threads T              threads of the ExecuTorch runtime's pool, on which XNNPACK,\n"
    "                           the optimized kernels and the cell-cache attention run\n"
    "                           (default: ExecuTorch's choice, one per core); between\n"
    "                           parallel regions its workers spin CELLCACHE_POOL_SPIN_US\n"
    "                           microseconds before they sleep (default 1000; 0: the\n"
    "                           pool's own workers)\n"
    "  --verbose                show ExecuTorch's own log lines\n"
    "\n"
    "Speculative decoding (batch and --stdio; the output is plain decoding's):\n"
    "  --speculative lookup     prompt lookup: propose the tokens that followed the sample's\n"
    "                           last tokens earlier in its prompt + output\n"
    "  --speculative draft      a draft model proposes (--draft-model D.pte: a cell-cache\n"
    "                           .pte with the same vocabulary and tokenizer)\n"
    "  --draft-max K|auto       most tokens proposed per sample and step, at most the\n"
    "                           program's max_tokens_per_step - 1 (default auto: chosen\n"
    "                           before the first request from measured step costs)\n"
    "  --lookup-min-ngram M     prompt lookup's match lengths (defaults 2 and 3)\n"
    "  --lookup-max-ngram M\n"
    "  The summary line reports proposed and accepted tokens and tokens per forward.\n"
    "\n"
    "Batch mode (--prompts):\n"
    "  --prompts FILE           one prompt per line, space-separated token ids (blank lines\n"
    "                           skipped)\n"
    "  --text                   the prompts file holds text, one prompt per line (encoded by\n"
    "                           the program's tokenizer); the output is text\n"
    "  --chat                   each line is a user message, rendered by the program's chat\n"
    "                           template; the output is the reply's text\n"
    "  --n N                    samples per prompt (default 1)\n"
    "  --max-new-tokens K       new tokens per sample (default 32)\n"
    "  --temperature T          0 = greedy (default), > 0 samples\n"
    "  --seed S                 seed for reproducible sampling\n"
    "  --no-stop-on-eos         keep generating past EOS\n"
      "  Output: one line per sample, \"prompt_index sample_index: ids...\" (a stop token that\n"
    "  ended a sample is its last id), or with --text / --chat \"prompt_index sample_index:\n"
    "  \\\"text\\\"\" (a JSON string); a summary line on stderr.\n"
    "\n"
    "Server mode (--stdio): one JSON object per line on stdin, one per line on stdout\n"
    "(flushed after every step); requests run together as they arrive.\n"
    "  in   {\"id\": \"a\", \"prompt\": [0, 340, 344], \"max_new_tokens\": 16, \"n\": 1,\n"
    "        \"temperature\": 0, \"seed\": 1, \"top_k\": 40, \"top_p\": 0.9,\n"
    "        \"stop_token_ids\": [2], \"stop_on_eos\": true, \"logprobs\": 2}\n"
    "         \"id\" (a string or an integer, echoed back; not one still running) and\n"
    "         \"prompt\" (token ids) are required; the rest default to 16 new tokens, n 1,\n"
    "         greedy, stop on the program's EOS ids, no logprobs; null = the default.\n"
    "         \"speculative\": false keeps a request out of --speculative decoding.\n"
    "       {\"id\": \"b\", \"text\": \"Once upon a time\"}   the prompt as text (the program's\n"
    "         own tokenizer, BOS included); its token lines carry \"text\" too\n"
    "       {\"id\": \"c\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"tools\": [...]}\n"
    "         a chat, rendered by the program's chat template (+ \"chat_template_kwargs\")\n"
    "       \"json_schema\": {...} or \"grammar\": \"root ::= ...\" (GBNF), in any request:\n"
    "         structured output; JSON as json.dumps writes it; a sample ends (\"stop\") on\n"
    "         the token that completes it when nothing else could follow\n"
    "       {\"cancel\": \"a\"}   ends request \"a\" (its samples finish \"cancelled\")\n"
    "  out  {\"id\": \"a\", \"sample\": 0, \"token\": 123}   each token as it is chosen (a stop\n"
    "         token included), + \"logprob\" and \"top_logprobs\": [[id, logprob], ...] when\n"
    "         \"logprobs\" is set\n"
    "       {\"id\": \"a\", \"sample\": 0, \"finish\": \"stop\"|\"length\"|\"cancelled\"|\"error\",\n"
    "        \"usage\": {\"prompt_tokens\": P, \"cached_tokens\": C, \"completion_tokens\": K}}\n"
    "         once per sample, last (with --speculative, usage also has \"proposed_tokens\"\n"
    "         and \"accepted_tokens\")\n"
    "       {\"id\": \"a\", \"error\": \"line N: ...\"}   a line refused, nothing of it run (id null\n"
    "         when unreadable): bad JSON, a wrong type or value, an unknown field, a line\n"
    "         over 4 MiB, a cancel of an id not running; the server goes on\n"
    "  To continue a conversation, send its whole history as the next prompt: the prefix\n"
    "  cache serves the part it has seen (\"cached_tokens\"). At the end of stdin the\n"
    "  server finishes what it accepted and exits; a summary line goes to stderr.\n"
    "\n"
    "--print-info: the program's metadata (cells, layers, vocabulary, stop tokens,\n"
    "  quantization, tokenizer_kind, tokenizer_json, chat_template, ...) as one JSON\n"
    "  object on stdout.\n"
    "\n"
    "Exit status: 0 done; 2 a bad option, model or prompts file (one \"error:\" line on\n"
    "stderr); 1 a runtime failure (batch: a forward failed; --stdio: stdout closed early).\n";

struct Options {
  Options() { generate.max_new_tokens = 32; }
  std::string model;
  std::string prompts;
  cellcache::runner::SamplingParams generate;
  cellcache::runner::EngineOptions engine;
  bool stdio = false;
  bool print_info = false;
  std::string prompts_as;  // "" (token ids), "--text" or "--chat"
  std::string batch_flag;  // the first batch-mode-only option given (refused with --stdio)
  // Speculative decoding: --speculative's value ("" = off), the draft .pte,
  // and the first option that needs --speculative.
  std::string speculative;
  std::string draft_model;
  cellcache::runner::SpeculativeOptions speculative_options;
  std::string speculative_flag;
  int32_t threads = 0;  // 0: the runtime pool's own size
  bool verbose = false;
  bool help = false;
};

Outcome<int32_t> positive_int(std::string_view flag, std::string_view text) {
  int32_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value < 1) {
    return user_error(std::string(flag) + " expects a positive integer, got '" +
                      std::string(text) + "'");
  }
  return value;
}

// 0 is a valid bound (the prefix cache keeps nothing only it holds).
Outcome<int32_t> non_negative_int(std::string_view flag, std::string_view text) {
  int32_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value < 0) {
    return user_error(std::string(flag) + " expects an integer >= 0, got '" + std::string(text) +
                      "'");
  }
  return value;
}

Outcome<double> non_negative_number(std::string_view flag, std::string_view text) {
  double value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || !(value >= 0) ||
      value == std::numeric_limits<double>::infinity()) {
    return user_error(std::string(flag) + " expects a number >= 0, got '" + std::string(text) +
                      "'");
  }
  return value;
}

Outcome<uint64_t> seed_value(std::string_view text) {
  uint64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    return user_error("--seed expects a non-negative integer, got '" + std::string(text) + "'");
  }
  return value;
}

// Applies one "--flag value" option.
Outcome<> apply_value(Options& o, std::string_view flag, std::string_view value) {
  auto& g = o.generate;
  if (flag == "--model") {
    o.model = value;
  } else if (flag == "--prompts") {
    o.prompts = value;
  } else if (flag == "--n" || flag == "--max-new-tokens") {
    auto v = positive_int(flag, value);
    if (!v.ok()) return v.error();
    (flag == "--n" ? g.n : g.max_new_tokens) = v.value();
  } else if (flag == "--temperature") {
    auto v = non_negative_number(flag, value);
    if (!v.ok()) return v.error();
    g.temperature = v.value();
  } else if (flag == "--seed") {
    auto v = seed_value(value);
    if (!v.ok()) return v.error();
    g.seed = v.value();
  } else if (flag == "--prefix-cache-cells") {
    auto v = non_negative_int(flag, value);
    if (!v.ok()) return v.error();
    o.engine.prefix_cache_cells = v.value();
  } else if (flag == "--speculative") {
    o.speculative = value;
  } else if (flag == "--draft-model") {
    o.draft_model = value;
  } else if (flag == "--draft-max" && value == "auto") {
    o.speculative_options.max_draft.reset();
  } else if (flag == "--draft-max") {
    auto v = positive_int(flag, value);
    if (!v.ok()) {
      return user_error("--draft-max expects a positive integer or auto, got '" +
                        std::string(value) + "'");
    }
    o.speculative_options.max_draft = v.value();
  } else if (flag == "--lookup-min-ngram" || flag == "--lookup-max-ngram") {
    auto v = positive_int(flag, value);
    if (!v.ok()) return v.error();
    auto& spec = o.speculative_options;
    (flag == "--lookup-min-ngram" ? spec.min_ngram : spec.max_ngram) = v.value();
  } else if (flag == "--threads") {
    auto v = positive_int(flag, value);
    if (!v.ok()) return v.error();
    if (v.value() > cellcache::kernels::kMaxRuntimeThreads) {
      return user_error("--threads must be at most " +
                        std::to_string(cellcache::kernels::kMaxRuntimeThreads) + ", got " +
                        std::string(value));
    }
    o.threads = v.value();
  }
  return {};
}

bool takes_value(std::string_view flag) {
  for (std::string_view f : {"--model", "--prompts", "--n", "--max-new-tokens", "--temperature",
                             "--seed", "--prefix-cache-cells", "--threads", "--speculative",
                             "--draft-model", "--draft-max", "--lookup-min-ngram",
                             "--lookup-max-ngram"}) {
    if (flag == f) return true;
  }
  return false;
}

Outcome<Options> parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::optional<std::string_view> inline_value;
    if (const size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "--help" || arg == "-h") {
      o.help = true;
    } else if (arg == "--no-stop-on-eos" && !inline_value) {
      o.generate.stop_on_eos = false;
      if (o.batch_flag.empty()) o.batch_flag = arg;
    } else if ((arg == "--text" || arg == "--chat") && !inline_value) {
      if (!o.prompts_as.empty() && o.prompts_as != arg) {
        return user_error("--text and --chat are one or the other");
      }
      o.prompts_as = arg;
      if (o.batch_flag.empty()) o.batch_flag = arg;
    } else if (arg == "--verbose" && !inline_value) {
      o.verbose = true;
    } else if (arg == "--stdio" && !inline_value) {
      o.stdio = true;
    } else if (arg == "--print-info" && !inline_value) {
      o.print_info = true;
    } else if (arg == "--no-prefix-cache" && !inline_value) {
      o.engine.prefix_cache = false;
    } else if (takes_value(arg)) {
      if (!inline_value && i + 1 >= argc) {
        return user_error(std::string(arg) + " expects a value");
      }
      const bool speculative_flag = arg == "--speculative" || arg == "--draft-model" ||
                                    arg == "--draft-max" || arg == "--lookup-min-ngram" ||
                                    arg == "--lookup-max-ngram";
      if (speculative_flag && arg != "--speculative" && o.speculative_flag.empty()) {
        o.speculative_flag = arg;
      }
      if (arg != "--model" && arg != "--prefix-cache-cells" && arg != "--threads" &&
          !speculative_flag && o.batch_flag.empty()) {
        o.batch_flag = arg;
      }
      auto applied = apply_value(o, arg, inline_value ? *inline_value : argv[++i]);
      if (!applied.ok()) return applied.error();
    } else {
      return user_error("unknown option '" + std::string(argv[i]) + "' (see --help)");
    }
  }
  if (o.help) return o;
  if (o.model.empty()) return user_error("--model M.pte is required (see --help)");
  if (!o.engine.prefix_cache && o.engine.prefix_cache_cells) {
    return user_error("--prefix-cache-cells bounds the prefix cache that --no-prefix-cache "
                      "turns off; give one or the other");
  }
  if (!o.speculative.empty()) {
    auto method = cellcache::runner::speculative_method(o.speculative);
    if (!method.ok()) return method.error();
    o.speculative_options.method = method.value();
    if (method.value() == cellcache::runner::SpeculativeMethod::kLookup &&
        !o.draft_model.empty()) {
      return user_error("a draft model is used by speculative method 'draft', not 'lookup'");
    }
    o.engine.speculative = o.speculative_options;  // checked against the program at load
  } else if (!o.speculative_flag.empty()) {
    return user_error(o.speculative_flag + " sets up speculative decoding; give --speculative "
                      "lookup or --speculative draft with it");
  }
  if (o.print_info) {
    if (o.stdio || !o.batch_flag.empty() || !o.engine.prefix_cache ||
        o.engine.prefix_cache_cells || o.threads || !o.speculative.empty()) {
      return user_error("--print-info takes only --model (it runs nothing)");
    }
    return o;
  }
  if (o.stdio) {
    if (!o.batch_flag.empty()) {
      return user_error(o.batch_flag + " is a batch-mode option; with --stdio each request "
                        "line sets its own prompt and parameters (see --help)");
    }
    return o;
  }
  if (o.prompts.empty()) {
    return user_error("--prompts FILE (batch mode) or --stdio (JSON lines) is required "
                      "(see --help)");
  }
  return o;
}

void print_generations(const cellcache::runner::Generations& results) {
  for (size_t i = 0; i < results.size(); ++i) {
    for (size_t j = 0; j < results[i].size(); ++j) {
      std::printf("%zu %zu:", i, j);
      for (int64_t token : results[i][j]) std::printf(" %lld", static_cast<long long>(token));
      std::printf("\n");
    }
  }
  std::fflush(stdout);
}

// The summary lines' speculative-decoding clause ("" when it is off).
std::string speculation_summary(const Options& options,
                                const cellcache::runner::EngineStats& s) {
  if (options.speculative.empty()) return "";
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "; speculative (%s, up to %d a step): proposed %lld tokens, accepted %lld "
                "(%.0f%%), %.2f tokens per forward",
                options.speculative.c_str(), static_cast<int>(s.max_draft),
                static_cast<long long>(s.proposed_tokens),
                static_cast<long long>(s.accepted_tokens), 100.0 * s.acceptance_rate(),
                s.tokens_per_forward());
  std::string out = buf;
  if (!s.speculation_failure.empty()) {
    out += "; the draft model failed, speculation stopped: " + s.speculation_failure;
  }
  return out;
}

void print_stats(const Options& options, const cellcache::runner::GenerateStats& s) {
  std::fprintf(stderr,
               "prefill %lld tokens at %.0f tok/s, decode %lld tokens at %.0f tok/s, %lld "
               "steps, peak cells %d of %d%s%s\n",
               static_cast<long long>(s.prefill_tokens), s.prefill_tokens_per_s(),
               static_cast<long long>(s.decode_tokens), s.decode_tokens_per_s(),
               static_cast<long long>(s.steps), s.peak_cells, s.capacity,
               s.pool_summary().c_str(), speculation_summary(options, s).c_str());
}

int fail(const RunError& error) {
  std::fprintf(stderr, "cellcache_runner: error: %s\n", error.message.c_str());
  return error.kind == ErrorKind::kUser ? 2 : 1;
}

// --print-info: the program's metadata as one JSON object.
int print_info(const Options& options) {
  auto program = cellcache::runner::CellCacheProgram::load(options.model);
  if (!program.ok()) return fail(program.error());
  std::printf("%s\n", cellcache::runner::to_json(program.value()->info()).c_str());
  return std::fflush(stdout) == 0 ? 0 : 1;
}

// Batch mode with --text / --chat: prompts of text (or user messages) in, the
// samples' text out, each as a JSON string.
int generate_text(const Options& options) {
  auto texts = cellcache::runner::read_text_prompts_file(options.prompts);
  if (!texts.ok()) return fail(texts.error());
  auto runner =
      cellcache::runner::BatchRunner::load(options.model, options.engine, options.draft_model);
  if (!runner.ok()) return fail(runner.error());
  cellcache::runner::ProgramText text = cellcache::runner::load_program_text(runner.value()->info());
  if (!text.tokenizer) return fail(user_error(options.prompts_as + ": " + text.text_unavailable));
  if (options.prompts_as == "--chat" && !text.chat_template) {
    return fail(user_error("--chat: " + text.text_unavailable));
  }
  std::vector<std::vector<int64_t>> prompts;
  for (size_t i = 0; i < texts.value().size(); ++i) {
    const std::string& line = texts.value()[i];
    Outcome<std::vector<int64_t>> ids = std::vector<int64_t>{};
    if (options.prompts_as == "--chat") {
      nlohmann::json messages = nlohmann::json::array({{{"role", "user"}, {"content", line}}});
      auto rendered = text.chat_template->render(messages.dump(), "", true);
      if (!rendered.ok()) return fail(rendered.error());
      ids = text.tokenizer->encode(rendered.value(), text.chat_template->builtin());
    } else {
      ids = text.tokenizer->encode(line, /*add_special_tokens=*/true);
    }
    if (!ids.ok()) return fail(ids.error());
    if (ids.value().empty()) {
      return fail(user_error("prompt " + std::to_string(i) + " encodes to no tokens"));
    }
    prompts.push_back(std::move(ids.value()));
  }
  auto results = runner.value()->generate(prompts, options.generate);
  if (!results.ok()) return fail(results.error());
  for (size_t i = 0; i < results.value().size(); ++i) {
    for (size_t j = 0; j < results.value()[i].size(); ++j) {
      cellcache::runner::StreamDecoder decoder(*text.tokenizer);
      std::string out;
      for (int64_t token : results.value()[i][j]) out += decoder.push(token);
      out += decoder.flush();
      std::printf("%zu %zu: %s\n", i, j,
                  nlohmann::json(out).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    }
  }
  std::fflush(stdout);
  print_stats(options, runner.value()->last_stats());
  return 0;
}

// --stdio: serves JSON lines until stdin ends (stdio_server.h).
int serve(const Options& options) {
  auto program = cellcache::runner::CellCacheProgram::load(options.model);
  if (!program.ok()) return fail(program.error());
  cellcache::runner::EngineOptions engine_options = options.engine;
  std::unique_ptr<cellcache::runner::CellCacheProgram> draft;  // outlives the engine
  if (!options.draft_model.empty()) {
    auto loaded = cellcache::runner::load_draft(options.draft_model, engine_options);
    if (!loaded.ok()) return fail(loaded.error());
    draft = std::move(loaded.value());
  }
  // Text, chats and grammars from what the program carries (program_text.h).
  cellcache::runner::ProgramText text = cellcache::runner::load_program_text(program.value()->info());
  cellcache::runner::GrammarHooks grammar_hooks;  // outlives the engine
  engine_options.hooks = &grammar_hooks;
  auto engine = cellcache::runner::Engine::create(*program.value(), engine_options);
  if (!engine.ok()) return fail(engine.error());
#ifdef SIGPIPE
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout is a write error, not a kill
#endif
  cellcache::runner::StdioOptions stdio;
  stdio.tokenizer = text.tokenizer.get();
  stdio.chat_template = text.chat_template ? &*text.chat_template : nullptr;
  stdio.grammar_compiler = text.grammar_compiler.get();
  stdio.grammar_hooks = &grammar_hooks;
  stdio.text_unavailable = text.text_unavailable;
  stdio.grammar_unavailable = text.grammar_unavailable;
  stdio.log = [](const std::string& message) {
    std::fprintf(stderr, "cellcache_runner: %s\n", message.c_str());
  };
  const cellcache::runner::StdioOutput out = [](std::string_view lines) {
    return std::fwrite(lines.data(), 1, lines.size(), stdout) == lines.size() &&
           std::fflush(stdout) == 0;
  };
  auto served = cellcache::runner::serve_stdio(*engine.value(), std::cin, out, stdio);
  if (!served.ok()) return fail(served.error());
  const auto& s = served.value();
  auto& eng = *engine.value();
  const auto& e = eng.stats();
  // Summed over the pools, as reclaimable_cells (one pool: its cells).
  int32_t held = 0;
  for (int32_t p = 0; p < eng.cache().n_pools(); ++p) {
    const cellcache::PoolState pool = eng.cache().pool_state(p).value();
    held += pool.capacity - pool.free_cells;
  }
  const int32_t cached = eng.prefix_cache() ? eng.prefix_cache()->reclaimable_cells() : 0;
  std::fprintf(stderr,
               "served %lld requests (lines refused: %lld): prefill %lld tokens at %.0f tok/s, "
               "decode %lld tokens at %.0f tok/s, %lld steps, peak cells %d of %d%s; prefix "
               "cache: %lld of %lld prompt tokens cached; %d cells held at exit, %d of them "
               "by the prefix cache%s\n",
               static_cast<long long>(s.requests), static_cast<long long>(s.refused),
               static_cast<long long>(e.prefill_tokens), e.prefill_tokens_per_s(),
               static_cast<long long>(e.decode_tokens), e.decode_tokens_per_s(),
               static_cast<long long>(e.steps), e.peak_cells, e.capacity, e.pool_summary().c_str(),
               static_cast<long long>(s.cached_tokens), static_cast<long long>(s.prompt_tokens),
               held, cached, speculation_summary(options, e).c_str());
  return 0;
}

int run(int argc, char** argv) {
  auto options = parse_args(argc, argv);
  if (!options.ok()) return fail(options.error());
  if (options->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  cellcache::runner::route_executorch_log(options->verbose);
  // Before the runtime's pool exists (kernels/pool_executor.h).
  if (auto error = cellcache::kernels::configure_pool_spin_from_env()) {
    return fail(user_error(*error));
  }
  // Before any program loads (kernel_threads.h).
  if (options->threads && !cellcache::kernels::set_runtime_thread_count(options->threads)) {
    return fail(cellcache::runner::runtime_error(
        "the ExecuTorch thread pool did not resize to " + std::to_string(options->threads) +
        " threads"));
  }
  if (options->print_info) return print_info(options.value());
  if (options->stdio) return serve(options.value());
  if (!options->prompts_as.empty()) return generate_text(options.value());
  auto prompts = cellcache::runner::read_prompts_file(options->prompts);
  if (!prompts.ok()) return fail(prompts.error());
  auto runner =
      cellcache::runner::BatchRunner::load(options->model, options->engine, options->draft_model);
  if (!runner.ok()) return fail(runner.error());
  auto results = runner.value()->generate(prompts.value(), options->generate);
  if (!results.ok()) return fail(results.error());
  print_generations(results.value());
  print_stats(options.value(), runner.value()->last_stats());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // e.g. std::bad_alloc: the runner itself never throws
    std::fprintf(stderr, "cellcache_runner: internal error: %s\n", e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "cellcache_runner: internal error\n");
    return 1;
  }
}
