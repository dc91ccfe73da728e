// Engine tests with a synthetic forward (tests/synthetic_forward.h): greedy
// tokens against an independent simulation of the formula, a request alone vs
// in a batch, staggered arrivals, cancel, multi-turn prefix reuse, stop ids,
// logprobs, forward failure and bad input.
#include <cmath>
#include <stdexcept>
#include <map>
#include <memory>
#include <vector>

#include "check.h"
#include "engine.h"
#include "engine_test_util.h"
#include "synthetic_forward.h"

namespace {

using namespace cellcache::runner;
using cellcache::runner::testing::SyntheticForward;

struct Collect final : Sink {
  std::map<int32_t, std::vector<int64_t>> tokens;
  std::map<int32_t, FinishEvent> finishes;
  std::vector<double> logprobs;
  std::vector<TokenLogprobs> full;
  int32_t finish_calls = 0;
  void on_token(const TokenEvent& e) override {
    tokens[e.sample].push_back(e.token);
    if (e.logprobs != nullptr) {
      logprobs.push_back(e.logprobs->logprob);
      full.push_back(*e.logprobs);
    }
  }
  void on_finish(const FinishEvent& e) override {
    finishes[e.sample] = e;
    ++finish_calls;
  }
};

std::vector<int64_t> greedy_oracle(const SyntheticForward& f, std::vector<int64_t> prompt,
                                   int32_t max_new, const std::vector<int64_t>& stops) {
  std::vector<int64_t> out;
  int64_t token = prompt.back();
  int64_t pos = static_cast<int64_t>(prompt.size()) - 1;
  while (static_cast<int32_t>(out.size()) < max_new) {
    token = f.next_token(token, pos++);
    out.push_back(token);
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
  }
  return out;
}

using cellcache::runner::testing::greedy;
using cellcache::runner::testing::run_all;

TEST(engine_greedy_matches_oracle_and_batch) {
  SyntheticForward f(256, 50, 16, {});
  auto engine = std::move(Engine::create(f, {}).value());
  std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}, {7}};
  std::vector<std::shared_ptr<Collect>> sinks;
  for (auto& p : prompts) {
    sinks.push_back(std::make_shared<Collect>());
    CHECK(engine->submit(p, greedy(12, 2), sinks.back()).ok());
  }
  run_all(*engine);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto want = greedy_oracle(f, prompts[i], 12, {});
    CHECK_EQ(sinks[i]->finish_calls, 2);
    for (int32_t j = 0; j < 2; ++j) {
      CHECK(sinks[i]->tokens[j] == want);
      CHECK(sinks[i]->finishes[j].reason == FinishReason::kLength);
      CHECK_EQ(sinks[i]->finishes[j].usage.completion_tokens, 12);
      CHECK_EQ(sinks[i]->finishes[j].usage.prompt_tokens, static_cast<int64_t>(prompts[i].size()));
    }
  }
  // Every step within the budget; decode tokens before prompt chunks.
  for (const StepBatch& b : f.batches) CHECK(b.tokens.size() <= 16u);
  CHECK(engine->cache().check_invariants().is_ok());
  CHECK_EQ(engine->live_requests(), 0);
}

