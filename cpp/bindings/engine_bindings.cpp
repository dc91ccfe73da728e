// _core.Engine: the C++ engine (cpp/engine/engine.h) over a Python forward:
// the one scheduler, prefix cache, speculative decoding and token choice
// that Runner.generate and the server step (runtime/runner.py). Python keeps
// the forward (the program's method) and what is Python by nature, through
// the engine's hooks: structured output's masks (llguidance) and stop
// strings (text).
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
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
using runner::RequestId;
using runner::RunError;

// A Python exception raised inside a callback the engine made (forward, hooks):
// kept while the engine unwinds the step through its runtime error, then
// raised again in place of that error, so the caller sees its own exception.
struct PendingError {
  std::unique_ptr<py::error_already_set> error;
  RunError keep(py::error_already_set& e, const std::string& what) {
    std::string message = what + ": " + e.what();
    error = std::make_unique<py::error_already_set>(std::move(e));
    return runner::runtime_error(std::move(message));
  }
};

[[noreturn]] void raise_pending(PendingError& pending, const runner::RunError& e) {
  if (pending.error) {
    std::unique_ptr<py::error_already_set> error = std::move(pending.error);
    error->restore();
    throw py::error_already_set();
  }
  raise_run_error(e);
}

// forward(seq_ids, tokens, positions, logits_for) -> float32 [n_out, vocab];
// the callable declares and serves the step on the cache itself.
class PyForward final : public Forward {
 public:
  PyForward(CellCache& cache, py::object fn, int64_t vocab, int32_t max_tokens,
            std::vector<int64_t> eos, std::string tokenizer, PendingError& pending)
      : cache_(cache), fn_(std::move(fn)), vocab_(vocab), max_tokens_(max_tokens),
        eos_(std::move(eos)), tokenizer_(std::move(tokenizer)), pending_(pending) {}
  ~PyForward() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
    logits_ = py::array_t<float>();
  }
  std::string_view tokenizer_json() const override { return tokenizer_; }
  CellCache& cache() override { return cache_; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t max_tokens_per_step() const override { return max_tokens_; }
  const std::vector<int64_t>& eos_ids() const override { return eos_; }
  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    py::gil_scoped_acquire gil;
    try {
      py::array_t<float, py::array::c_style | py::array::forcecast> out =
          fn_(b.seq_ids, b.tokens, b.positions, b.logits_for);
      const size_t want = b.logits_for.size() * static_cast<size_t>(vocab_);
      // [rows, vocab] exactly (a transposed [vocab, rows] has the same size).
      const bool shaped = out.ndim() == 2
                              ? out.shape(0) == static_cast<py::ssize_t>(b.logits_for.size()) &&
                                    out.shape(1) == vocab_
                              : out.ndim() == 1 && b.logits_for.size() == 1;
      if (static_cast<size_t>(out.size()) != want || !shaped) {
        return runner::runtime_error(
            "forward returned logits of " + std::to_string(out.size()) + " values in " +
            std::to_string(out.ndim()) + " dimensions, expected [" +
            std::to_string(b.logits_for.size()) + ", " + std::to_string(vocab_) + "]");
      }
      logits_ = out;  // held, not copied: the engine reads it before the next forward
    } catch (py::error_already_set& e) {
      return pending_.keep(e, "forward failed");
    }
    return std::span<const float>(logits_.data(), static_cast<size_t>(logits_.size()));
  }

 private:
  CellCache& cache_;
  py::object fn_;
  int64_t vocab_;
  int32_t max_tokens_;
  std::vector<int64_t> eos_;
  std::string tokenizer_;
  PendingError& pending_;
  py::array_t<float> logits_;  // the last forward's [rows, vocab], C-contiguous
};

py::object finish_name(runner::FinishReason reason) {
  if (reason == runner::FinishReason::kNone) return py::none();
  return py::str(runner::finish_reason_name(reason));
}

// on_token(id, sample, token, logprob, top, stop_token, finish_reason) and
// on_finish(id, sample, reason, usage); an exception leaves Engine.step as is.
class PySink final : public runner::Sink {
 public:
  PySink(py::object on_token, py::object on_finish)
      : on_token_(std::move(on_token)), on_finish_(std::move(on_finish)) {}
  ~PySink() override {
    py::gil_scoped_acquire gil;
    on_token_ = py::object();
    on_finish_ = py::object();
  }
  void on_token(const TokenEvent& e) override {
    py::gil_scoped_acquire gil;
    if (on_token_.is_none()) return;
    py::object lp = py::none(), top = py::none();
    if (e.logprobs != nullptr) {
      lp = py::float_(e.logprobs->logprob);
      top = py::cast(e.logprobs->top);
    }
    on_token_(e.request, e.sample, e.token, lp, top, e.stop_token, finish_name(e.finish));
  }
  void on_finish(const FinishEvent& e) override {
    py::gil_scoped_acquire gil;
    on_finish_(e.request, e.sample, runner::finish_reason_name(e.reason), e.usage);
  }

