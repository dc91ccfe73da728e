// The engine over a pooled cache (issue #25 phase 2): one pool per window
// policy, the windowed pool reclaiming. A synthetic forward whose logits
// depend on what each layer attends (tests/pooled_forward.h) against its
// greedy oracle from each sequence's whole history: many windows past W with
// reclaimed cells reused, chunked prefill of a prompt ~10x the window,
// admission per pool, the prefix cache's window rule, speculation's rollback.
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "check.h"
#include "draft_length.h"
#include "engine.h"
#include "engine_test_util.h"
#include "pooled_forward.h"

namespace {

using namespace cellcache::runner;
using cellcache::runner::testing::greedy;
using cellcache::runner::testing::PooledForward;
using cellcache::runner::testing::run_all;

struct Collect final : Sink {
  std::map<int32_t, std::vector<int64_t>> tokens;
  std::map<int32_t, FinishEvent> finishes;
  void on_token(const TokenEvent& e) override { tokens[e.sample].push_back(e.token); }
  void on_finish(const FinishEvent& e) override { finishes[e.sample] = e; }
};

constexpr int32_t kWindow = 4;
constexpr int32_t kMargin = 2;
constexpr int32_t kStep = 8;
// What one sequence can hold in the window pool (cellcache/admission.h):
// W + max(R, T - 1) + T.
constexpr int32_t kPerSequence = kWindow + std::max(kMargin, kStep - 1) + kStep;

std::vector<int64_t> prompt_of(int32_t i, int32_t len) {
  std::vector<int64_t> p;
  for (int32_t j = 0; j < len; ++j) p.push_back((i * 7 + j * 3) % 40 + 1);
  return p;
}

// Runs prompts (greedy, max_new each) and checks every sample's tokens
// against the oracle; returns the sinks.
std::vector<std::shared_ptr<Collect>> run_and_check(PooledForward& f, Engine& e,
                                                    const std::vector<std::vector<int64_t>>& prompts,
                                                    int32_t max_new, int32_t n = 1) {
  std::vector<std::shared_ptr<Collect>> sinks;
  for (const auto& p : prompts) {
    sinks.push_back(std::make_shared<Collect>());
    CHECK(e.submit(p, greedy(max_new, n), sinks.back()).ok());
  }
  run_all(e);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto want = f.oracle(prompts[i], max_new);
    for (int32_t j = 0; j < n; ++j) CHECK(sinks[i]->tokens[j] == want);
  }
  CHECK(e.cache().check_invariants().is_ok());
  return sinks;
}

