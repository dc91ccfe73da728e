// GrammarHooks: structured output in the engine (engine.h StepHooks). A
// request submitted through GrammarHooks::submit carries a compiled grammar
// (grammar.h); each of its samples gets a matcher of its own (forks too: the
// first token of every sample comes from the prompt's last row under the
// grammar's initial mask), which masks the sample's picks and ends it with
// finish "stop" on the token that completes the grammar when nothing but a
// stop token could follow (else the model's EOS, which the mask then allows,
// ends it). Logprobs stay the model's own. Constrained samples take no
// speculative proposals (SubmitOptions::constrained).
//
// Requests submitted straight to the engine run unconstrained beside them.
// Threads: submit() from any thread; the hooks run on the stepping thread.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "engine.h"
#include "grammar.h"

namespace cellcache::runner {

class GrammarHooks final : public StepHooks {
 public:
  // Engine::submit with the request's samples held to `grammar` (its
  // vocabulary must be the engine's). Errors: the engine's submit errors.
  Outcome<RequestId> submit(Engine& engine, std::vector<int64_t> prompt, SamplingParams params,
                            std::shared_ptr<Sink> sink, SubmitOptions options,
                            std::shared_ptr<const CompiledGrammar> grammar);

  Outcome<> masks(std::span<const MaskRow> rows, std::span<uint8_t> allowed) override;
  Outcome<bool> ends_sample(RequestId request, int32_t sample, int64_t token,
                            bool stop_token) override;

 private:
  struct Request {
    std::shared_ptr<const CompiledGrammar> grammar;
    std::unordered_map<int32_t, GrammarMatcher> matchers;  // by sample, made on first use
    int32_t unfinished = 0;
  };
  class FinishingSink;
  GrammarMatcher* matcher(RequestId request, int32_t sample);  // mu_ held
  void finished(RequestId request, int32_t sample, bool whole_request);

  std::mutex mu_;
  std::unordered_map<RequestId, Request> requests_;
};

}  // namespace cellcache::runner
