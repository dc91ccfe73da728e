// The engine's hooks (engine.h StepHooks): masks choose a constrained
// request's tokens (and only its), ends_sample ends a watched sample on a
// token, also inside an accepted speculative run (usage then counts only the
// emitted proposals), and a hook that fails ends the step as a failed
// forward does. Oracles: the synthetic forward's formula, masked by hand.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "check.h"
#include "engine.h"
#include "engine_test_util.h"
#include "synthetic_forward.h"

namespace {

using namespace cellcache::runner;
using cellcache::runner::testing::greedy;
using cellcache::runner::testing::run_all;
using cellcache::runner::testing::SyntheticForward;
using Tokens = std::vector<int64_t>;

using Collect = testing::SampleSink;

// Allows only even tokens to constrained requests; ends a watched sample at
// its `end_at`-th token (0 = never); fails where asked.
struct EvenHooks final : StepHooks {
  int64_t vocab = 0;
  int32_t end_at = 0;
  bool fail_masks = false;
  bool fail_ends = false;
  int32_t mask_calls = 0;
  std::map<std::pair<RequestId, int32_t>, int32_t> seen;  // tokens each watched sample took
  std::set<RequestId> masked;                             // requests masks were asked for
  Outcome<> masks(std::span<const MaskRow> rows, std::span<uint8_t> allowed) override {
    ++mask_calls;
    if (fail_masks) return runtime_error("mask hook failed");
    for (size_t r = 0; r < rows.size(); ++r) {
      masked.insert(rows[r].request);
      for (int64_t t = 0; t < vocab; t += 2) allowed[r * static_cast<size_t>(vocab) + t] = 1;
    }
    return {};
  }
  Outcome<bool> ends_sample(RequestId request, int32_t sample, int64_t, bool) override {
    if (fail_ends) return runtime_error("ends_sample hook failed");
    const int32_t n = ++seen[{request, sample}];
    return end_at > 0 && n == end_at;
  }
};

// Greedy over the even tokens only (the oracle of a masked pick).
int64_t even_argmax(const SyntheticForward& f, int64_t token, int64_t pos, int64_t vocab) {
  int64_t best = 0;
  for (int64_t v = 2; v < vocab; v += 2) {
    if (SyntheticForward::hash_logit(token, pos, v) > SyntheticForward::hash_logit(token, pos, best)) {
      best = v;
    }
  }
  (void)f;
  return best;
}

TEST(a_constrained_request_takes_only_allowed_tokens_beside_a_plain_one) {
  const int64_t vocab = 50;
  SyntheticForward f(256, vocab, 16, {});
  EvenHooks hooks;
  hooks.vocab = vocab;
  EngineOptions options;
  options.hooks = &hooks;
  auto engine = std::move(Engine::create(f, options).value());
  auto constrained = std::make_shared<Collect>();
  auto plain = std::make_shared<Collect>();
  const Tokens prompt = {3, 4, 5};
  auto cid = engine->submit(prompt, greedy(12, 2), constrained, {.constrained = true});
  auto pid = engine->submit(prompt, greedy(12), plain);
  CHECK(cid.ok() && pid.ok());
  run_all(*engine);
  // The oracle: each next token the even argmax after the last, at its position.
  Tokens want;
  int64_t token = prompt.back();
  for (int64_t pos = 2; want.size() < 12; ++pos) want.push_back(token = even_argmax(f, token, pos, vocab));
  CHECK(constrained->tokens[0] == want);
  CHECK(constrained->tokens[1] == want);  // each sample masked, from the prompt's row on
  Tokens plain_want;
  token = prompt.back();
  for (int64_t pos = 2; plain_want.size() < 12; ++pos) plain_want.push_back(token = f.next_token(token, pos));
  CHECK(plain->tokens[0] == plain_want);
  CHECK(std::any_of(plain_want.begin(), plain_want.end(), [](int64_t t) { return t % 2; }));
  CHECK(hooks.masked == std::set<RequestId>{cid.value()});
  CHECK_EQ(hooks.mask_calls, 12);  // one call a step, for the constrained picks only
}

TEST(a_constrained_or_watched_request_needs_hooks) {
  SyntheticForward f(64, 20, 8, {});
  auto engine = std::move(Engine::create(f, {}).value());
  auto sink = std::make_shared<Collect>();
  auto c = engine->submit({1, 2}, greedy(3), sink, {.constrained = true});
  CHECK(!c.ok() && c.error().kind == ErrorKind::kUser);
  auto w = engine->submit({1, 2}, greedy(3), sink, {.watched = true});
  CHECK(!w.ok() && w.error().message.find("no hooks") != std::string::npos);
  CHECK(engine->idle());
}

// Position-free copying logits: after token t the peak is 10 + (t + 1) % 6
// (the cycle 10 15 14 13 12 11), so prompt lookup's proposals over a prompt
// that cycles so are all accepted.
float copy_logit(int64_t t, int64_t, int64_t v) {
  const int64_t top = 10 + (t + 1) % 6;
  return -0.25f * static_cast<float>((v - top + 30) % 30);
}

TEST(ends_sample_stops_inside_an_accepted_run_and_usage_counts_what_was_emitted) {
  SyntheticForward f(256, 30, 16, {}, copy_logit);
  EvenHooks hooks;
  hooks.vocab = 30;
  hooks.end_at = 6;
  EngineOptions options;
  options.hooks = &hooks;
  options.speculative = SpeculativeOptions{};
  options.speculative->max_draft = 6;
  auto engine = std::move(Engine::create(f, options).value());
  const Tokens prompt = {10, 15, 14, 13, 12, 11, 10, 15, 14, 13, 12, 11, 10, 15};
  auto watched = std::make_shared<Collect>();
  CHECK(engine->submit(prompt, greedy(20), watched, {.watched = true}).ok());
  run_all(*engine);
  const Tokens& got = watched->tokens[0];
  CHECK_EQ(got.size(), 6u);  // ended on its 6th token, inside a run of accepted proposals
  CHECK(got == (Tokens{14, 13, 12, 11, 10, 15}));
  const FinishEvent& fin = watched->finishes[0];
  CHECK(fin.reason == FinishReason::kStop);
  CHECK(watched->token_finishes[0].back() == FinishReason::kStop);
  CHECK_EQ(fin.usage.completion_tokens, 6);
  CHECK(fin.usage.proposed_tokens > fin.usage.accepted_tokens);  // the run went on past the end
  CHECK(fin.usage.accepted_tokens <= fin.usage.completion_tokens);
  CHECK(fin.usage.accepted_tokens >= 4);  // the first token came from the prompt's row
  // The prefix cache holds what was placed up to the end: the prompt and all six
  // tokens (the last was placed as a proposal), none of the run after it.
  auto* pc = engine->prefix_cache();
  CHECK_EQ(pc->size(), 1);
  const auto entry = pc->tokens(pc->seqs()[0]);
  Tokens held = prompt;
  held.insert(held.end(), got.begin(), got.end());
  CHECK(entry.has_value() && *entry == held);
}

TEST(accepted_tokens_never_exceed_completion_tokens_in_any_finish_path) {
  // Stop id inside a run, max_new_tokens inside a run, EOS, a cancel.
  SyntheticForward f(512, 30, 16, {13}, copy_logit);
  EngineOptions options;
  options.speculative = SpeculativeOptions{};
  options.speculative->max_draft = 6;
  auto engine = std::move(Engine::create(f, options).value());
  const Tokens prompt = {10, 15, 14, 13, 12, 11, 10, 15, 14, 13, 12, 11, 10, 15};
  SamplingParams stop_id = greedy(20);
  stop_id.stop_on_eos = false;
  stop_id.stop_token_ids = {10};
  SamplingParams length = greedy(5);
  length.stop_on_eos = false;
  SamplingParams eos = greedy(20);  // 13 is the EOS id
  std::vector<std::shared_ptr<Collect>> sinks;
  for (const SamplingParams& p : {stop_id, length, eos}) {
    sinks.push_back(std::make_shared<Collect>());
    CHECK(engine->submit(prompt, p, sinks.back()).ok());
  }
  run_all(*engine);
  sinks.push_back(std::make_shared<Collect>());
  SamplingParams long_run = greedy(40);
  long_run.stop_on_eos = false;
  auto id = engine->submit(prompt, long_run, sinks.back());
  CHECK(id.ok());
  for (int i = 0; i < 3; ++i) CHECK(engine->step().ok());
  CHECK(engine->cancel(id.value()).ok());
  run_all(*engine);
  const FinishReason want[] = {FinishReason::kStop, FinishReason::kLength, FinishReason::kStop,
                               FinishReason::kCancelled};
  int64_t accepted = 0;
  for (size_t i = 0; i < sinks.size(); ++i) {
    const FinishEvent& fin = sinks[i]->finishes[0];
    CHECK(fin.reason == want[i]);
    CHECK_EQ(fin.usage.completion_tokens, static_cast<int64_t>(sinks[i]->tokens[0].size()));
    CHECK(fin.usage.accepted_tokens <= fin.usage.completion_tokens);
    accepted += fin.usage.accepted_tokens;
  }
  CHECK(accepted > 0);
  CHECK_EQ(sinks[0]->tokens[0].back(), 10);
  CHECK_EQ(sinks[1]->tokens[0].size(), 5u);
  CHECK_EQ(sinks[2]->tokens[0].back(), 13);
}

TEST(a_hook_that_fails_ends_the_step_and_frees_its_requests) {
  for (bool in_masks : {true, false}) {
    SyntheticForward f(64, 20, 8, {});
    EvenHooks hooks;
    hooks.vocab = 20;
    EngineOptions options;
    options.hooks = &hooks;
    auto engine = std::move(Engine::create(f, options).value());
    auto sink = std::make_shared<Collect>();
    SubmitOptions submit;
    (in_masks ? submit.constrained : submit.watched) = true;
    CHECK(engine->submit({1, 2, 3}, greedy(5, 2), sink, submit).ok());
    CHECK(engine->step().ok());  // the prompt's step: its row is sampled after the forward
    (in_masks ? hooks.fail_masks : hooks.fail_ends) = true;
    auto failed = engine->step();
    CHECK(!failed.ok() && failed.error().kind == ErrorKind::kRuntime);
    CHECK(failed.error().message.find("hook failed") != std::string::npos);
    CHECK_EQ(sink->finishes.size(), 2u);
    CHECK(sink->finishes[0].reason == FinishReason::kError);
    CHECK(sink->finishes[1].reason == FinishReason::kError);
    CHECK_EQ(engine->cache().free_cells(), 64);  // freed, not cached
    CHECK(engine->idle());
  }
}

}  // namespace
