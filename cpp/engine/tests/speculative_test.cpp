// Speculative decoding (speculative.h, sampling.h verify, the scheduler's
// proposal groups): the prompt-lookup rule on worked examples, the options'
// messages, verify's greedy rule and its sampled rule's distribution, the
// scheduler's plan layout, commit parse, rollback and draft_limit on a bare
// cache with a fixed proposer, and the engine with prompt lookup and a draft
// model: the same tokens as plain decoding (greedy, and seeded sampling with
// lookup), counters, opt-out, a failing draft, bad options.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "engine.h"
#include "speculative.h"
#include "engine_test_util.h"
#include "synthetic_forward.h"

namespace {

using namespace cellcache::runner;
using cellcache::CellCache;
using Tokens = std::vector<int64_t>;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A forward whose next token copies: the peak after token t is 10 + (t + 1)
// mod 6 (position-free: the tokens cycle through 10..15, so prompt lookup's
// proposals are accepted), except at positions p % `every` == every - 1, where it is
// (3 t + p) mod vocab (so some are rejected). Logits fall by 0.25 per step
// (mod vocab) after the peak: a spread for sampling. fail_at: the forward
// with this index (counted from 0) fails.
class CopyForward final : public testing::SyntheticForward {
 public:
  CopyForward(int32_t n_cells, int64_t vocab, int32_t max_tokens, std::vector<int64_t> eos,
              int64_t every = 5)
      : SyntheticForward(n_cells, vocab, max_tokens, std::move(eos),
                         [vocab, every](int64_t t, int64_t p, int64_t v) {
                           const int64_t top =
                               p % every == every - 1 ? (3 * t + p) % vocab : 10 + (t + 1) % 6;
                           return -0.25f * static_cast<float>((v - top + vocab) % vocab);
                         }) {
    record = false;
  }
};

using Collect = testing::SampleSink;

using testing::greedy;
using testing::run_all;

struct Job {
  Tokens prompt;
  SamplingParams params;
  bool speculate = true;
};

struct Outputs {
  std::vector<std::shared_ptr<Collect>> sinks;
  EngineStats stats;
};

// Every job submitted at once to a fresh engine over `target`.
Outputs run_jobs(Forward& target, const std::vector<Job>& jobs, EngineOptions options) {
  target.cache().clear();
  Outputs out;
  auto engine = Engine::create(target, options);
  CHECK(engine.ok());
  if (!engine.ok()) return out;
  for (const Job& j : jobs) {
    out.sinks.push_back(std::make_shared<Collect>());
    CHECK(engine.value()->submit(j.prompt, j.params, out.sinks.back(), {.speculate = j.speculate})
              .ok());
  }
  run_all(*engine.value());
  out.stats = engine.value()->stats();
  return out;
}

EngineOptions lookup_options(int32_t max_draft = 4) {
  EngineOptions o;
  o.speculative = SpeculativeOptions{};
  o.speculative->max_draft = max_draft;
  return o;
}

EngineOptions draft_options(Forward& draft, int32_t max_draft = 4) {
  EngineOptions o = lookup_options(max_draft);
  o.speculative->method = SpeculativeMethod::kDraft;
  o.draft = &draft;
  return o;
}

void check_same_tokens(const Outputs& a, const Outputs& b) {
  CHECK_EQ(a.sinks.size(), b.sinks.size());
  for (size_t i = 0; i < a.sinks.size() && i < b.sinks.size(); ++i) {
    CHECK(a.sinks[i]->tokens == b.sinks[i]->tokens);
    CHECK_EQ(a.sinks[i]->finishes.size(), b.sinks[i]->finishes.size());
    for (const auto& [j, f] : a.sinks[i]->finishes) {
      CHECK(b.sinks[i]->finishes.count(j) == 1);
      if (b.sinks[i]->finishes.count(j)) CHECK(f.reason == b.sinks[i]->finishes.at(j).reason);
    }
  }
}

std::vector<Job> copy_jobs() {
  std::vector<Job> jobs;
  jobs.push_back({{1, 8, 25, 1, 8}, greedy(24)});
  jobs.push_back({{3, 22, 3, 22, 3}, greedy(17, 2)});
  jobs.push_back({{5, 6}, greedy(9)});
  SamplingParams stop = greedy(30);
  stop.stop_token_ids = {12};
  jobs.push_back({{2, 15, 2, 15}, stop});
  return jobs;
}

// ---------------------------------------------------------------- lookup

TEST(lookup_takes_the_earliest_match_of_the_longest_ngram) {
  const Tokens ctx = {5, 6, 7, 5, 6};
  CHECK(lookup(ctx, 4, 2, 3) == (Tokens{7, 5, 6}));
  CHECK(lookup(ctx, 1, 2, 3) == (Tokens{7}));
  // "1 2" occurs at 0 and 3; the earliest wins. With m = 3 "9 1 2" matches at 2 first.
  const Tokens two = {1, 2, 9, 1, 2, 4, 9, 1, 2};
  CHECK(lookup(two, 3, 2, 3) == (Tokens{4, 9, 1}));
  CHECK(lookup(two, 3, 2, 2) == (Tokens{9, 1, 2}));
  // The continuation is cut at the context's end.
  CHECK(lookup(Tokens{4, 4, 4}, 5, 1, 3) == (Tokens{4}));
  CHECK(lookup(Tokens{4, 4, 4}, 5, 2, 2) == (Tokens{4}));
  CHECK(lookup(Tokens{1, 2, 3}, 4, 1, 3).empty());  // no earlier occurrence
  CHECK(lookup(Tokens{7}, 4, 1, 3).empty());        // < 2 tokens
  CHECK(lookup(ctx, 0, 2, 3).empty());               // limit 0
  CHECK(lookup(Tokens{3, 3}, 2, 2, 3).empty());      // m = 2 cannot end before the tail
  CHECK(lookup(Tokens{3, 3}, 2, 1, 3) == (Tokens{3}));
}

// ---------------------------------------------------------------- options

TEST(speculative_options_name_the_value_at_fault) {
  SpeculativeOptions o;
  o.max_draft = 1;
  CHECK(o.validate(2, false).ok());
  o.max_draft = kDefaultMaxDraft;
  auto msg = [](const SpeculativeOptions& x, int32_t budget, bool draft) {
    auto v = x.validate(budget, draft);
    CHECK(!v.ok());
    return v.ok() ? std::string() : v.error().message;
  };
  CHECK(contains(msg(o, 1, false), "max_tokens_per_step holds a decode token and a proposal "
                                   "(>= 2); this one's is 1"));
  o.max_draft = 0;
  CHECK(contains(msg(o, 16, false), "max_draft (--draft-max, tokens proposed per step) must be "
                                    "an integer in [1, 15] (the program's max_tokens_per_step 16 "
                                    "minus the decode token), got 0"));
  o.max_draft = 16;
  CHECK(contains(msg(o, 16, false), "got 16"));
  o.max_draft = 15;
  CHECK(o.validate(16, false).ok());
  o.max_draft.reset();  // auto (draft_length.h)
  CHECK(o.validate(16, false).ok());
  o.min_ngram = 0;
  CHECK(contains(msg(o, 16, false), "min_ngram must be an integer >= 1, got 0"));
  o.min_ngram = 4;
  CHECK(contains(msg(o, 16, false), "min_ngram (4) must not exceed max_ngram (3)"));
  o.min_ngram = 2;
  CHECK(contains(msg(o, 16, true), "a draft model is used by speculative method 'draft', not "
                                   "'lookup'"));
  o.method = SpeculativeMethod::kDraft;
  CHECK(contains(msg(o, 16, false), "needs a draft model (--draft-model D.pte)"));
  CHECK(o.validate(16, true).ok());
  auto bad = speculative_method("ngram");
  CHECK(!bad.ok() && contains(bad.error().message,
                              "speculative method must be one of lookup, draft, got 'ngram'"));
  CHECK(speculative_method("draft").ok() &&
        speculative_method("draft").value() == SpeculativeMethod::kDraft);
}

TEST(engine_refuses_bad_speculative_options_before_any_request) {
  CopyForward one(64, 32, 1, {});
  auto e1 = Engine::create(one, lookup_options(1));
  CHECK(!e1.ok() && e1.error().kind == ErrorKind::kUser &&
        contains(e1.error().message, "this one's is 1"));
  CopyForward target(64, 32, 8, {});
  auto e2 = Engine::create(target, lookup_options(8));
  CHECK(!e2.ok() && contains(e2.error().message, "[1, 7]") &&
        contains(e2.error().message, "got 8"));
  CopyForward other_vocab(64, 33, 8, {});
  auto e3 = Engine::create(target, draft_options(other_vocab));
  CHECK(!e3.ok() && contains(e3.error().message, "the draft model has a vocabulary of 33 "
                                                 "tokens, the target 32"));
  CopyForward other_tokenizer(64, 32, 8, {});
  other_tokenizer.tokenizer = "{\"model\": 1}";
  auto e4 = Engine::create(target, draft_options(other_tokenizer));
  CHECK(!e4.ok() && contains(e4.error().message, "embeds another tokenizer than the target"));
  auto e5 = Engine::create(target, draft_options(target));
  CHECK(!e5.ok() && contains(e5.error().message, "shares the target's cache"));
  EngineOptions draft_only;
  draft_only.draft = &other_tokenizer;
  auto e6 = Engine::create(target, draft_only);
  CHECK(!e6.ok() && contains(e6.error().message, "speculative decoding is off"));
  EngineOptions no_draft = lookup_options(4);
  no_draft.speculative->method = SpeculativeMethod::kDraft;
  auto e7 = Engine::create(target, no_draft);
  CHECK(!e7.ok() && contains(e7.error().message, "needs a draft model"));
}

// ---------------------------------------------------------------- verify

// Rows of logits [rows * vocab] with row i peaking at peaks[i].
std::vector<float> peaked(const Tokens& peaks, int64_t vocab) {
  std::vector<float> out(peaks.size() * static_cast<size_t>(vocab), 0.0f);
  for (size_t i = 0; i < peaks.size(); ++i) out[i * vocab + static_cast<size_t>(peaks[i])] = 5.0f;
  return out;
}

TEST(verify_greedy_keeps_the_proposals_while_the_argmax_agrees) {
  const SamplingParams p = greedy(8);
  std::mt19937_64 rng;
  std::vector<double> scratch;
  auto run = [&](const Tokens& peaks, const Tokens& draft) {
    Tokens out;
    const auto logits = peaked(peaks, 10);
    verify(logits, draft, {}, p, rng, scratch, out);
    return out;
  };
  CHECK(run({4, 5, 6, 7}, {4, 5, 6}) == (Tokens{4, 5, 6, 7}));  // all accepted + the target's
  CHECK(run({4, 5, 6, 7}, {4, 9, 6}) == (Tokens{4, 5}));        // d[1] rejected: the target's 5
  CHECK(run({4, 5, 6, 7}, {3, 5, 6}) == (Tokens{4}));           // the first rejected
  CHECK(run({2}, {}) == (Tokens{2}));                           // no proposal: one token
}

TEST(verify_with_a_deterministic_draft_draws_as_plain_sampling_does) {
  // Sampling with prompt-lookup proposals: row i's token is choose_token's
  // with the same generator, so the tokens equal plain decoding's draws.
  SamplingParams p = greedy(8);
  p.temperature = 1.0;
  p.seed = 3;
  std::vector<float> logits(4 * 6);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>((i * 7) % 5) * 0.3f;
  std::vector<double> scratch;
  std::mt19937_64 plain = sample_generator(p, 0);
  Tokens want;
  for (size_t r = 0; r < 4; ++r) {
    want.push_back(choose_token(std::span<const float>(logits).subspan(r * 6, 6), p, plain,
                                scratch));
  }
  // A draft equal to the plain draws is accepted whole; one that differs at 1 stops there.
  std::mt19937_64 rng = sample_generator(p, 0);
  Tokens out;
  verify(logits, Tokens(want.begin(), want.begin() + 3), {}, p, rng, scratch, out);
  CHECK(out == want);
  Tokens other = {want[0], (want[1] + 1) % 6, want[2]};
  rng = sample_generator(p, 0);
  out.clear();
  verify(logits, other, {}, p, rng, scratch, out);
  CHECK(out == (Tokens{want[0], want[1]}));
}

TEST(verify_sampled_drafts_follow_the_target_distribution) {
  // One proposal drawn from q; the emitted first token must follow p
  // (Leviathan et al.): a chi-square test over 40000 draws (4 tokens, 3
  // degrees of freedom: 16.27 is the 0.1% point), and a q far from p.
  SamplingParams params = greedy(4);
  params.temperature = 1.0;
  const int64_t vocab = 4;
  const std::vector<float> target = {1.0f, 0.2f, -0.5f, 0.7f, 0.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> draft_logits = {-1.0f, 1.5f, 0.3f, -2.0f};
  std::vector<double> p, q, scratch;
  token_distribution(std::span<const float>(target).subspan(0, 4), params, p);
  token_distribution(draft_logits, params, q);
  double sum = 0;
  for (double v : p) sum += v;
  CHECK(std::abs(sum - 1.0) < 1e-12);
  std::mt19937_64 draft_rng(11), rng(12);
  std::vector<int64_t> counts(vocab, 0);
  const int trials = 40000;
  int accepted = 0;
  for (int t = 0; t < trials; ++t) {
    const int64_t d = choose_token(draft_logits, params, draft_rng, scratch);
    Tokens out;
    verify(target, Tokens{d}, q, params, rng, scratch, out);
    CHECK(!out.empty() && out.size() <= 2);
    if (out.size() == 2) ++accepted;
    ++counts[out[0]];
  }
  double chi2 = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const double expected = p[v] * trials;
    chi2 += (counts[v] - expected) * (counts[v] - expected) / expected;
  }
  CHECK(chi2 < 16.27);
  // The acceptance rate is sum min(p, q).
  double overlap = 0;
  for (int64_t v = 0; v < vocab; ++v) overlap += std::min(p[v], q[v]);
  CHECK(std::abs(static_cast<double>(accepted) / trials - overlap) < 0.02);
}

TEST(token_distribution_is_what_choose_token_draws_from) {
  SamplingParams params = greedy(4);
  params.temperature = 0.8;
  params.top_k = 3;
  params.top_p = 0.9;
  const std::vector<float> logits = {0.1f, 2.0f, 1.5f, -0.3f, 1.9f, 0.0f};
  std::vector<double> p, scratch;
  token_distribution(logits, params, p);
  CHECK(p[0] == 0.0 && p[3] == 0.0 && p[5] == 0.0);  // outside top-k
  std::mt19937_64 rng(5);
  std::vector<int64_t> counts(logits.size(), 0);
  const int trials = 30000;
  for (int t = 0; t < trials; ++t) ++counts[choose_token(logits, params, rng, scratch)];
  for (size_t v = 0; v < logits.size(); ++v) {
    CHECK(std::abs(static_cast<double>(counts[v]) / trials - p[v]) < 0.015);
  }
  params.temperature = 0.0;
  token_distribution(logits, params, p);
  CHECK(p[1] == 1.0 && p[4] == 0.0);
}

// ---------------------------------------------------------------- scheduler

class FixedProposer final : public Proposer {
 public:
  Tokens next;       // proposed to every ask (the scheduler cuts it to the limit)
  Tokens limits;     // the limits asked, in order
  int32_t released = 0;
  int32_t max_draft() const override { return 4; }
  void propose(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) override {
    out.resize(asks.size());
    for (size_t i = 0; i < asks.size(); ++i) {
      out[i].tokens = next;
      out[i].probs.clear();
      limits.push_back(asks[i].limit);
    }
  }
  void release(const Sample&) override { ++released; }
  void close() override {}
  const std::string& failure() const override { return failure_; }

