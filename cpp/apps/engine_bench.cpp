// cellcache_engine_bench: the on-device engine's figures on a real program
// (scripts/bench_engine.py runs it and prints the table; not a test).
//
//   cellcache_engine_bench --model M.pte --scenario multiturn|staggered|overhead
//                          [--turns 8] [--system 256] [--message 64] [--reply 128]
//                          [--requests 8] [--prompt 128] [--new 64] [--every 2]
//                          [--n 2] [--repeats 3] [--seed 1] [--temperature 0]
//
// multiturn: one conversation of `turns` turns through Engine (each turn's
//   prompt is the whole history: system + (message, reply) pairs + the new
//   message); per turn the prefill tokens and time to first token, then the
//   last turn's history prefilled cold (prefix cache cleared). JSON line per
//   turn and a summary line.
// staggered: `requests` greedy prompts of `prompt` tokens, one submitted
//   every `every` steps, vs. BatchRunner-style (all submitted at once) on the
//   same engine, alternated `repeats` times; aggregate tokens/s of each and
//   whether every request's tokens equal the all-at-once run's.
// overhead: `requests` prompts x n samples of `new` tokens submitted at once;
//   the engine's own time outside the forward (plan, sample, commit) as a
//   share of decode-only steps.
// Output: JSON lines on stdout.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "engine.h"
#include "et_log.h"
#include "pool_executor.h"
#include "program.h"

namespace {

using namespace cellcache::runner;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model, scenario;
  int turns = 8, system = 256, message = 64, reply = 128;
  int requests = 8, prompt = 128, new_tokens = 64, every = 2, n = 1, repeats = 3;
  uint64_t seed = 1;
  double temperature = 0;  // overhead: > 0 samples (seeded) instead of greedy
};

struct Recorder final : Sink {
  Clock::time_point first_token{};
  bool got_first = false;
  std::map<int32_t, std::vector<int64_t>> tokens;
  int32_t finishes = 0;
  int64_t cached = 0;
  void on_token(const TokenEvent& e) override {
    if (!got_first) {
      got_first = true;
      first_token = Clock::now();
    }
    tokens[e.sample].push_back(e.token);
  }
  void on_finish(const FinishEvent& e) override {
    ++finishes;
    cached = e.usage.cached_tokens;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "cellcache_engine_bench: error: %s\n", what.c_str());
  std::exit(2);
}

void drain(Engine& engine) {
  while (true) {
    auto s = engine.step();
    if (!s.ok()) die(s.error().message);
    if (!s.value()) return;
  }
}

