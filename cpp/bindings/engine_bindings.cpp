// _core.Engine: the C++ engine (cpp/runner/engine.h) over a Python forward,
// so tests drive it beside the Python scheduler on the same synthetic model
// and compare every step (tests/test_engine_differential.py). Not a serving
// path: the forward is a Python callable.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding_util.h"
#include "draft_length.h"
#include "engine.h"

namespace cellcache::bindings {

namespace {

using runner::Engine;
using runner::EngineOptions;
using runner::FinishEvent;
using runner::Forward;
using runner::Outcome;
using runner::SamplingParams;
using runner::SpeculativeOptions;
using runner::StepBatch;
using runner::TokenEvent;

[[noreturn]] void raise_run_error(const runner::RunError& e) {
  if (e.kind == runner::ErrorKind::kUser) {
    py::object errors = py::module_::import("executorch_cellcache.cache.errors");
    PyErr_SetString(errors.attr("InvalidConfigError").ptr(), e.message.c_str());
    throw py::error_already_set();
  }
  throw std::runtime_error(e.message);
}

template <typename T>
T unwrap_run(Outcome<T> o) {
  if (!o.ok()) raise_run_error(o.error());
  return std::move(o.value());
}

// forward(seq_ids, tokens, positions, logits_for) -> float32 [n_out, vocab];
// the callable declares and serves the step on the cache itself.
class PyForward final : public Forward {
 public:
  PyForward(CellCache& cache, py::object fn, int64_t vocab, int32_t max_tokens,
            std::vector<int64_t> eos)
      : cache_(cache), fn_(std::move(fn)), vocab_(vocab), max_tokens_(max_tokens),
        eos_(std::move(eos)) {}
  CellCache& cache() override { return cache_; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t max_tokens_per_step() const override { return max_tokens_; }
  const std::vector<int64_t>& eos_ids() const override { return eos_; }
  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    try {
      py::array_t<float, py::array::c_style | py::array::forcecast> out =
          fn_(b.seq_ids, b.tokens, b.positions, b.logits_for);
      const size_t want = b.logits_for.size() * static_cast<size_t>(vocab_);
      if (static_cast<size_t>(out.size()) != want) {
        return runner::runtime_error("forward returned " + std::to_string(out.size()) +
                                     " logits, expected " + std::to_string(want));
      }
      logits_.assign(out.data(), out.data() + want);
    } catch (py::error_already_set& e) {
      return runner::runtime_error(std::string("forward failed: ") + e.what());
    }
    return std::span<const float>(logits_);
  }

 private:
  CellCache& cache_;
  py::object fn_;
  int64_t vocab_;
  int32_t max_tokens_;
  std::vector<int64_t> eos_;
  std::vector<float> logits_;
};

class PySink final : public runner::Sink {
 public:
  PySink(py::object on_token, py::object on_finish)
      : on_token_(std::move(on_token)), on_finish_(std::move(on_finish)) {}
  void on_token(const TokenEvent& e) override {
    py::object lp = py::none(), top = py::none();
    if (e.logprobs != nullptr) {
      lp = py::float_(e.logprobs->logprob);
      top = py::cast(e.logprobs->top);
    }
    on_token_(e.request, e.sample, e.token, lp, top, e.stop_token);
  }
  void on_finish(const FinishEvent& e) override {
    on_finish_(e.request, e.sample, runner::finish_reason_name(e.reason), e.usage.prompt_tokens,
               e.usage.cached_tokens, e.usage.completion_tokens);
  }

 private:
  py::object on_token_, on_finish_;
};

// Token ids as the engine takes them (read as Int: no bool or float passes).
std::vector<int64_t> token_ids(const std::vector<Int>& ids) { return {ids.begin(), ids.end()}; }

// A draft model for speculative decoding: its own cache and forward.
struct PyDraft {
  py::object cache_obj;
  std::unique_ptr<PyForward> forward;
};

// Owns the forwards and the engine; keeps the Python cache objects alive.
class PyEngine {
 public:
  PyEngine(py::object cache_obj, CellCache& cache, py::object forward, int64_t vocab,
           int32_t max_tokens, std::vector<int64_t> eos, bool prefix_cache,
           std::optional<int32_t> prefix_cache_cells,
           std::optional<SpeculativeOptions> speculative, std::optional<PyDraft> draft)
      : cache_obj_(std::move(cache_obj)),
        forward_(std::make_unique<PyForward>(cache, std::move(forward), vocab, max_tokens,
                                             std::move(eos))) {
    EngineOptions options;
    options.prefix_cache = prefix_cache;
    options.prefix_cache_cells = prefix_cache_cells;
    options.speculative = speculative;
    if (draft) {
      draft_ = std::move(*draft);
      options.draft = draft_.forward.get();
    }
    engine_ = unwrap_run(Engine::create(*forward_, options));
  }
  Engine& engine() { return *engine_; }