 private:
  std::string failure_;
};

// Declares and serves `plan` on the one-layer cache (what a forward does).
void place(CellCache& cache, const StepPlan& plan) {
  auto declared = cache.declare_step(plan.batch.seq_ids);
  CHECK(declared.is_ok() && declared.value());
  CHECK(cache.serve_layer(plan.batch.positions, 0).is_ok());
}

TEST(scheduler_places_proposals_after_the_decode_token_and_rolls_back_rejections) {
  auto cache = std::move(CellCache::create({64, 1, {std::nullopt}}).value());
  FixedProposer proposer;
  proposer.next = {5, 6, 7};
  Scheduler sched(*cache, 8, {}, nullptr, &proposer);
  auto submitted = sched.submit(1, {1, 2, 3}, greedy(10));
  CHECK(submitted.ok());
  Request& req = *submitted.value();
  StepPlan plan;
  CHECK(sched.plan(plan).ok());  // the prompt: no proposals
  CHECK_EQ(plan.n_proposed, 0);
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{9}).ok());
  Sample& s = req.samples[0];

  CHECK(sched.plan(plan).ok());
  CHECK(plan.batch.tokens == (Tokens{9, 5, 6, 7}));
  CHECK(plan.batch.positions == (Tokens{3, 4, 5, 6}));
  CHECK(plan.batch.logits_for == (Tokens{0, 1, 2, 3}));
  CHECK_EQ(plan.consumers.size(), 1u);
  CHECK_EQ(plan.consumers[0].draft_len, 3);
  CHECK_EQ(plan.consumers[0].width(), 4);
  CHECK(proposer.limits == (Tokens{4}));  // min(max_draft 4, 10 - 1 - 1, 8 - 1)
  place(*cache, plan);
  // A pick list that does not parse into the groups changes nothing.
  auto bad = sched.commit(plan, Tokens{5, 6, 7, 4, 1});
  CHECK(!bad.ok() && contains(bad.error().message, "commit needs 4 picks for the step's 1 "
                                                   "logits groups, got 5"));
  CHECK(s.tokens == (Tokens{9}));
  // 5 accepted, 6 rejected (the target chose 8): positions 5, 6 are removed.
  CHECK(sched.commit(plan, Tokens{5, 8}).ok());
  CHECK(s.tokens == (Tokens{9, 5, 8}));
  CHECK_EQ(cache->next_pos(s.seq).value(), 5);
  CHECK_EQ(s.draft_limit, 3);
  CHECK_EQ(sched.speculation().proposed, 3);
  CHECK_EQ(sched.speculation().accepted, 1);
  CHECK_EQ(sched.decode_emitted(), 2);

  CHECK(sched.plan(plan).ok());
  CHECK(plan.batch.positions == (Tokens{5, 6, 7, 8}));
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{5, 6, 7, 4}).ok());  // all accepted + the target's 4
  CHECK(s.tokens == (Tokens{9, 5, 8, 5, 6, 7, 4}));
  CHECK_EQ(cache->next_pos(s.seq).value(), 9);
  CHECK_EQ(s.draft_limit, 4);  // +2, at most max_draft
  CHECK_EQ(s.accepted_tokens, 4);

  // 3 tokens left: at most 2 proposals (max_new_tokens - tokens - 1).
  CHECK(sched.plan(plan).ok());
  CHECK_EQ(plan.consumers[0].draft_len, 2);
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{5, 6, 1}).ok());
  CHECK(s.tokens.size() == 10u && s.finish == FinishReason::kLength);
  CHECK(sched.idle());
  CHECK_EQ(proposer.released, 1);
  CHECK(cache->check_invariants().is_ok());
}

