// max_draft "auto" (draft_length.h): the rule on cost curves whose answer is
// worked out by hand, and its errors; the measurement's
// contract (sizes, cache left as found, errors); and the engine choosing k
// from a forward whose steps cost a staircase.
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "check.h"
#include "draft_length.h"
#include "engine.h"
#include "synthetic_forward.h"

namespace {

using namespace cellcache::runner;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::string error_of(const Outcome<int32_t>& o) {
  CHECK(!o.ok());
  return o.ok() ? std::string() : o.error().message;
}

// Costs of n = 1 .. size tokens: `first` for n = 1, then stairs.
std::vector<double> stairs(size_t size, double first, std::vector<std::pair<int, double>> tops) {
  std::vector<double> c(size);
  for (size_t n = 1; n <= size; ++n) {
    c[n - 1] = first;
    if (n == 1) continue;
    for (auto [top, cost] : tops) {
      if (static_cast<int>(n) <= top) {
        c[n - 1] = cost;
        break;
      }
      c[n - 1] = cost;  // past the last top: the last stair's cost
    }
  }
  return c;
}

TEST(auto_max_draft_reaches_for_the_top_of_the_stair_that_pays_best) {
  // 1 token 1.0; 2..7 tokens 1.2; 8..14 1.5; 15..32 2.6 (an f32 GEMM's 7-row tiles).
  // alpha 0.9: E(7) = (1 - 0.9^7) / 0.1 = 5.217 -> 4.35 a unit of time; E(14) = 7.712
  // -> 5.14; E(32) = 9.657 -> 3.71; inside a stair E grows at the same cost, so the
  // stair's top wins: n = 14, k = 13.
  auto c = stairs(32, 1.0, {{7, 1.2}, {14, 1.5}, {32, 2.6}});
  auto k = choose_max_draft(c);
  CHECK(k.ok());
  CHECK_EQ(k.value(), 13);
  // alpha 0.5: E(n) < 2 whatever n: E(7) = 1.984 -> 1.65 beats E(14) = 2.0 -> 1.33: k = 6.
  CHECK_EQ(choose_max_draft(c, 0.0, 0.5).value(), 6);
  // No stairs (every token costs the same again): E(n) / n falls from n = 1: k = 1.
  std::vector<double> line;
  for (int n = 1; n <= 16; ++n) line.push_back(n);
  CHECK_EQ(choose_max_draft(line).value(), 1);
  // A flat curve: E grows, so the longest step: k = N - 1.
  CHECK_EQ(choose_max_draft(std::vector<double>(16, 2.0)).value(), 15);
  // Two sizes only: k = 1.
  CHECK_EQ(choose_max_draft(std::vector<double>{1.0, 1.1}).value(), 1);
}

TEST(free_proposals_take_the_longest_step_within_the_tolerance_of_the_best) {
  // SmolLM2-135M 8da4w on a 2-core AVX2 VM (ms): alpha 0.9: rate(3) = 2.71 / 14.7
  // = 0.1844, rate(6) = 4.686 / 26.2 = 0.1789 (3.0% below), rate(9) = 6.126 / 39.4
  // = 0.1555 (15.7% below): lookup k = 5; a draft model's proposals (not free)
  // keep the best rate's n, here 3 (proposal 0.001 ms: rate(3) = 0.18438,
  // rate(6) = 0.17884).
  const std::vector<double> avx2{9.5, 13.8, 14.7, 23.2, 25.1, 26.2, 39.4, 39.5, 39.4, 46.7};
  CHECK_EQ(choose_max_draft(avx2).value(), 5);
  CHECK_EQ(choose_max_draft(avx2, 0.001).value(), 2);
  // Beyond the tolerance the best rate's n stays: rate(6) 5% below rate(3).
  std::vector<double> steeper = avx2;
  for (size_t n = 4; n <= 6; ++n) steeper[n - 1] = 26.2 * 1.021;
  CHECK_EQ(choose_max_draft(steeper).value(), 2);
}

TEST(a_draft_models_proposals_cost_their_own_steps) {
  // Flat target cost 1.0, each proposal 0.5 (a draft forward): alpha 0.9:
  // n=2: 1.9/1.5 = 1.267, n=3: 2.71/2.0 = 1.355, n=4: 3.439/2.5 = 1.376,
  // n=5: 4.095/3.0 = 1.365: k = 3.
  CHECK_EQ(choose_max_draft(std::vector<double>(16, 1.0), 0.5).value(), 3);
}

TEST(choose_max_draft_names_a_bad_value) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0})),
                 "steps of 1 and 2 tokens at least, got 1 step size(s)"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{})), "got 0 step size(s)"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0, -2.0})),
                 "step_seconds[1] must be a positive number, got -2"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{nan, 1.0})),
                 "step_seconds[0] must be a positive number"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0, 0.0})), "step_seconds[1]"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0, 2.0}, -1.0)),
                 "proposal_seconds must be a number >= 0, got -1"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0, 2.0}, nan)),
                 "proposal_seconds"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0, 2.0}, 0.0, 1.0)),
                 "acceptance must be in (0, 1), got 1"));
  CHECK(contains(error_of(choose_max_draft(std::vector<double>{1.0, 2.0}, 0.0, 0.0)),
                 "acceptance must be in (0, 1)"));
}