 private:
  py::object on_token_, on_finish_;
};

// hooks.masks(rows: int64 [n, 2] of (request, sample)) -> bool/uint8 [n, vocab];
// hooks.ends_sample(request, sample, token, stop_token) -> bool.
class PyHooks final : public runner::StepHooks {
 public:
  PyHooks(py::object hooks, int64_t vocab, PendingError& pending)
      : hooks_(std::move(hooks)), vocab_(vocab), pending_(pending) {}
  Outcome<> masks(std::span<const runner::MaskRow> rows, std::span<uint8_t> allowed) override {
    py::gil_scoped_acquire gil;
    try {
      py::array_t<int64_t> ids({static_cast<py::ssize_t>(rows.size()), py::ssize_t{2}});
      auto w = ids.mutable_unchecked<2>();
      for (size_t i = 0; i < rows.size(); ++i) {
        w(i, 0) = rows[i].request;
        w(i, 1) = rows[i].sample;
      }
      py::array out = hooks_.attr("masks")(ids);
      // bool: numpy reads any nonzero value as allowed (a uint8 cast made 0.5 "not allowed").
      auto got = py::array_t<bool, py::array::c_style | py::array::forcecast>::ensure(out);
      if (!got || got.ndim() != 2 || got.shape(0) != static_cast<py::ssize_t>(rows.size()) ||
          got.shape(1) != vocab_) {
        return runner::runtime_error("hooks.masks must return [" + std::to_string(rows.size()) +
                                     ", " + std::to_string(vocab_) + "] booleans");
      }
      const bool* data = got.data();
      for (size_t i = 0; i < allowed.size(); ++i) allowed[i] = data[i] ? 1 : 0;
    } catch (py::error_already_set& e) {
      return pending_.keep(e, "hooks.masks failed");
    }
    return {};
  }
  Outcome<bool> ends_sample(RequestId request, int32_t sample, int64_t token,
                            bool stop_token) override {
    py::gil_scoped_acquire gil;
    try {
      return py::cast<bool>(hooks_.attr("ends_sample")(request, sample, token, stop_token));
    } catch (py::error_already_set& e) {
      return pending_.keep(e, "hooks.ends_sample failed");
    } catch (py::cast_error&) {
      return runner::runtime_error("hooks.ends_sample must return a bool");
    }
  }

 private:
  py::object hooks_;
  int64_t vocab_;
  PendingError& pending_;
};

// Token ids as the engine takes them (read as Int: no bool or float passes).
std::vector<int64_t> token_ids(const std::vector<Int>& ids) { return {ids.begin(), ids.end()}; }

// Owns the forwards, the hooks and the engine; keeps the Python cache objects alive.
class PyEngine {
 public:
  PyEngine(py::object cache_obj, CellCache& cache, py::object forward, int64_t vocab,
           int32_t max_tokens, std::vector<int64_t> eos, std::string tokenizer,
           bool prefix_cache, std::optional<int32_t> prefix_cache_cells, py::object hooks)
      : cache_obj_(std::move(cache_obj)), vocab_(vocab) {
    if (!PyCallable_Check(forward.ptr())) {
      raise_run_error(runner::user_error("forward must be callable"));
    }
    forward_ = std::make_unique<PyForward>(cache, std::move(forward), vocab, max_tokens,
                                           std::move(eos), std::move(tokenizer), pending_);
    EngineOptions options;
    options.prefix_cache = prefix_cache;
    options.prefix_cache_cells = prefix_cache_cells;
    if (!hooks.is_none()) {
      for (const char* name : {"masks", "ends_sample"}) {
        if (!py::hasattr(hooks, name) || !PyCallable_Check(hooks.attr(name).ptr())) {
          raise_run_error(runner::user_error(std::string("hooks must have a callable ") + name +
                                             "() (engine.h StepHooks)"));
        }
      }
      hooks_ = std::make_unique<PyHooks>(std::move(hooks), vocab, pending_);
      options.hooks = hooks_.get();
    }
    engine_ = unwrap_run(Engine::create(*forward_, options));
  }
  ~PyEngine() {
    // The engine's destructor ends live requests through their sinks.
    py::gil_scoped_release release;
    engine_.reset();
  }
  Engine& engine() { return *engine_; }