TEST(a_stop_inside_an_accepted_run_caches_only_the_tokens_up_to_it) {
  auto cache = std::move(CellCache::create({64, 1, {std::nullopt}}).value());
  auto prefix = std::move(PrefixCache::create(*cache, std::nullopt).value());
  FixedProposer proposer;
  proposer.next = {5, 6, 7};
  Scheduler sched(*cache, 8, {}, prefix.get(), &proposer);
  SamplingParams p = greedy(10);
  p.stop_token_ids = {6};
  Request& req = *sched.submit(1, {1, 2, 3}, p).value();
  StepPlan plan;
  CHECK(sched.plan(plan).ok());
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{9}).ok());
  CHECK(sched.plan(plan).ok());
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{5, 6, 7, 4}).ok());  // every proposal accepted; 6 stops it
  const Sample& s = req.samples[0];
  CHECK(s.tokens == (Tokens{9, 5, 6}));
  CHECK(s.finish == FinishReason::kStop);
  CHECK_EQ(sched.decode_emitted(), 2);  // 5 and the stop 6; 9 came from the prompt's row
  CHECK_EQ(prefix->size(), 1);
  const auto entry = prefix->tokens(prefix->seqs()[0]);
  CHECK(entry.has_value() && *entry == (Tokens{1, 2, 3, 9, 5, 6}));
  CHECK_EQ(cache->next_pos(prefix->seqs()[0]).value(), 6);
  CHECK(cache->check_invariants().is_ok());
  auto events = sched.events();
  CHECK_EQ(events.size(), 3u);
  CHECK(events.back().stop_token && events.back().token == 6);
}