TEST(pooled_engine_decodes_many_windows_past_w_reusing_reclaimed_cells) {
  // 8 sequences of 10 + 60 positions = 560 positions through a window pool of
  // 8 x kPerSequence = 152 cells: only reclaimed cells can hold them.
  const int32_t window_cells = 8 * kPerSequence;
  PooledForward f(true, kWindow, 1024, window_cells, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  std::vector<std::vector<int64_t>> prompts;
  for (int32_t i = 0; i < 8; ++i) prompts.push_back(prompt_of(i, 10));
  run_and_check(f, *engine, prompts, 60);
  CHECK(f.tokens_run > 8 * 60);
  CHECK_EQ(f.peak_used(0) >= 8 * 60, true);          // the full pool keeps every position
  CHECK(f.peak_used(1) <= window_cells);              // the window pool never overflowed
  // The stats' per-pool peaks are what the forward saw after each step.
  CHECK(engine->stats().pool_summary() ==
        " (full-attention pool: " + std::to_string(f.peak_used(0)) + " of 1024, window-4 " +
            "pool: " + std::to_string(f.peak_used(1)) + " of " + std::to_string(window_cells) +
            ")");
  // All 8 ran together (the window pool admits 8 x kPerSequence).
  CHECK(std::any_of(f.batches.begin(), f.batches.end(), [](const StepBatch& b) {
    return std::set<cellcache::seq_t>(b.seq_ids.begin(), b.seq_ids.end()).size() == 8;
  }));
}

TEST(pooled_engine_with_the_windowed_pool_first_matches_the_oracle) {
  // Gemma3's layout: layer 0 slides, so pool 0 (capacity(), free_cells(), the
  // stats' pool) is the windowed one.
  PooledForward f(true, kWindow, 1024, 3 * kPerSequence, kMargin, 64, kStep, true);
  auto engine = std::move(Engine::create(f, {}).value());
  std::vector<std::vector<int64_t>> prompts;
  for (int32_t i = 0; i < 6; ++i) prompts.push_back(prompt_of(i + 20, 5 + i));
  run_and_check(f, *engine, prompts, 45);
}

TEST(pooled_engine_all_sliding_with_forks_matches_the_oracle) {
  // One windowed layer (Mistral-like): pool 0 reclaims; n = 3 forks share the
  // prompt's windowed cells and diverge... greedy, so they agree, each in its
  // own cells past the fork.
  PooledForward f(false, kWindow, 1, 6 * kPerSequence, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  run_and_check(f, *engine, {prompt_of(1, 12), prompt_of(2, 5)}, 40, 3);
}

TEST(pooled_engine_prefills_a_prompt_ten_windows_long_in_chunks) {
  PooledForward f(true, kWindow, 512, 2 * kPerSequence, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  run_and_check(f, *engine, {prompt_of(3, 10 * kWindow + 3), prompt_of(4, 7)}, 12);
  // The long prompt took several chunks of at most kStep tokens.
  CHECK(f.batches.size() >= (10 * kWindow + 3) / kStep);
}

TEST(pooled_engine_admits_per_pool) {
  // The window pool holds 2 sequences' worst case; the full pool plenty.
  PooledForward f(true, kWindow, 2048, 2 * kPerSequence, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  std::vector<std::vector<int64_t>> prompts;
  for (int32_t i = 0; i < 5; ++i) prompts.push_back(prompt_of(i, 6));
  run_and_check(f, *engine, prompts, 20);
  // The first step: 2 requests (2 x kPerSequence fill the window pool), where
  // one pool of 2048 cells would have admitted all 5; later steps may carry
  // a third once the running ones near their end (their worst case shrinks).
  const StepBatch& first = f.batches.front();
  CHECK_EQ(std::set<cellcache::seq_t>(first.seq_ids.begin(), first.seq_ids.end()).size(),
           size_t{2});

  // Never fits the window pool: 3 samples x kPerSequence > its cells. Named, nothing queued.
  auto sink = std::make_shared<Collect>();
  auto refused = engine->submit(prompt_of(0, 6), greedy(50, 3), sink);
  CHECK(!refused.ok());
  if (!refused.ok()) {
    CHECK(refused.error().message.find("cells of the window-4 pool") != std::string::npos);
    CHECK(refused.error().message.find("but it has " + std::to_string(2 * kPerSequence)) !=
          std::string::npos);
  }
  // Never fits the full pool (2048 cells): the full pool's message.
  auto too_long = engine->submit(prompt_of(0, 6), greedy(5000, 1), sink);
  CHECK(!too_long.ok());
  if (!too_long.ok()) {
    CHECK(too_long.error().message.find("but the cache has 2048") != std::string::npos);
  }
  CHECK(engine->idle());
  CHECK_EQ(engine->live_requests(), int64_t{0});
}

TEST(pooled_prefix_cache_serves_only_prefixes_every_pool_still_holds) {
  PooledForward f(true, kWindow, 1024, 4 * kPerSequence, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  const std::vector<int64_t> history = prompt_of(5, 30);
  auto first = run_and_check(f, *engine, {history}, 10);
  CHECK_EQ(engine->prefix_cache()->size(), 1);
  // The conversation's next turn: history + its reply + new tokens; the whole
  // cached entry (39 positions: the last reply token was never fed) serves:
  // its window is held.
  std::vector<int64_t> turn = history;
  turn.insert(turn.end(), first[0]->tokens[0].begin(), first[0]->tokens[0].end());
  std::vector<int64_t> next_turn = turn;
  next_turn.insert(next_turn.end(), {3, 9, 27});
  auto second = run_and_check(f, *engine, {next_turn}, 8);
  CHECK_EQ(second[0]->finishes[0].usage.cached_tokens, int64_t{39});  // 30 + 10 - 1 fed
  // The new entry (50 positions) extends the old one but no longer holds
  // what the old one's shortest servable prefix needs (36: its window pool's
  // horizon 33 + W - 1): it does not cover it, so both stay.
  CHECK_EQ(engine->prefix_cache()->size(), 2);
  // A prompt sharing only the first 20 tokens: the window pool reclaimed the
  // entry's cells around position 20, so no entry serves (a miss, not an
  // error), and the entries stay.
  const int32_t entries = engine->prefix_cache()->size();
  std::vector<int64_t> branch(history.begin(), history.begin() + 20);
  branch.insert(branch.end(), {50, 51, 52});
  auto third = run_and_check(f, *engine, {branch}, 8);
  CHECK_EQ(third[0]->finishes[0].usage.cached_tokens, int64_t{0});
  CHECK(engine->prefix_cache()->size() >= entries);
  // The cache's own rule, asked directly: the entry of next_turn's sequence
  // does not hold a 20-token prefix in the window pool, and does hold its end.
  bool found = false;
  for (cellcache::seq_t s : engine->prefix_cache()->seqs()) {
    const auto toks = engine->prefix_cache()->tokens(s).value();
    if (toks.size() < 40) continue;
    found = true;
    CHECK(!engine->cache().holds_prefix(s, 20).value());
    CHECK(engine->cache().holds_prefix(s, static_cast<cellcache::pos_t>(toks.size())).value());
  }
  CHECK(found);
}

TEST(pooled_prefix_cache_serves_an_older_entry_that_still_holds_the_prefix) {
  PooledForward f(true, kWindow, 1024, 4 * kPerSequence, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  const std::vector<int64_t> base = prompt_of(6, 12);
  // Older entry: base + 2 generated (it holds a prefix of 12: its window is near 12).
  run_and_check(f, *engine, {base}, 2);
  const int64_t reply = f.oracle(base, 1)[0];
  // Newer entry sharing base, 40 positions past it: its window pool gave up
  // the cells near position 12.
  std::vector<int64_t> longer = base;
  longer.push_back(reply == 60 ? 61 : 60);
  run_and_check(f, *engine, {longer}, 40);
  CHECK_EQ(engine->prefix_cache()->size(), 2);
  // A prompt of base + other tokens: the longest match is 12 (both entries);
  // the most recent cannot serve it, the older one does.
  std::vector<int64_t> probe = base;
  probe.push_back(reply == 62 ? 63 : 62);
  probe.push_back(1);
  auto got = run_and_check(f, *engine, {probe}, 5);
  CHECK_EQ(got[0]->finishes[0].usage.cached_tokens, int64_t{12});
}

TEST(pooled_engine_admits_cold_a_request_its_cached_prefix_would_keep_waiting) {
  // A window pool of one sequence's worst case: the conversation's next turn
  // clones the cached entry, whose window cells then stay the entry's while
  // the clone needs a whole worst case besides; with nothing running the
  // engine used to fail ("no request can be admitted"). It now prefills cold.
  PooledForward f(true, kWindow, 1024, kPerSequence, kMargin, 64, kStep);
  auto engine = std::move(Engine::create(f, {}).value());
  const std::vector<int64_t> history = prompt_of(11, 10);
  auto first = run_and_check(f, *engine, {history}, 20);
  std::vector<int64_t> turn = history;
  turn.insert(turn.end(), first[0]->tokens[0].begin(), first[0]->tokens[0].end());
  turn.insert(turn.end(), {1, 2, 3});
  auto second = run_and_check(f, *engine, {turn}, 20);
  CHECK_EQ(second[0]->finishes[0].usage.cached_tokens, int64_t{0});
}

TEST(pooled_prefix_cache_bound_cuts_or_drops_an_entry) {
  // Bound 20 cells per pool: a 15-position entry fits whole; a 60-position
  // one holds 60 full-pool cells: it is cut to 20 positions only if the
  // window pool still holds them, which after 60 positions it does not:
  // not cached.
  PooledForward f(true, kWindow, 1024, 4 * kPerSequence, kMargin, 64, kStep);
  EngineOptions options;
  options.prefix_cache_cells = 20;
  auto engine = std::move(Engine::create(f, options).value());
  // The bound may reach the largest pool's cells (the full pool's 1024, where
  // pool 0 is the windowed one of 4 x kPerSequence), not beyond.
  PooledForward gemma_like(true, kWindow, 1024, 4 * kPerSequence, kMargin, 64, kStep, true);
  CHECK_EQ(gemma_like.cache().capacity(), 4 * kPerSequence);
  EngineOptions too_big;
  too_big.prefix_cache_cells = 1025;
  auto refused = Engine::create(gemma_like, too_big);
  CHECK(!refused.ok() && refused.error().message ==
                             "prefix_cache_cells must be an integer in [0, 1024] (the cache's "
                             "cells in its largest pool), got 1025; omit it for no bound");
  run_and_check(f, *engine, {prompt_of(7, 10)}, 5);
  CHECK_EQ(engine->prefix_cache()->size(), 1);
  run_and_check(f, *engine, {prompt_of(8, 10)}, 50);
  for (int32_t cells : engine->prefix_cache()->reclaimable_cells_per_pool()) CHECK(cells <= 20);
  for (cellcache::seq_t s : engine->prefix_cache()->seqs()) {
    CHECK(engine->prefix_cache()->tokens(s).value().size() <= 20);
  }
}

TEST(pooled_engine_speculates_with_prompt_lookup_rolling_back_within_the_step) {
  // A vocabulary of 8: the outputs repeat their bigrams, so lookup proposes.
  PooledForward f(true, kWindow, 1024, 4 * kPerSequence, kMargin, 8, kStep);
  EngineOptions options;
  options.speculative.emplace();
  options.speculative->max_draft = 5;  // > R + 1: the target's rollback is within its step
  auto engine = std::move(Engine::create(f, options).value());
  // Repetitive prompts, so lookup proposes.
  std::vector<int64_t> rep;
  for (int32_t i = 0; i < 24; ++i) rep.push_back(i % 3 + 1);
  run_and_check(f, *engine, {rep, {5, 6, 7, 1, 2}}, 40);
  CHECK(engine->stats().proposed_tokens > 0);
  CHECK(engine->stats().accepted_tokens < engine->stats().proposed_tokens);  // rolled back
}

TEST(pooled_step_costs_are_measured_through_a_window_pool_smaller_than_the_context) {
  // The measurement holds kStepCostContext + k positions of one sequence; a
  // window pool of one sequence's worst case holds them by reclaiming.
  PooledForward f(true, kWindow, 1024, kPerSequence, kMargin, 64, kStep);
  CHECK(kPerSequence < kStepCostContext + 4);
  auto seconds = measure_step_seconds(f, 4);
  CHECK(seconds.ok());
  if (seconds.ok()) CHECK_EQ(seconds.value().size(), size_t{4});
  CHECK_EQ(f.cache().n_sequences(), 0);
  CHECK_EQ(f.cache().pool_state(1).value().free_cells, kPerSequence);
  CHECK(f.cache().check_invariants().is_ok());
  // A window pool below one sequence's worst case: refused by name, nothing held.
  PooledForward small(true, kWindow, 1024, kPerSequence - 1, kMargin, 64, kStep);
  auto refused = measure_step_seconds(small, 4);
  CHECK(!refused.ok() && refused.error().message ==
                             "measuring step costs needs 19 free cells; the cache has 18 in pool 1");
  CHECK_EQ(small.cache().n_sequences(), 0);
}

TEST(pooled_draft_max_draft_is_bounded_by_its_retained_margin) {
  PooledForward target(true, kWindow, 1024, 4 * kPerSequence, kMargin, 64, kStep);
  PooledForward draft(true, kWindow, 1024, 4 * kPerSequence, kMargin, 64, kStep);
  draft.salt = 12345;
  EngineOptions options;
  options.speculative.emplace();
  options.speculative->method = SpeculativeMethod::kDraft;
  options.speculative->max_draft = kMargin + 3;
  options.draft = &draft;
  options.draft_name = "the draft model d.pte";
  auto refused = Engine::create(target, options);
  CHECK(!refused.ok());
  if (!refused.ok()) {
    CHECK(refused.error().message ==
          "max_draft 5 exceeds what the draft model d.pte's windowed pools keep for a "
          "rollback: at most 4 (retained_margin 2 + 2); lower max_draft (--draft-max) or "
          "export the draft with a larger retained_margin");
  }
  // At the bound: greedy output is plain decoding's, the draft's cache clean.
  options.speculative->max_draft = kMargin + 2;
  auto engine = std::move(Engine::create(target, options).value());
  std::vector<int64_t> rep;
  for (int32_t i = 0; i < 20; ++i) rep.push_back(i % 5 + 1);
  run_and_check(target, *engine, {rep, prompt_of(10, 9)}, 30, 2);
  CHECK(engine->stats().proposed_tokens > 0);
  // Rejected proposals: the draft's mirrors rolled back across their steps.
  CHECK(engine->stats().accepted_tokens < engine->stats().proposed_tokens);
  CHECK(engine->stats().speculation_failure.empty());
  CHECK(draft.cache().check_invariants().is_ok());
  // A draft always wrong: every first proposal is rejected, so each mirror
  // rolls back all max_draft - 1 fed proposals, one step each: R + 1
  // positions at the bound, which every windowed pool keeps (cell_pool.h).
  draft.salt_period = 1;
  engine.reset();
  engine = std::move(Engine::create(target, options).value());
  run_and_check(target, *engine, {rep}, 30);
  CHECK(engine->stats().proposed_tokens > 0);
  CHECK_EQ(engine->stats().accepted_tokens, int64_t{0});
  CHECK(engine->stats().speculation_failure.empty());
  CHECK(draft.cache().check_invariants().is_ok());
  // Auto max_draft is capped at the bound.
  options.speculative->max_draft = std::nullopt;
  engine.reset();
  auto capped = std::move(Engine::create(target, options).value());
  CHECK(capped->stats().max_draft <= kMargin + 2);
}

}  // namespace