  void set_speculative(std::optional<SpeculativeOptions> spec, py::object draft_cache,
                       py::object draft_forward, std::optional<Int> draft_vocab_size,
                       std::optional<Int32> draft_max_tokens_per_step,
                       const std::string& draft_tokenizer_json, const std::string& draft_name,
                       CellCache& (*to_core)(py::handle)) {
    std::unique_ptr<PyForward> draft;
    if (!draft_forward.is_none()) {
      if (draft_cache.is_none()) {
        raise_run_error(runner::user_error("a draft_forward needs its draft_cache"));
      }
      draft = std::make_unique<PyForward>(
          to_core(draft_cache), std::move(draft_forward),
          draft_vocab_size ? draft_vocab_size->value : vocab_,
          draft_max_tokens_per_step ? draft_max_tokens_per_step->value
                                    : forward_->max_tokens_per_step(),
          std::vector<int64_t>{}, draft_tokenizer_json, draft_pending_);
    }
    Outcome<> set;
    {
      py::gil_scoped_release release;  // auto max_draft measures steps through the forward
      set = engine_->set_speculative(spec, draft.get(), draft_name);
    }
    if (!set.ok()) raise_pending(draft_pending_.error ? draft_pending_ : pending_, set.error());
    // The old draft (if any) is no longer referenced by the engine.
    draft_ = std::move(draft);
    draft_cache_obj_ = draft_cache;
  }

  bool step() {
    // The GIL stays held: the step's own C++ work (planning, token choice,
    // commit) is short, and releasing it would hand every callback of the step
    // (the forward, the hooks, each token's sink) a wait for the GIL behind
    // the server's event loop (Python's switch interval, 5 ms each).
    Outcome<bool> stepped = engine_->step();
    // A draft's failure is the engine's to absorb (speculation stops; EngineStats
    // speculation_failure says why): its exception is not the step's, unless it
    // is no error at all (KeyboardInterrupt, SystemExit): that one is the caller's.
    if (draft_pending_.error && !draft_pending_.error->matches(PyExc_Exception)) {
      std::unique_ptr<py::error_already_set> error = std::move(draft_pending_.error);
      error->restore();
      throw py::error_already_set();
    }
    draft_pending_.error.reset();
    if (!stepped.ok()) raise_pending(pending_, stepped.error());
    return stepped.value();
  }

 private:
  py::object cache_obj_;
  int64_t vocab_;
  PendingError pending_;
  PendingError draft_pending_;
  std::unique_ptr<PyForward> forward_;
  std::unique_ptr<PyHooks> hooks_;
  py::object draft_cache_obj_;
  std::unique_ptr<PyForward> draft_;
  std::unique_ptr<Engine> engine_;  // last: destroyed before the forwards it steps
};

}  // namespace