TEST(proposals_get_only_what_decode_tokens_and_prompt_chunks_leave) {
  auto cache = std::move(CellCache::create({64, 1, {std::nullopt}}).value());
  FixedProposer proposer;
  proposer.next = {5, 6, 7};
  Scheduler sched(*cache, 4, {}, nullptr, &proposer);
  Request& a = *sched.submit(1, {1, 2}, greedy(10)).value();
  StepPlan plan;
  CHECK(sched.plan(plan).ok());
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{9}).ok());
  CHECK(sched.submit(2, {3, 3, 3}, greedy(2)).ok());  // a prompt of 3 takes the rest
  CHECK(sched.plan(plan).ok());
  CHECK_EQ(plan.n_proposed, 0);
  CHECK_EQ(plan.n_prefill, 3);
  CHECK(plan.batch.tokens == (Tokens{9, 3, 3, 3}));
  CHECK(proposer.limits.empty());
  place(*cache, plan);
  CHECK(sched.commit(plan, Tokens{4, 8}).ok());
  CHECK(a.samples[0].tokens == (Tokens{9, 4}));
  // Two decode tokens now: 2 left for proposals, all to the first in decode order.
  CHECK(sched.plan(plan).ok());
  CHECK_EQ(plan.n_decode, 2);
  CHECK(proposer.limits == (Tokens{2}));
  CHECK_EQ(plan.n_proposed, 2);
  CHECK_EQ(plan.consumers[0].draft_len + plan.consumers[1].draft_len, 2);
  place(*cache, plan);
}

