// cellcache_runner: batched generation from a cell-cache .pte, without Python.
//
//   cellcache_runner --model M.pte --prompts FILE [--n N] [--max-new-tokens K]
//                    [--temperature T] [--seed S] [--no-stop-on-eos] [--verbose]
//
// FILE: one prompt per line as whitespace-separated token ids (prompts_file.h).
// stdout: one line per sample, "prompt_index sample_index: ids...", sorted by
// prompt then sample. stderr: a summary line (prefill/decode tokens/s, peak
// cells). Exit status: 0 done, 2 user error (one "error:" line on stderr),
// 1 runtime failure.
#include <charconv>
#include <cstdio>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "batch_runner.h"
#include "et_log.h"
#include "prompts_file.h"

namespace {

using cellcache::runner::ErrorKind;
using cellcache::runner::Outcome;
using cellcache::runner::RunError;
using cellcache::runner::user_error;

constexpr const char* kUsage =
    "usage: cellcache_runner --model M.pte --prompts FILE [--n N] [--max-new-tokens K]\n"
    "                        [--temperature T] [--seed S] [--no-stop-on-eos] [--verbose]\n"
    "\n"
    "Batched generation from a cell-cache .pte (continuous batching; the n samples of a\n"
    "prompt share its cached prefix).\n"
    "  --model M.pte        a .pte written by `cellcache export`\n"
    "  --prompts FILE       one prompt per line, space-separated token ids (blank lines skipped)\n"
    "  --n N                samples per prompt (default 1)\n"
    "  --max-new-tokens K   new tokens per sample (default 32)\n"
    "  --temperature T      0 = greedy (default), > 0 samples\n"
    "  --seed S             seed for reproducible sampling\n"
    "  --no-stop-on-eos     keep generating past EOS\n"
    "  --verbose            show ExecuTorch's own log lines\n"
    "Output: one line per sample, \"prompt_index sample_index: ids...\".\n";

struct Options {
  std::string model;
  std::string prompts;
  cellcache::runner::GenerateOptions generate;
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
    g.sampling.temperature = v.value();
  } else if (flag == "--seed") {
    auto v = seed_value(value);
    if (!v.ok()) return v.error();
    g.sampling.seed = v.value();
  }
  return {};
}

bool takes_value(std::string_view flag) {
  for (std::string_view f : {"--model", "--prompts", "--n", "--max-new-tokens", "--temperature",
                             "--seed"}) {
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
    } else if (arg == "--verbose" && !inline_value) {
      o.verbose = true;
    } else if (takes_value(arg)) {
      if (!inline_value && i + 1 >= argc) {
        return user_error(std::string(arg) + " expects a value");
      }
      auto applied = apply_value(o, arg, inline_value ? *inline_value : argv[++i]);
      if (!applied.ok()) return applied.error();
    } else {
      return user_error("unknown option '" + std::string(argv[i]) + "' (see --help)");
    }
  }
  if (o.help) return o;
  if (o.model.empty()) return user_error("--model M.pte is required (see --help)");
  if (o.prompts.empty()) return user_error("--prompts FILE is required (see --help)");
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

void print_stats(const cellcache::runner::GenerateStats& s) {
  std::fprintf(stderr,
               "prefill %lld tokens at %.0f tok/s, decode %lld tokens at %.0f tok/s, %lld "
               "steps, peak cells %d of %d\n",
               static_cast<long long>(s.prefill_tokens), s.prefill_tokens_per_s(),
               static_cast<long long>(s.decode_tokens), s.decode_tokens_per_s(),
               static_cast<long long>(s.steps), s.peak_cells, s.capacity);
}

int fail(const RunError& error) {
  std::fprintf(stderr, "cellcache_runner: error: %s\n", error.message.c_str());
  return error.kind == ErrorKind::kUser ? 2 : 1;
}

int run(int argc, char** argv) {
  auto options = parse_args(argc, argv);
  if (!options.ok()) return fail(options.error());
  if (options->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  cellcache::runner::route_executorch_log(options->verbose);
  auto prompts = cellcache::runner::read_prompts_file(options->prompts);
  if (!prompts.ok()) return fail(prompts.error());
  auto runner = cellcache::runner::BatchRunner::load(options->model);
  if (!runner.ok()) return fail(runner.error());
  auto results = runner.value()->generate(prompts.value(), options->generate);
  if (!results.ok()) return fail(results.error());
  print_generations(results.value());
  print_stats(runner.value()->last_stats());
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