void bind_engine(py::module_& m, CellCache& (*core_of)(py::handle)) {
  static CellCache& (*to_core)(py::handle) = core_of;

  bind_engine_types(m);

  py::class_<PyEngine>(m, "Engine",
                       "The C++ engine (cpp/engine/engine.h) over a Python forward(seq_ids, "
                       "tokens, positions, logits_for) -> float32 [n_out, vocab] that declares "
                       "and serves each step on `cache` itself.")
      .def(py::init([](py::object cache, py::object forward, Int vocab_size,
                       Int32 max_tokens_per_step, const std::vector<Int>& eos_ids,
                       const std::string& tokenizer_json, Bool prefix_cache,
                       std::optional<Int32> prefix_cache_cells, py::object hooks) {
             CellCache& core = to_core(cache);
             return std::make_unique<PyEngine>(
                 cache, core, std::move(forward), vocab_size, max_tokens_per_step,
                 token_ids(eos_ids), tokenizer_json, prefix_cache,
                 prefix_cache_cells ? std::optional<int32_t>(prefix_cache_cells->value)
                                    : std::nullopt,
                 std::move(hooks));
           }),
           py::arg("cache"), py::arg("forward"), py::arg("vocab_size"),
           py::arg("max_tokens_per_step"), py::arg("eos_ids"), py::kw_only(),
           py::arg("tokenizer_json") = "", py::arg("prefix_cache") = true, py::arg("prefix_cache_cells") = py::none(),
           py::arg("hooks") = py::none(),
           "hooks: None, or an object with masks(rows) and ends_sample(request, sample, "
           "token, stop_token) (engine.h StepHooks).")
      .def(
          "set_speculative",
          [](PyEngine& self, std::optional<SpeculativeOptions> options, py::object draft_cache,
             py::object draft_forward, std::optional<Int> draft_vocab_size,
             std::optional<Int32> draft_max_tokens_per_step,
             const std::string& draft_tokenizer_json, const std::string& draft_name) {
            self.set_speculative(options, std::move(draft_cache), std::move(draft_forward),
                                 draft_vocab_size, draft_max_tokens_per_step,
                                 draft_tokenizer_json, draft_name, to_core);
          },
          py::arg("options"), py::kw_only(), py::arg("draft_cache") = py::none(),
          py::arg("draft_forward") = py::none(), py::arg("draft_vocab_size") = py::none(),
          py::arg("draft_max_tokens_per_step") = py::none(),
          py::arg("draft_tokenizer_json") = "",
          py::arg("draft_name") = "the draft model",
          "Speculative decoding from now on (None = off), while no request is live; a draft "
          "is draft_forward (the forward's signature) over draft_cache, its own cache.")
      .def(
          "submit",
          [](PyEngine& self, const std::vector<Int>& prompt, const SamplingParams& params,
             py::object on_token, py::object on_finish, const std::string& label,
             Bool speculate, Bool constrained, Bool watched) {
            runner::SubmitOptions options;
            options.label = label;
            options.speculate = speculate;
            options.constrained = constrained;
            options.watched = watched;
            auto sink = std::make_shared<PySink>(std::move(on_token), std::move(on_finish));
            std::vector<int64_t> ids = token_ids(prompt);
            Outcome<runner::RequestId> id;
            {
              py::gil_scoped_release release;
              id = self.engine().submit(std::move(ids), params, std::move(sink),
                                        std::move(options));
            }
            return unwrap_run(std::move(id));
          },
          py::arg("prompt"), py::arg("params"), py::arg("on_token"), py::arg("on_finish"),
          py::kw_only(), py::arg("label") = "the prompt", py::arg("speculate") = true,
          py::arg("constrained") = false, py::arg("watched") = false,
          "Queues a request (any thread); its id. on_token(id, sample, token, logprob, top, "
          "stop_token, finish_reason) (on_token None: not called), on_finish(id, sample, "
          "reason, usage: Usage).")
      .def("cancel",
           [](PyEngine& self, Int id) {
             Outcome<> done;
             {
               py::gil_scoped_release release;
               done = self.engine().cancel(id);
             }
             unwrap_run(std::move(done));
           },
           py::arg("id"), "Cancels request `id` (submit's return value); any thread.")
      .def("step", &PyEngine::step,
           "Applies queued work and runs one forward; False when idle. An exception a "
           "callback raised is raised again here.")
      .def("abort", [](PyEngine& self) { unwrap_run(self.engine().abort()); },
           "Ends every queued, waiting and running request (cancelled) and frees their "
           "sequences without caching them.")
      .def_property_readonly("idle", [](PyEngine& self) { return self.engine().idle(); })
      .def_property_readonly("speculative",
                             [](PyEngine& self) { return self.engine().speculative(); })
      .def_property_readonly("live_requests",
                             [](PyEngine& self) { return self.engine().live_requests(); })
      .def_property_readonly("waiting_requests",
                             [](PyEngine& self) { return self.engine().waiting_requests(); })
      .def("last_plan",
           [](PyEngine& self) {
             const StepBatch& b = self.engine().last_plan().batch;
             return py::make_tuple(b.seq_ids, b.tokens, b.positions, b.logits_for);
           },
           "(seq_ids, tokens, positions, logits_for) of the step just run.")
      .def("last_plan_counts",
           [](PyEngine& self) {
             const auto& p = self.engine().last_plan();
             return py::make_tuple(p.n_prefill, p.n_decode, p.n_proposed);
           },
           "(prefill tokens, decode samples, proposed tokens) of the step just run.")
      .def("stats", [](PyEngine& self) { return self.engine().stats(); },
           "EngineStats since the engine was made or reset_stats().")
      .def("reset_stats", [](PyEngine& self) { self.engine().reset_stats(); })
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
             return d;
           },
           "The prefix cache's counters (None without one): cheap, read every step.")
      .def("prefix_cache_reclaimable_cells",
           [](PyEngine& self) {
             auto* pc = self.engine().prefix_cache();
             return pc == nullptr ? 0 : pc->reclaimable_cells();
           },
           "Cells only the prefix cache holds (a scan of the used cells).")
      .def("prefix_cache_seqs",
           [](PyEngine& self) {
             auto* pc = self.engine().prefix_cache();
             return pc == nullptr ? std::vector<seq_t>{} : pc->seqs();
           },
           "The sequence ids the prefix cache holds, one per entry.")
      .def("prefix_cache_tokens",
           [](PyEngine& self, Int seq) -> std::optional<std::vector<int64_t>> {
             auto* pc = self.engine().prefix_cache();
             if (pc == nullptr) return std::nullopt;
             return pc->tokens(static_cast<seq_t>(seq.value));
           },
           py::arg("seq"), "The tokens of the prefix cache's entry `seq`, or None.")
      .def("clear_prefix_cache", [](PyEngine& self) { self.engine().clear_prefix_cache(); });
}

}  // namespace cellcache::bindings
