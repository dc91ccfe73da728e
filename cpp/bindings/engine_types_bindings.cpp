// The engine's value types as Python classes (cpp/engine/: SamplingParams,
// SpeculativeOptions, Usage, EngineStats) and its free functions (prompt
// lookup, choose_max_draft); engine_bindings.cpp binds the Engine itself.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "binding_util.h"
#include "draft_length.h"
#include "engine.h"

namespace cellcache::bindings {

namespace {

using runner::SamplingParams;
using runner::SpeculativeOptions;

std::vector<int64_t> token_ids(const std::vector<Int>& ids) { return {ids.begin(), ids.end()}; }

SamplingParams make_params(Real temperature, std::optional<Int32> top_k,
                           std::optional<Real> top_p, std::optional<UInt64> seed, Int32 n,
                           Int32 max_new_tokens, const std::vector<Int>& stop_token_ids,
                           Bool stop_on_eos, std::optional<Int32> logprobs) {
  SamplingParams p;
  p.temperature = temperature;
  if (top_k) p.top_k = top_k->value;
  if (top_p) p.top_p = top_p->value;
  if (seed) p.seed = seed->value;
  p.n = n;
  p.max_new_tokens = max_new_tokens;
  p.stop_token_ids = token_ids(stop_token_ids);
  p.stop_on_eos = stop_on_eos;
  if (logprobs) p.logprobs = logprobs->value;
  return p;
}

}  // namespace

void bind_engine_types(py::module_& m) {
  py::class_<SamplingParams>(m, "SamplingParams",
                             "One request's generation parameters (cpp/engine/sampling.h).")
      .def(py::init(&make_params), py::kw_only(), py::arg("temperature") = 0.0,
           py::arg("top_k") = py::none(), py::arg("top_p") = py::none(),
           py::arg("seed") = py::none(), py::arg("n") = 1, py::arg("max_new_tokens") = 16,
           py::arg("stop_token_ids") = std::vector<Int>{}, py::arg("stop_on_eos") = true,
           py::arg("logprobs") = py::none())
      .def_readonly("temperature", &SamplingParams::temperature)
      .def_readonly("top_k", &SamplingParams::top_k)
      .def_readonly("top_p", &SamplingParams::top_p)
      .def_readonly("seed", &SamplingParams::seed)
      .def_readonly("n", &SamplingParams::n)
      .def_readonly("max_new_tokens", &SamplingParams::max_new_tokens)
      .def_readonly("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readonly("stop_on_eos", &SamplingParams::stop_on_eos)
      .def_readonly("logprobs", &SamplingParams::logprobs)
      .def("validate", [](const SamplingParams& p) { unwrap_run(p.validate()); },
           "InvalidConfigError naming the first parameter out of range.");

  py::class_<SpeculativeOptions>(m, "SpeculativeOptions",
                                 "Speculative decoding's options (cpp/engine/speculative.h).")
      .def(py::init([](const std::string& method, std::optional<Int32> max_draft,
                       Int32 min_ngram, Int32 max_ngram) {
             SpeculativeOptions o;
             o.method = unwrap_run(runner::speculative_method(method));
             if (max_draft) o.max_draft = max_draft->value;
             o.min_ngram = min_ngram;
             o.max_ngram = max_ngram;
             return o;
           }),
           py::arg("method"), py::kw_only(), py::arg("max_draft") = py::none(),
           py::arg("min_ngram") = runner::kDefaultMinNgram,
           py::arg("max_ngram") = runner::kDefaultMaxNgram,
           "method: \"lookup\" or \"draft\"; max_draft None = auto (draft_length.h).")
      .def_readonly("max_draft", &SpeculativeOptions::max_draft)
      .def_readonly("min_ngram", &SpeculativeOptions::min_ngram)
      .def_readonly("max_ngram", &SpeculativeOptions::max_ngram);

  py::class_<runner::Usage>(m, "Usage", "A finished sample's counts (cpp/engine/engine.h).")
      .def_readonly("prompt_tokens", &runner::Usage::prompt_tokens)
      .def_readonly("cached_tokens", &runner::Usage::cached_tokens)
      .def_readonly("completion_tokens", &runner::Usage::completion_tokens)
      .def_readonly("proposed_tokens", &runner::Usage::proposed_tokens)
      .def_readonly("accepted_tokens", &runner::Usage::accepted_tokens);

  using runner::EngineStats;
  py::class_<EngineStats>(m, "EngineStats", "The engine's counters (cpp/engine/engine.h).")
      .def_readonly("prefill_tokens", &EngineStats::prefill_tokens)
      .def_readonly("decode_tokens", &EngineStats::decode_tokens)
      .def_readonly("decode_step_tokens", &EngineStats::decode_step_tokens)
      .def_readonly("decode_groups", &EngineStats::decode_groups)
      .def_readonly("proposed_tokens", &EngineStats::proposed_tokens)
      .def_readonly("accepted_tokens", &EngineStats::accepted_tokens)
      .def_readonly("max_draft", &EngineStats::max_draft)
      .def_readonly("speculation_failure", &EngineStats::speculation_failure)
      .def_readonly("steps", &EngineStats::steps)
      .def_readonly("prefill_seconds", &EngineStats::prefill_seconds)
      .def_readonly("decode_seconds", &EngineStats::decode_seconds)
      .def_readonly("overhead_seconds", &EngineStats::overhead_seconds)
      .def_readonly("sample_seconds", &EngineStats::sample_seconds)
      .def_readonly("peak_cells", &EngineStats::peak_cells)
      .def_readonly("capacity", &EngineStats::capacity)
      .def_readonly("pool_peak_cells", &EngineStats::pool_peak_cells)
      .def_readonly("pool_capacities", &EngineStats::pool_capacities);
  m.def(
      "prompt_lookup",
      [](const std::vector<Int>& context, Int32 limit, Int32 min_ngram, Int32 max_ngram) {
        return runner::lookup(token_ids(context), limit, min_ngram, max_ngram);
      },
      py::arg("context"), py::arg("limit"), py::arg("min_ngram") = runner::kDefaultMinNgram,
      py::arg("max_ngram") = runner::kDefaultMaxNgram,
      "Prompt lookup's proposal (cpp/engine/speculative.h lookup): for m = max_ngram down to "
      "min_ngram, the earliest earlier match of the context's last m tokens, and up to "
      "`limit` tokens that followed it ([] when none).");
  m.def(
      "choose_max_draft",
      [](const std::vector<Real>& step_seconds, Real proposal_seconds, Real acceptance) {
        return unwrap_run(runner::choose_max_draft(
            std::vector<double>(step_seconds.begin(), step_seconds.end()), proposal_seconds,
            acceptance));
      },
      py::arg("step_seconds"), py::arg("proposal_seconds") = 0.0,
      py::arg("acceptance") = runner::kAutoDraftAcceptance,
      "Speculative decoding's k when max_draft is auto (cpp/engine/draft_length.h): "
      "step_seconds[n - 1] = seconds of a step carrying n tokens of one sequence; "
      "InvalidConfigError naming a bad value.");
  m.attr("AUTO_DRAFT_ACCEPTANCE") = runner::kAutoDraftAcceptance;
  m.attr("MAX_AUTO_DRAFT_TOKENS") = runner::kMaxAutoDraftTokens;
  m.attr("STEP_COST_ROUNDS") = runner::kStepCostRounds;
  m.attr("STEP_COST_CONTEXT") = runner::kStepCostContext;
}

}  // namespace cellcache::bindings