std::vector<int64_t> random_ids(std::mt19937_64& rng, int count, int64_t vocab) {
  std::vector<int64_t> ids(static_cast<size_t>(count));
  for (auto& t : ids) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

SamplingParams greedy(int max_new, int n = 1) {
  SamplingParams p;
  p.max_new_tokens = max_new;
  p.n = n;
  p.stop_on_eos = false;  // fixed lengths: comparable work
  return p;
}

// Time to first token of `prompt` on `engine`, stepping until it finishes.
std::shared_ptr<Recorder> run_one(Engine& engine, const std::vector<int64_t>& prompt,
                                  const SamplingParams& p, double* ttft) {
  auto sink = std::make_shared<Recorder>();
  const auto t0 = Clock::now();
  if (auto id = engine.submit(prompt, p, sink); !id.ok()) die(id.error().message);
  drain(engine);
  *ttft = secs(t0, sink->first_token);
  return sink;
}

void multiturn(Engine& engine, const Args& a, int64_t vocab) {
  std::mt19937_64 rng(a.seed);
  std::vector<int64_t> history = random_ids(rng, a.system, vocab);
  double last_ttft = 0;
  for (int turn = 1; turn <= a.turns; ++turn) {
    const auto message = random_ids(rng, a.message, vocab);
    history.insert(history.end(), message.begin(), message.end());
    engine.reset_stats();
    double ttft = 0;
    auto sink = run_one(engine, history, greedy(a.reply), &ttft);
    std::printf("{\"scenario\": \"multiturn\", \"turn\": %d, \"history\": %zu, \"cached\": %lld, "
                "\"prefill_tokens\": %lld, \"ttft_s\": %.6f}\n",
                turn, history.size(), static_cast<long long>(sink->cached),
                static_cast<long long>(engine.stats().prefill_tokens), ttft);
    std::fflush(stdout);
    last_ttft = ttft;
    history.insert(history.end(), sink->tokens[0].begin(), sink->tokens[0].end());
    if (turn == a.turns) {
      // The same last-turn prompt, cold: alternate cold and warm repeats.
      history.resize(history.size() - sink->tokens[0].size());
      std::vector<double> cold, warm;
      for (int r = 0; r < a.repeats; ++r) {
        engine.clear_prefix_cache();
        double t = 0;
        run_one(engine, history, greedy(1), &t);
        cold.push_back(t);
        // Warm again: the history minus the last message is cached.
        std::vector<int64_t> before(history.begin(), history.end() - a.message);
        engine.clear_prefix_cache();
        double unused = 0;
        run_one(engine, before, greedy(1), &unused);
        run_one(engine, history, greedy(1), &t);
        warm.push_back(t);
      }
      const double cold_med = median(cold), warm_med = median(warm);
      std::printf("{\"scenario\": \"multiturn\", \"summary\": true, \"history\": %zu, "
                  "\"last_turn_ttft_s\": %.6f, \"warm_ttft_median_s\": %.6f, "
                  "\"cold_ttft_median_s\": %.6f, \"ratio\": %.4f}\n",
                  history.size(), last_ttft, warm_med, cold_med, warm_med / cold_med);
    }
  }
}

double run_batch(Engine& engine, const std::vector<std::vector<int64_t>>& prompts,
                 const SamplingParams& p, int every,
                 std::vector<std::shared_ptr<Recorder>>* sinks) {
  engine.clear_prefix_cache();
  sinks->clear();
  const auto t0 = Clock::now();
  size_t next = 0;
  int64_t steps = 0;
  while (true) {
    while (next < prompts.size() && (every == 0 || steps >= static_cast<int64_t>(next) * every)) {
      sinks->push_back(std::make_shared<Recorder>());
      if (auto id = engine.submit(prompts[next], p, sinks->back()); !id.ok()) {
        die(id.error().message);
      }
      ++next;
    }
    auto s = engine.step();
    if (!s.ok()) die(s.error().message);
    ++steps;
    if (!s.value() && next == prompts.size()) break;
  }
  return secs(t0, Clock::now());
}

void staggered(Engine& engine, const Args& a, int64_t vocab) {
  std::mt19937_64 rng(a.seed);
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < a.requests; ++i) prompts.push_back(random_ids(rng, a.prompt, vocab));
  const SamplingParams p = greedy(a.new_tokens);
  const double tokens = static_cast<double>(a.requests) * a.new_tokens;
  std::vector<double> at_once, stag;
  bool same = true;
  std::string first_difference;  // per request of the last repeat: first differing token, -1 none
  for (int r = 0; r < a.repeats; ++r) {
    std::vector<std::shared_ptr<Recorder>> once_sinks, stag_sinks;
    at_once.push_back(tokens / run_batch(engine, prompts, p, 0, &once_sinks));
    stag.push_back(tokens / run_batch(engine, prompts, p, a.every, &stag_sinks));
    first_difference.clear();
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto& x = once_sinks[i]->tokens[0];
      const auto& y = stag_sinks[i]->tokens[0];
      same &= x == y;
      size_t k = 0;
      while (k < x.size() && k < y.size() && x[k] == y[k]) ++k;
      first_difference += (i ? ", " : "") + std::to_string(x == y ? -1 : static_cast<long>(k));
    }
  }
  const double once_med = median(at_once), stag_med = median(stag);
  std::printf("{\"scenario\": \"staggered\", \"requests\": %d, \"every_steps\": %d, "
              "\"at_once_tok_s\": %.1f, \"staggered_tok_s\": %.1f, \"ratio\": %.4f, "
              "\"same_tokens\": %s, \"first_difference\": [%s]}\n",
              a.requests, a.every, once_med, stag_med, stag_med / once_med,
              same ? "true" : "false", first_difference.c_str());
}

