// Engine under concurrency (run under ThreadSanitizer by scripts/test.sh):
// four threads submit and cancel while one thread steps. Every accepted
// request gets exactly n finishes, tokens arrive only before them, and when
// everything has finished no cell or id is held.
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "check.h"
#include "engine.h"
#include "synthetic_forward.h"

namespace {

using namespace cellcache::runner;
using cellcache::runner::testing::SyntheticForward;

// Sink callbacks run on the stepping thread; the submitting threads read
// only the atomics.
struct CountingSink final : Sink {
  explicit CountingSink(int32_t n) : n(n) {}
  void on_token(const TokenEvent& e) override {
    if (finished_samples.count(e.sample)) token_after_finish = true;
    ++tokens;
  }
  void on_finish(const FinishEvent& e) override {
    if (!finished_samples.insert(e.sample).second) double_finish = true;
    finishes.fetch_add(1);
  }
  int32_t n;
  std::set<int32_t> finished_samples;
  int64_t tokens = 0;
  bool token_after_finish = false;
  bool double_finish = false;
  std::atomic<int32_t> finishes{0};
};

void run_threads(bool prefix_cache) {
  SyntheticForward f(512, 40, 16, {3});
  f.record = false;
  EngineOptions options;
  options.prefix_cache = prefix_cache;
  options.prefix_cache_cells = prefix_cache ? std::optional<int32_t>(128) : std::nullopt;
  auto engine = std::move(Engine::create(f, options).value());
  std::mutex accepted_mutex;
  std::vector<std::shared_ptr<CountingSink>> accepted;
  std::atomic<int> done_threads{0};
  std::atomic<int64_t> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(t));
      std::vector<RequestId> mine;
      for (int i = 0; i < 150; ++i) {
        std::vector<int64_t> prompt(1 + rng() % 12);
        for (auto& tok : prompt) tok = rng() % 8;  // shared prefixes
        SamplingParams p;
        p.n = 1 + static_cast<int32_t>(rng() % 3);
        p.max_new_tokens = 1 + static_cast<int32_t>(rng() % 20);
        if (rng() % 3 == 0) {
          p.temperature = 0.7;
          p.seed = rng() % 5;
        }
        if (rng() % 10 == 0) p.max_new_tokens = 1000;  // never fits: refused
        auto sink = std::make_shared<CountingSink>(p.n);
        auto id = engine->submit(prompt, p, sink);
        if (id.ok()) {
          mine.push_back(id.value());
          std::lock_guard<std::mutex> lock(accepted_mutex);
          accepted.push_back(sink);
        } else {
          refused.fetch_add(1);
        }
        if (!mine.empty() && rng() % 4 == 0) {
          (void)engine->cancel(mine[rng() % mine.size()]);  // may have finished: fine
        }
        (void)engine->cancel(-5);  // unknown: a user error, nothing else
        if (rng() % 8 == 0) std::this_thread::yield();
      }
      done_threads.fetch_add(1);
    });
  }
  int64_t steps = 0;
  while (done_threads.load() < 4 || engine->live_requests() > 0) {
    auto stepped = engine->step();
    CHECK(stepped.ok());
    if (!stepped.ok()) break;
    ++steps;
    if (!stepped.value()) std::this_thread::yield();
  }
  for (auto& th : threads) th.join();
  while (true) {
    auto stepped = engine->step();
    if (!stepped.ok() || !stepped.value()) break;
  }
  CHECK(refused.load() > 0);
  CHECK(steps > 0);
  for (const auto& sink : accepted) {
    CHECK_EQ(sink->finishes.load(), sink->n);
    CHECK(!sink->token_after_finish);
    CHECK(!sink->double_finish);
  }
  CHECK_EQ(engine->live_requests(), 0);
  if (engine->prefix_cache() != nullptr) engine->clear_prefix_cache();
  CHECK_EQ(engine->cache().n_sequences(), 0);
  CHECK_EQ(engine->cache().free_cells(), 512);
  CHECK(engine->cache().check_invariants().is_ok());
}

TEST(engine_submit_and_cancel_from_four_threads) { run_threads(false); }
TEST(engine_submit_and_cancel_from_four_threads_with_prefix_cache) { run_threads(true); }

}  // namespace