// ---------------------------------------------------------------- the engine

TEST(prompt_lookup_gives_plain_decodings_greedy_tokens) {
  CopyForward f(512, 32, 16, {0}, 9);
  const auto jobs = copy_jobs();
  const Outputs plain = run_jobs(f, jobs, {});
  for (int32_t k : {1, 3, 8, 15}) {
    const Outputs spec = run_jobs(f, jobs, lookup_options(k));
    check_same_tokens(plain, spec);
    CHECK(spec.stats.proposed_tokens > 0);
    CHECK(spec.stats.accepted_tokens > 0);
    CHECK(spec.stats.accepted_tokens < spec.stats.proposed_tokens);
    CHECK(spec.stats.tokens_per_forward() > 1.0);
    CHECK(spec.stats.steps < plain.stats.steps);  // 15-19 steps instead of 24
    CHECK_EQ(spec.stats.decode_tokens, plain.stats.decode_tokens);
    CHECK(spec.stats.speculation_failure.empty());
    int64_t proposed = 0, accepted = 0;
    for (const auto& sink : spec.sinks) {
      for (const auto& [j, fin] : sink->finishes) {
        proposed += fin.usage.proposed_tokens;
        accepted += fin.usage.accepted_tokens;
        CHECK_EQ(fin.usage.completion_tokens, static_cast<int64_t>(sink->tokens[j].size()));
      }
    }
    CHECK_EQ(proposed, spec.stats.proposed_tokens);
    CHECK_EQ(accepted, spec.stats.accepted_tokens);
  }
  CHECK_EQ(plain.stats.proposed_tokens, 0);
  CHECK(plain.stats.tokens_per_forward() == 1.0);
  CHECK_EQ(plain.stats.decode_groups, plain.stats.decode_tokens);
}

