#include "grammar_hooks.h"

#include <string>
#include <utility>

namespace cellcache::runner {

// Forwards to the caller's sink; frees a sample's matcher when it finishes.
class GrammarHooks::FinishingSink final : public Sink {
 public:
  FinishingSink(GrammarHooks* hooks, std::shared_ptr<Sink> inner)
      : hooks_(hooks), inner_(std::move(inner)) {}
  void on_token(const TokenEvent& event) override { inner_->on_token(event); }
  void on_finish(const FinishEvent& event) override {
    // A request the engine could not start gets one error finish for all its
    // samples (engine.h): then nothing of it stays.
    bool never_started = event.reason == FinishReason::kError && event.usage.prompt_tokens == 0;
    hooks_->finished(event.request, event.sample, never_started);
    inner_->on_finish(event);
  }

 private:
  GrammarHooks* hooks_;
  std::shared_ptr<Sink> inner_;
};

Outcome<RequestId> GrammarHooks::submit(Engine& engine, std::vector<int64_t> prompt,
                                        SamplingParams params, std::shared_ptr<Sink> sink,
                                        SubmitOptions options,
                                        std::shared_ptr<const CompiledGrammar> grammar) {
  if (!grammar) return user_error("no grammar given for " + options.label);
  if (!sink) return user_error("no sink given for " + options.label);
  options.constrained = true;
  options.watched = true;
  int32_t n = params.n;
  // Held across the submit so the stepping thread's first masks() call for
  // this request finds it registered (the engine calls hooks without its own
  // lock, so this order cannot deadlock).
  std::lock_guard<std::mutex> lock(mu_);
  auto id = engine.submit(std::move(prompt), std::move(params),
                          std::make_shared<FinishingSink>(this, std::move(sink)), std::move(options));
  if (!id.ok()) return id;
  requests_[id.value()] = Request{std::move(grammar), {}, n};
  return id;
}

GrammarMatcher* GrammarHooks::matcher(RequestId request, int32_t sample) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return nullptr;
  auto m = it->second.matchers.find(sample);
  if (m == it->second.matchers.end()) {
    m = it->second.matchers.emplace(sample, GrammarMatcher(it->second.grammar)).first;
  }
  return &m->second;
}

Outcome<> GrammarHooks::masks(std::span<const MaskRow> rows, std::span<uint8_t> allowed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rows.empty()) return {};
  size_t vocab = allowed.size() / rows.size();
  for (size_t r = 0; r < rows.size(); ++r) {
    GrammarMatcher* m = matcher(rows[r].request, rows[r].sample);
    if (m == nullptr) {
      return runtime_error("request " + std::to_string(rows[r].request) +
                           " is constrained but has no grammar (submitted past GrammarHooks)");
    }
    auto filled = m->fill(allowed.subspan(r * vocab, vocab));
    if (!filled.ok()) return filled;
  }
  return {};
}

Outcome<bool> GrammarHooks::ends_sample(RequestId request, int32_t sample, int64_t token,
                                        bool stop_token) {
  std::lock_guard<std::mutex> lock(mu_);
  GrammarMatcher* m = matcher(request, sample);
  if (m == nullptr) {
    return runtime_error("request " + std::to_string(request) + " is watched but has no grammar");
  }
  auto ended = m->accept(token);
  if (!ended.ok()) return ended;
  return ended.value() && !stop_token;
}

void GrammarHooks::finished(RequestId request, int32_t sample, bool whole_request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return;
  it->second.matchers.erase(sample);
  if (whole_request || --it->second.unfinished <= 0) requests_.erase(it);
}

}  // namespace cellcache::runner