 private:
  py::object cache_obj_;
  std::unique_ptr<PyForward> forward_;
  PyDraft draft_;
  std::unique_ptr<Engine> engine_;  // last: destroyed before the forwards it steps
};

}  // namespace

void bind_engine(py::module_& m, CellCache& (*core_of)(py::handle)) {
  static CellCache& (*to_core)(py::handle) = core_of;
  py::class_<PyEngine>(m, "Engine",
                       "The C++ engine (cpp/runner/engine.h) over a Python forward(seq_ids, "
                       "tokens, positions, logits_for) -> float32 [n_out, vocab] that declares "
                       "and serves each step on `cache` itself (tests).")
      .def(py::init([](py::object cache, py::object forward, Int vocab_size,
                       Int32 max_tokens_per_step, const std::vector<Int>& eos_ids,
                       Bool prefix_cache, std::optional<Int32> prefix_cache_cells,
                       std::optional<std::string> speculative,
                       std::optional<Int32> max_draft,
                       Int32 min_ngram, Int32 max_ngram, py::object draft_cache,
                       py::object draft_forward, std::optional<Int> draft_vocab_size,
                       std::optional<Int32> draft_max_tokens_per_step) {
             CellCache& core = to_core(cache);
             std::optional<SpeculativeOptions> spec;
             if (speculative) {
               spec.emplace();
               spec->method = unwrap_run(runner::speculative_method(*speculative));
               spec->max_draft = max_draft;
               spec->min_ngram = min_ngram;
               spec->max_ngram = max_ngram;
             }
             std::optional<PyDraft> draft;
             if (!draft_forward.is_none()) {
               if (draft_cache.is_none()) {
                 raise_run_error(runner::user_error("a draft_forward needs its draft_cache"));
               }
               CellCache& draft_core = to_core(draft_cache);
               draft.emplace();
               draft->cache_obj = draft_cache;
               draft->forward = std::make_unique<PyForward>(
                   draft_core, std::move(draft_forward), draft_vocab_size.value_or(vocab_size),
                   draft_max_tokens_per_step.value_or(max_tokens_per_step),
                   std::vector<int64_t>{});
             }
             return std::make_unique<PyEngine>(cache, core, std::move(forward), vocab_size,
                                               max_tokens_per_step, token_ids(eos_ids),
                                               prefix_cache, prefix_cache_cells, spec,
                                               std::move(draft));
           }),
           py::arg("cache"), py::arg("forward"), py::arg("vocab_size"),
           py::arg("max_tokens_per_step"), py::arg("eos_ids"), py::arg("prefix_cache") = true,
           py::arg("prefix_cache_cells") = py::none(), py::arg("speculative") = py::none(),
           py::arg("max_draft") = runner::kDefaultMaxDraft,
           py::arg("min_ngram") = runner::kDefaultMinNgram,
           py::arg("max_ngram") = runner::kDefaultMaxNgram, py::arg("draft_cache") = py::none(),
           py::arg("draft_forward") = py::none(), py::arg("draft_vocab_size") = py::none(),
           py::arg("draft_max_tokens_per_step") = py::none(),
           "speculative: None, \"lookup\" or \"draft\" (cpp/runner/speculative.h); a draft "
           "is draft_forward (the forward's signature) over draft_cache, its own cache.")
      .def(
          "submit",
          [](PyEngine& self, const std::vector<Int>& prompt, py::object on_token,
             py::object on_finish, Real temperature, std::optional<Int32> top_k,
             std::optional<Real> top_p, std::optional<UInt64> seed, Int32 n,
             Int32 max_new_tokens, const std::vector<Int>& stop_token_ids, Bool stop_on_eos,
             std::optional<Int32> logprobs, Bool speculate) {
            SamplingParams p;
            p.temperature = temperature;
            p.top_k = top_k;
            if (top_p) p.top_p = top_p->value;
            p.seed = seed;
            p.n = n;
            p.max_new_tokens = max_new_tokens;
            p.stop_token_ids = token_ids(stop_token_ids);
            p.stop_on_eos = stop_on_eos;
            p.logprobs = logprobs;
            return unwrap_run(self.engine().submit(
                token_ids(prompt), std::move(p),
                std::make_shared<PySink>(std::move(on_token), std::move(on_finish)),
                "the prompt", speculate));
          },
          py::arg("prompt"), py::arg("on_token"), py::arg("on_finish"),
          py::arg("temperature") = 0.0, py::arg("top_k") = py::none(),
          py::arg("top_p") = py::none(), py::arg("seed") = py::none(), py::arg("n") = 1,
          py::arg("max_new_tokens") = 16, py::arg("stop_token_ids") = std::vector<int64_t>{},
          py::arg("stop_on_eos") = true, py::arg("logprobs") = py::none(),
          py::arg("speculate") = true,
          "Queues a request; its id. on_token(id, sample, token, logprob, top, stop_token), "
          "on_finish(id, sample, reason, prompt_tokens, cached_tokens, completion_tokens).")
      .def("cancel", [](PyEngine& self, Int id) { unwrap_run(self.engine().cancel(id)); },
           py::arg("id"), "Cancels request `id` (submit's return value).")
      .def("step", [](PyEngine& self) { return unwrap_run(self.engine().step()); },
           "Applies queued work and runs one forward; False when idle.")
      .def_property_readonly("idle", [](PyEngine& self) { return self.engine().idle(); })
      .def_property_readonly("live_requests",
                             [](PyEngine& self) { return self.engine().live_requests(); })
      .def("last_plan",
           [](PyEngine& self) {
             const StepBatch& b = self.engine().last_plan().batch;
             return py::make_tuple(b.seq_ids, b.tokens, b.positions, b.logits_for);
           },
           "(seq_ids, tokens, positions, logits_for) of the step just run.")
      .def("stats",
           [](PyEngine& self) {
             const auto& s = self.engine().stats();
             py::dict d;
             d["prefill_tokens"] = s.prefill_tokens;
             d["decode_tokens"] = s.decode_tokens;
             d["decode_step_tokens"] = s.decode_step_tokens;
             d["decode_groups"] = s.decode_groups;
             d["proposed_tokens"] = s.proposed_tokens;
             d["accepted_tokens"] = s.accepted_tokens;
             d["max_draft"] = s.max_draft;
             d["speculation_failure"] = s.speculation_failure;
             d["steps"] = s.steps;
             d["peak_cells"] = s.peak_cells;
             return d;
           })
      .def("prefix_cache_stats",
           [](PyEngine& self) -> py::object {
             auto* pc = self.engine().prefix_cache();
             if (pc == nullptr) return py::none();
             const auto& s = pc->stats();
             py::dict d;
             d["requests"] = s.requests;
             d["hits"] = s.hits;
             d["prompt_tokens"] = s.prompt_tokens;
             d["cached_tokens"] = s.cached_tokens;
             d["evictions"] = s.evictions;
             d["entries"] = pc->size();
             d["reclaimable_cells"] = pc->reclaimable_cells();
             d["seqs"] = pc->seqs();
             return d;
           })
      .def("clear_prefix_cache", [](PyEngine& self) { self.engine().clear_prefix_cache(); });
  m.def(
      "choose_max_draft",
      [](const std::vector<Real>& step_seconds, Real proposal_seconds, Real acceptance) {
        return unwrap_run(runner::choose_max_draft(
            std::vector<double>(step_seconds.begin(), step_seconds.end()), proposal_seconds,
            acceptance));
      },
      py::arg("step_seconds"), py::arg("proposal_seconds") = 0.0,
      py::arg("acceptance") = runner::kAutoDraftAcceptance,
      "Speculative decoding's k when max_draft is auto (cpp/runner/draft_length.h): "
      "step_seconds[n - 1] = seconds of a step carrying n tokens of one sequence; "
      "InvalidConfigError naming a bad value.");
  m.attr("AUTO_DRAFT_ACCEPTANCE") = runner::kAutoDraftAcceptance;
  m.attr("MAX_AUTO_DRAFT_TOKENS") = runner::kMaxAutoDraftTokens;
  m.attr("STEP_COST_ROUNDS") = runner::kStepCostRounds;
  m.attr("STEP_COST_CONTEXT") = runner::kStepCostContext;
}

}  // namespace cellcache::bindings