void overhead(Engine& engine, const Args& a, int64_t vocab) {
  std::mt19937_64 rng(a.seed);
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < a.requests; ++i) prompts.push_back(random_ids(rng, a.prompt, vocab));
  for (int r = 0; r < a.repeats; ++r) {
    engine.clear_prefix_cache();
    engine.reset_stats();
    std::vector<std::shared_ptr<Recorder>> sinks;
    for (auto& prompt : prompts) {
      sinks.push_back(std::make_shared<Recorder>());
      SamplingParams p = greedy(a.new_tokens, a.n);
      if (a.temperature > 0) {
        p.temperature = a.temperature;
        p.seed = a.seed;
      }
      if (auto id = engine.submit(prompt, p, sinks.back()); !id.ok()) {
        die(id.error().message);
      }
    }
    const auto t0 = Clock::now();
    drain(engine);
    const double wall = secs(t0, Clock::now());
    const EngineStats& s = engine.stats();
    const double forward = s.prefill_seconds + s.decode_seconds;
    std::printf("{\"scenario\": \"overhead\", \"batch\": %d, \"steps\": %lld, "
                "\"decode_tok_s\": %.1f, \"prefill_tok_s\": %.1f, \"wall_s\": %.6f, "
                "\"forward_s\": %.6f, \"overhead_s\": %.6f, \"plan_s\": %.6f, "
                "\"sample_s\": %.6f, \"commit_s\": %.6f, \"overhead_share\": %.5f}\n",
                a.requests * a.n, static_cast<long long>(s.steps), s.decode_tokens_per_s(),
                s.prefill_tokens_per_s(), wall, forward, s.overhead_seconds, s.plan_seconds,
                s.sample_seconds, s.commit_seconds, s.overhead_seconds / (forward + s.overhead_seconds));
    std::fflush(stdout);
  }
}

int int_arg(std::string_view flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < 0) die(std::string(flag) + " expects an integer >= 0");
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string_view f = argv[i];
    if (i + 1 >= argc) die(std::string(f) + " expects a value");
    const char* v = argv[++i];
    if (f == "--model") a.model = v;
    else if (f == "--scenario") a.scenario = v;
    else if (f == "--turns") a.turns = int_arg(f, v);
    else if (f == "--system") a.system = int_arg(f, v);
    else if (f == "--message") a.message = int_arg(f, v);
    else if (f == "--reply") a.reply = int_arg(f, v);
    else if (f == "--requests") a.requests = int_arg(f, v);
    else if (f == "--prompt") a.prompt = int_arg(f, v);
    else if (f == "--new") a.new_tokens = int_arg(f, v);
    else if (f == "--every") a.every = int_arg(f, v);
    else if (f == "--n") a.n = int_arg(f, v);
    else if (f == "--repeats") a.repeats = int_arg(f, v);
    else if (f == "--seed") a.seed = static_cast<uint64_t>(int_arg(f, v));
    else if (f == "--temperature") a.temperature = std::strtod(v, nullptr);
    else die("unknown option " + std::string(f));
  }
  if (a.model.empty()) die("--model is required");
  cellcache::runner::route_executorch_log(false);
  if (auto error = cellcache::kernels::configure_pool_spin_from_env()) die(*error);
  auto program = CellCacheProgram::load(a.model);
  if (!program.ok()) die(program.error().message);
  auto engine = Engine::create(*program.value(), {});
  if (!engine.ok()) die(engine.error().message);
  const int64_t vocab = program.value()->info().vocab_size;
  if (a.scenario == "multiturn") multiturn(*engine.value(), a, vocab);
  else if (a.scenario == "staggered") staggered(*engine.value(), a, vocab);
  else if (a.scenario == "overhead") overhead(*engine.value(), a, vocab);
  else die("--scenario must be multiturn, staggered or overhead");
  return 0;
}