TEST(prompt_lookup_gives_plain_samplings_seeded_tokens_and_logprobs) {
  CopyForward f(512, 32, 8, {});
  std::vector<Job> jobs = copy_jobs();
  for (Job& j : jobs) {
    j.params.temperature = 0.3;  // mostly the peak: proposals are often accepted
    j.params.seed = 17;
    j.params.logprobs = 2;
  }
  const Outputs plain = run_jobs(f, jobs, {});
  const Outputs spec = run_jobs(f, jobs, lookup_options(4));
  check_same_tokens(plain, spec);
  CHECK(spec.stats.accepted_tokens > 0);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto& a = plain.sinks[i]->logprobs;
    const auto& b = spec.sinks[i]->logprobs;
    CHECK_EQ(a.size(), static_cast<size_t>(jobs[i].params.n));
    for (const auto& [j, lps] : a) {
      CHECK(b.count(j) == 1 && b.at(j).size() == lps.size());
      for (size_t t = 0; b.count(j) && t < lps.size() && t < b.at(j).size(); ++t) {
        CHECK(std::abs(lps[t] - b.at(j)[t]) < 1e-9);
      }
    }
  }
}

TEST(a_request_can_opt_out_of_speculation) {
  CopyForward f(512, 32, 8, {});
  std::vector<Job> jobs = copy_jobs();
  for (Job& j : jobs) j.speculate = false;
  const Outputs spec = run_jobs(f, jobs, lookup_options(4));
  CHECK_EQ(spec.stats.proposed_tokens, 0);
  check_same_tokens(run_jobs(f, jobs, {}), spec);
}