TEST(engine_seeded_request_alone_equals_in_batch_and_staggered) {
  SamplingParams p;
  p.temperature = 0.9;
  p.top_p = 0.9;
  p.top_k = 20;
  p.seed = 7;
  p.n = 3;
  p.max_new_tokens = 10;
  std::vector<int64_t> prompt = {3, 1, 4, 1, 5};
  std::map<int32_t, std::vector<int64_t>> alone;
  {
    SyntheticForward f(256, 64, 8, {});
    auto engine = std::move(Engine::create(f, {}).value());
    auto sink = std::make_shared<Collect>();
    CHECK(engine->submit(prompt, p, sink).ok());
    run_all(*engine);
    alone = sink->tokens;
  }
  SyntheticForward f(256, 64, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto other = std::make_shared<Collect>();
  SamplingParams q = p;
  q.seed = 99;
  CHECK(engine->submit({9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9}, q, other).ok());
  for (int i = 0; i < 3; ++i) CHECK(engine->step().ok());  // arrives staggered
  auto sink = std::make_shared<Collect>();
  CHECK(engine->submit(prompt, p, sink).ok());
  run_all(*engine);
  CHECK(sink->tokens == alone);
  CHECK(alone.size() == 3u);
  CHECK(alone[0] != alone[1] || alone[1] != alone[2]);  // the samples differ
}

TEST(engine_cancel_mid_decode_frees_cells_next_step) {
  SyntheticForward f(128, 40, 8, {});
  EngineOptions no_prefix;
  no_prefix.prefix_cache = false;
  auto engine = std::move(Engine::create(f, no_prefix).value());
  auto sink = std::make_shared<Collect>();
  auto id = engine->submit({1, 2, 3, 4}, greedy(50, 2), sink);
  CHECK(id.ok());
  for (int i = 0; i < 5; ++i) CHECK(engine->step().ok());
  CHECK(engine->cache().free_cells() < 128);
  CHECK(engine->cancel(id.value()).ok());
  auto stepped = engine->step();
  CHECK(stepped.ok() && stepped.value());
  CHECK_EQ(engine->cache().free_cells(), 128);
  CHECK_EQ(engine->cache().n_sequences(), 0);
  CHECK_EQ(sink->finish_calls, 2);
  CHECK(sink->finishes[0].reason == FinishReason::kCancelled);
  CHECK_EQ(sink->finishes[1].usage.completion_tokens, 5);  // 1 from the prompt step + 4 decodes
  // A second cancel of the finished id is a user error, as is an unknown id.
  auto again = engine->cancel(id.value());
  CHECK(!again.ok() && again.error().kind == ErrorKind::kUser);
  CHECK(!engine->cancel(12345).ok());
  // A waiting request cancelled before it ran: n finishes, 0 tokens.
  auto waiting = std::make_shared<Collect>();
  auto wid = engine->submit({5, 6}, greedy(4, 3), waiting);
  CHECK(engine->cancel(wid.value()).ok());
  CHECK(engine->step().ok());
  CHECK_EQ(waiting->finish_calls, 3);
  CHECK(waiting->tokens.empty());
  CHECK(engine->idle());
}

TEST(engine_multi_turn_prefills_only_new_tokens) {
  SyntheticForward f(512, 60, 16, {});
  auto engine = std::move(Engine::create(f, {}).value());
  std::vector<int64_t> history = {1, 2, 3, 4, 5, 6};
  for (int turn = 0; turn < 8; ++turn) {
    auto sink = std::make_shared<Collect>();
    engine->reset_stats();
    CHECK(engine->submit(history, greedy(5), sink).ok());
    run_all(*engine);
    const auto& out = sink->tokens[0];
    CHECK(out == greedy_oracle(f, history, 5, {}));
    const int64_t cached = sink->finishes[0].usage.cached_tokens;
    if (turn == 0) {
      CHECK_EQ(cached, 0);
    } else {
      // The previous turn's sequence holds its prompt and all output but the
      // last token; the new turn prefills the rest.
      CHECK_EQ(cached, static_cast<int64_t>(history.size()) - 3);
      CHECK_EQ(engine->stats().prefill_tokens, 3);
    }
    history.insert(history.end(), out.begin(), out.end());
    history.push_back(7);  // the user's next message
    history.push_back(8);
  }
  CHECK(engine->cache().check_invariants().is_ok());
}

TEST(engine_stop_token_ids_and_eos) {
  SyntheticForward f(256, 30, 8, {});
  std::vector<int64_t> prompt = {2, 3};
  const auto free_run = greedy_oracle(f, prompt, 20, {});
  const int64_t stop = free_run[4];
  auto engine = std::move(Engine::create(f, {}).value());
  auto sink = std::make_shared<Collect>();
  SamplingParams p = greedy(20);
  p.stop_token_ids = {stop};
  CHECK(engine->submit(prompt, p, sink).ok());
  run_all(*engine);
  const auto want = greedy_oracle(f, prompt, 20, {stop});
  CHECK(sink->tokens[0] == want);
  CHECK(sink->tokens[0].back() == stop);
  CHECK(sink->finishes[0].reason == FinishReason::kStop);
  // The program's EOS ids stop only with stop_on_eos.
  SyntheticForward g(256, 30, 8, {stop});
  auto e2 = std::move(Engine::create(g, {}).value());
  auto a = std::make_shared<Collect>();
  auto b = std::make_shared<Collect>();
  SamplingParams keep_going = greedy(20);
  keep_going.stop_on_eos = false;
  CHECK(e2->submit(prompt, greedy(20), a).ok());
  CHECK(e2->submit(prompt, keep_going, b).ok());
  run_all(*e2);
  CHECK(a->tokens[0] == want);
  CHECK(b->tokens[0] == free_run);
}

TEST(engine_logprobs_are_log_softmax) {
  SyntheticForward f(128, 25, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto sink = std::make_shared<Collect>();
  SamplingParams p = greedy(3);
  p.logprobs = 4;
  std::vector<int64_t> prompt = {5, 6, 7};
  CHECK(engine->submit(prompt, p, sink).ok());
  run_all(*engine);
  CHECK_EQ(sink->full.size(), 3u);
  int64_t token = prompt.back();
  int64_t pos = 2;
  for (size_t i = 0; i < sink->full.size(); ++i) {
    double total = 0;
    for (int64_t v = 0; v < 25; ++v) total += std::exp(static_cast<double>(SyntheticForward::hash_logit(token, pos, v)));
    const int64_t chosen = sink->tokens[0][i];
    const double want = SyntheticForward::hash_logit(token, pos, chosen) - std::log(total);
    CHECK(std::abs(sink->full[i].logprob - want) < 1e-6);
    CHECK_EQ(sink->full[i].top.size(), 4u);
    CHECK_EQ(sink->full[i].top[0].first, chosen);  // greedy picks the most likely
    for (size_t k = 1; k < 4; ++k) CHECK(sink->full[i].top[k].second <= sink->full[i].top[k - 1].second);
    token = chosen;
    ++pos;
  }
}

TEST(engine_forward_failure_ends_running_requests) {
  SyntheticForward f(128, 30, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto sink = std::make_shared<Collect>();
  CHECK(engine->submit({1, 2, 3}, greedy(10, 2), sink).ok());
  CHECK(engine->step().ok());
  CHECK(engine->step().ok());
  f.fail_next = true;
  auto stepped = engine->step();
  CHECK(!stepped.ok() && stepped.error().kind == ErrorKind::kRuntime);
  CHECK_EQ(sink->finish_calls, 2);
  CHECK(sink->finishes[1].reason == FinishReason::kError);
  CHECK_EQ(engine->cache().n_sequences(), 0);
  CHECK_EQ(engine->cache().free_cells(), 128);
  // The engine keeps serving.
  auto next = std::make_shared<Collect>();
  CHECK(engine->submit({4, 5}, greedy(3), next).ok());
  run_all(*engine);
  CHECK(next->tokens[0] == greedy_oracle(f, {4, 5}, 3, {}));
}

TEST(engine_refuses_bad_input_and_changes_nothing) {
  SyntheticForward f(64, 30, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto sink = std::make_shared<Collect>();
  auto user = [](const Outcome<RequestId>& o) { return !o.ok() && o.error().kind == ErrorKind::kUser; };
  CHECK(user(engine->submit({}, greedy(3), sink)));
  CHECK(user(engine->submit({1, 30}, greedy(3), sink)));
  CHECK(user(engine->submit({1, -1}, greedy(3), sink)));
  CHECK(user(engine->submit({1}, greedy(3, 0), sink)));
  CHECK(user(engine->submit({1}, greedy(0), sink)));
  CHECK(user(engine->submit({1}, greedy(40, 2), sink)));  // 1 + 2 * 39 > 64 cells
  CHECK(user(engine->submit({1}, greedy(3), nullptr)));
  SamplingParams bad = greedy(3);
  bad.temperature = -1;
  CHECK(user(engine->submit({1}, bad, sink)));
  bad = greedy(3);
  bad.top_p = 0;
  CHECK(user(engine->submit({1}, bad, sink)));
  bad = greedy(3);
  bad.stop_token_ids = {31};
  CHECK(user(engine->submit({1}, bad, sink)));
  bad = greedy(3);
  bad.logprobs = 21;
  CHECK(user(engine->submit({1}, bad, sink)));
  CHECK_EQ(engine->live_requests(), 0);
  auto stepped = engine->step();
  CHECK(stepped.ok() && !stepped.value());
  CHECK_EQ(sink->finish_calls, 0);
  CHECK_EQ(engine->cache().free_cells(), 64);
  EngineOptions bounded;
  bounded.prefix_cache_cells = 65;
  CHECK(!Engine::create(f, bounded).ok());
}

// A sink that misbehaves in the ways an app's callback can.
struct Hostile final : Sink {
  Engine* engine = nullptr;
  RequestId self = 0;
  bool step_inside = false, throw_on_second = false, cancel_self_on_finish = false;
  std::vector<int64_t> tokens;
  int32_t finishes = 0;
  bool nested_step_refused = false;
  bool self_cancel_refused = false;
  void on_token(const TokenEvent& e) override {
    tokens.push_back(e.token);
    if (step_inside) {
      auto nested = engine->step();
      nested_step_refused = !nested.ok() && nested.error().kind == ErrorKind::kUser;
    }
    if (throw_on_second && tokens.size() == 2) throw std::runtime_error("sink failed");
  }
  void on_finish(const FinishEvent&) override {
    ++finishes;
    if (cancel_self_on_finish) self_cancel_refused = !engine->cancel(self).ok();
  }
};

TEST(engine_refuses_a_step_from_inside_a_sink) {
  SyntheticForward f(128, 30, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto hostile = std::make_shared<Hostile>();
  hostile->engine = engine.get();
  hostile->step_inside = true;
  auto other = std::make_shared<Collect>();
  CHECK(engine->submit({1, 2, 3}, greedy(6), hostile).ok());
  CHECK(engine->submit({4, 5}, greedy(6), other).ok());
  run_all(*engine);
  CHECK(hostile->nested_step_refused);
  CHECK(hostile->tokens == greedy_oracle(f, {1, 2, 3}, 6, {}));
  CHECK(other->tokens[0] == greedy_oracle(f, {4, 5}, 6, {}));
}

TEST(engine_a_throwing_sink_leaves_the_engine_consistent_and_delivers_nothing_twice) {
  SyntheticForward f(128, 30, 8, {});
  EngineOptions no_prefix;
  no_prefix.prefix_cache = false;
  auto engine = std::move(Engine::create(f, no_prefix).value());
  auto hostile = std::make_shared<Hostile>();
  hostile->throw_on_second = true;
  CHECK(engine->submit({1, 2, 3}, greedy(4), hostile).ok());
  int threw = 0;
  for (int guard = 0; guard < 50; ++guard) {
    try {
      auto s = engine->step();
      if (!s.ok() || !s.value()) break;
    } catch (const std::runtime_error&) {
      ++threw;
    }
  }
  CHECK_EQ(threw, 1);
  CHECK(hostile->tokens == greedy_oracle(f, {1, 2, 3}, 4, {}));  // each token once
  CHECK_EQ(hostile->finishes, 1);
  CHECK_EQ(engine->live_requests(), 0);
  CHECK_EQ(engine->cache().free_cells(), 128);
}

TEST(engine_a_finished_request_cannot_be_cancelled_from_its_own_finish) {
  SyntheticForward f(128, 30, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto hostile = std::make_shared<Hostile>();
  hostile->engine = engine.get();
  hostile->cancel_self_on_finish = true;
  hostile->self = engine->submit({1, 2}, greedy(3), hostile).value();
  run_all(*engine);
  CHECK(hostile->self_cancel_refused);
  // A second cancel of a request whose cancel is queued is refused too.
  auto sink = std::make_shared<Collect>();
  auto id = engine->submit({1, 2}, greedy(3), sink).value();
  CHECK(engine->cancel(id).ok());
  CHECK(!engine->cancel(id).ok());
  run_all(*engine);
  CHECK_EQ(sink->finish_calls, 1);
}

TEST(engine_destroyed_with_requests_in_flight_frees_every_cell_and_finishes_them) {
  SyntheticForward f(256, 30, 8, {});
  auto running = std::make_shared<Collect>();
  auto waiting = std::make_shared<Collect>();
  auto queued = std::make_shared<Collect>();
  {
    auto engine = std::move(Engine::create(f, {}).value());
    auto done = std::make_shared<Collect>();
    CHECK(engine->submit({9, 9, 9}, greedy(2), done).ok());
    run_all(*engine);  // leaves a prefix-cache entry
    CHECK(engine->submit({1, 2, 3}, greedy(100, 2), running).ok());
    CHECK(engine->submit({4, 5, 6}, greedy(100, 2), waiting).ok());  // waits for cells
    CHECK(engine->step().ok());
    CHECK(engine->step().ok());
    CHECK(engine->submit({7}, greedy(3), queued).ok());  // never applied
    CHECK(f.cache().free_cells() < 256);
  }
  CHECK_EQ(f.cache().free_cells(), 256);
  CHECK_EQ(f.cache().n_sequences(), 0);
  CHECK_EQ(running->finish_calls, 2);
  CHECK_EQ(waiting->finish_calls, 2);
  CHECK_EQ(queued->finish_calls, 1);
  CHECK(running->finishes[1].reason == FinishReason::kCancelled);
  // A new engine on the same program serves normally.
  auto engine = std::move(Engine::create(f, {}).value());
  auto next = std::make_shared<Collect>();
  CHECK(engine->submit({1, 2, 3}, greedy(5), next).ok());
  run_all(*engine);
  CHECK(next->tokens[0] == greedy_oracle(f, {1, 2, 3}, 5, {}));
}

// A forward that returns fewer logits than its contract says.
struct ShortForward final : Forward {
  SyntheticForward inner{64, 30, 8, {}};
  cellcache::CellCache& cache() override { return inner.cache(); }
  int64_t vocab_size() const override { return inner.vocab_size(); }
  int32_t max_tokens_per_step() const override { return budget; }
  const std::vector<int64_t>& eos_ids() const override { return inner.eos_ids(); }
  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    auto out = inner.forward(b);
    if (!out.ok()) return out;
    return out.value().first(3);
  }
  int32_t budget = 8;
};

TEST(engine_refuses_a_forward_that_breaks_its_contract) {
  ShortForward f;
  auto engine = std::move(Engine::create(f, {}).value());
  auto sink = std::make_shared<Collect>();
  CHECK(engine->submit({1, 2}, greedy(3), sink).ok());
  auto stepped = engine->step();
  CHECK(!stepped.ok() && stepped.error().kind == ErrorKind::kRuntime);
  CHECK(sink->finishes[0].reason == FinishReason::kError);
  CHECK_EQ(f.cache().free_cells(), 64);
  f.budget = 0;
  auto refused = Engine::create(f, {});
  CHECK(!refused.ok() && refused.error().kind == ErrorKind::kUser);
}

}  // namespace