// A forward whose step of n tokens spins for micros(n) microseconds first.
class StairForward final : public testing::SyntheticForward {
 public:
  StairForward(int32_t n_cells, int32_t max_tokens, std::function<double(int32_t)> micros)
      : SyntheticForward(n_cells, 32, max_tokens, {}), micros_(std::move(micros)) {}
  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration<double, std::micro>(
                           micros_(static_cast<int32_t>(b.tokens.size())));
    while (std::chrono::steady_clock::now() < until) {
    }
    return SyntheticForward::forward(b);
  }

 private:
  std::function<double(int32_t)> micros_;
};

TEST(measure_step_seconds_times_each_size_and_leaves_the_cache_as_found) {
  StairForward f(256, 12, [](int32_t n) { return n <= 6 ? 200.0 : 600.0; });
  auto& cache = f.cache();
  auto held = cache.seq_new();
  CHECK(held.is_ok());
  const int32_t free_before = cache.free_cells();
  const int32_t seqs_before = cache.n_sequences();
  auto s = measure_step_seconds(f, 12, 3);
  CHECK(s.ok());
  if (!s.ok()) return;
  CHECK_EQ(s.value().size(), size_t{12});
  for (int32_t n = 1; n <= 12; ++n) {
    const double want = (n <= 6 ? 200e-6 : 600e-6);
    CHECK(s.value()[n - 1] >= want);  // a spin never ends early
  }
  CHECK_EQ(cache.free_cells(), free_before);
  CHECK_EQ(cache.n_sequences(), seqs_before);
  CHECK(cache.check_invariants().is_ok());
}

TEST(measure_step_seconds_names_a_bad_value_and_changes_nothing) {
  testing::SyntheticForward f(40, 32, 12, {});
  auto msg = [](Outcome<std::vector<double>> o) {
    CHECK(!o.ok());
    return o.ok() ? std::string() : o.error().message;
  };
  CHECK(contains(msg(measure_step_seconds(f, 0)),
                 "max_tokens must be in [1, 12] (the program's max_tokens_per_step), got 0"));
  CHECK(contains(msg(measure_step_seconds(f, 13)), "got 13"));
  CHECK(contains(msg(measure_step_seconds(f, 4, 0)), "rounds must be >= 1, got 0"));
  // 40 cells < 32 of context + 12.
  CHECK(contains(msg(measure_step_seconds(f, 12)), "needs 44 free cells; the cache has 40"));
  CHECK_EQ(f.cache().free_cells(), 40);
  CHECK_EQ(f.cache().n_sequences(), 0);
  CHECK_EQ(f.forwards, int64_t{0});
}

TEST(the_engine_chooses_k_from_what_its_forward_costs) {
  // Steps of 1 token 300 us, 2..6 tokens 400 us, 7..12 tokens 1200 us: E(6) / 400 beats
  // E(12) / 1200 by 1.6x, so auto stays on the cheap stair (k <= 5); timing noise can
  // only move it within that stair.
  StairForward f(512, 12, [](int32_t n) { return n == 1 ? 300.0 : n <= 6 ? 400.0 : 1200.0; });
  EngineOptions o;
  o.speculative = SpeculativeOptions{};
  auto engine = Engine::create(f, o);
  CHECK(engine.ok());
  if (!engine.ok()) return;
  const int32_t k = engine.value()->stats().max_draft;
  CHECK(k >= 3 && k <= 5);
  CHECK_EQ(f.cache().n_sequences(), 0);  // the measurement's sequence is gone
  CHECK_EQ(f.cache().free_cells(), 512);
  // A flat forward: the longest step (noise may cost a token or two).
  StairForward flat(512, 12, [](int32_t) { return 500.0; });
  auto e2 = Engine::create(flat, o);
  CHECK(e2.ok());
  if (e2.ok()) CHECK(e2.value()->stats().max_draft >= 9);
  // Given: used as given, nothing measured.
  StairForward given(512, 12, [](int32_t) { return 0.0; });
  o.speculative->max_draft = 4;
  auto e3 = Engine::create(given, o);
  CHECK(e3.ok());
  if (e3.ok()) CHECK_EQ(e3.value()->stats().max_draft, 4);
  CHECK_EQ(given.forwards, int64_t{0});
  // No room to measure (40 cells < 32 + 12): the default within the budget.
  StairForward small(40, 12, [](int32_t) { return 0.0; });
  o.speculative->max_draft.reset();
  auto e4 = Engine::create(small, o);
  CHECK(e4.ok());
  if (e4.ok()) CHECK_EQ(e4.value()->stats().max_draft, kDefaultMaxDraft);
}

}  // namespace