TEST(a_draft_model_gives_plain_decodings_greedy_tokens) {
  CopyForward target(512, 32, 8, {0});
  const auto jobs = copy_jobs();
  const Outputs plain = run_jobs(target, jobs, {});
  {
    // The same model as its own draft: every proposal is accepted.
    CopyForward same(512, 32, 3, {0});
    const Outputs spec = run_jobs(target, jobs, draft_options(same, 4));
    check_same_tokens(plain, spec);
    CHECK(spec.stats.proposed_tokens > 0);
    CHECK_EQ(spec.stats.accepted_tokens, spec.stats.proposed_tokens);
    CHECK_EQ(same.cache().n_sequences(), 0);  // the engine closed its proposer
  }
  {
    // Another model (another rhythm of position-bound tokens): some rejected.
    CopyForward other(64, 32, 2, {0}, 3);
    const Outputs spec = run_jobs(target, jobs, draft_options(other, 5));
    check_same_tokens(plain, spec);
    CHECK(spec.stats.accepted_tokens > 0);
    CHECK(spec.stats.accepted_tokens < spec.stats.proposed_tokens);
    CHECK(spec.stats.speculation_failure.empty());
  }
}

TEST(a_sampled_draft_keeps_the_run_valid_and_its_cache_clean) {
  CopyForward target(512, 32, 8, {});
  CopyForward draft(512, 32, 4, {}, 3);
  std::vector<Job> jobs = copy_jobs();
  for (Job& j : jobs) {
    j.params.temperature = 0.7;
    j.params.seed = 5;
  }
  target.cache().clear();
  auto engine = std::move(Engine::create(target, draft_options(draft, 3)).value());
  std::vector<std::shared_ptr<Collect>> sinks;
  for (const Job& j : jobs) {
    sinks.push_back(std::make_shared<Collect>());
    CHECK(engine->submit(j.prompt, j.params, sinks.back()).ok());
  }
  run_all(*engine);
  CHECK(engine->stats().proposed_tokens > 0);
  CHECK(engine->stats().accepted_tokens > 0);
  for (size_t i = 0; i < jobs.size(); ++i) {
    for (const auto& [j, toks] : sinks[i]->tokens) {
      const bool stopped = sinks[i]->finishes.at(j).reason == FinishReason::kStop;
      CHECK(stopped ? toks.back() == 12
                    : static_cast<int32_t>(toks.size()) == jobs[i].params.max_new_tokens);
    }
  }
  CHECK_EQ(draft.cache().n_sequences(), 0);  // every mirror released with its sample
  CHECK(draft.cache().check_invariants().is_ok());
  engine.reset();
  CHECK_EQ(target.cache().free_cells(), target.cache().capacity());
}

TEST(a_failing_draft_stops_speculation_not_the_run) {
  CopyForward target(512, 32, 8, {0});
  CopyForward draft(512, 32, 4, {0});
  draft.fail_at = 3;
  const auto jobs = copy_jobs();
  const Outputs plain = run_jobs(target, jobs, {});
  const Outputs spec = run_jobs(target, jobs, draft_options(draft, 4));
  check_same_tokens(plain, spec);
  CHECK(contains(spec.stats.speculation_failure, "synthetic failure"));
  const int64_t forwards = draft.forwards;
  CHECK_EQ(forwards, 4);  // none after the failure
  CHECK_EQ(draft.cache().n_sequences(), 0);
}

TEST(a_draft_cache_too_small_proposes_nothing_and_the_run_goes_on) {
  CopyForward target(512, 32, 8, {0});
  CopyForward tiny(4, 32, 4, {0});
  const auto jobs = copy_jobs();
  const Outputs spec = run_jobs(target, jobs, draft_options(tiny, 4));
  check_same_tokens(run_jobs(target, jobs, {}), spec);
  CHECK(spec.stats.speculation_failure.empty());
}

}  // namespace
