#include "engine.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>


namespace cellcache::runner {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Outcome<> check_ids(std::span<const int64_t> ids, int64_t vocab, const std::string& what) {
  for (int64_t t : ids) {
    if (t < 0 || t >= vocab) {
      return user_error(what + " has token id " + std::to_string(t) +
                        " outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  return {};
}

}  // namespace

double EngineStats::prefill_tokens_per_s() const {
  return prefill_seconds > 0 ? prefill_tokens / prefill_seconds : 0.0;
}

double EngineStats::decode_tokens_per_s() const {
  return decode_seconds > 0 ? decode_step_tokens / decode_seconds : 0.0;
}

double EngineStats::tokens_per_forward() const {
  return decode_groups > 0 ? static_cast<double>(decode_tokens) / decode_groups : 0.0;
}

std::string EngineStats::pool_summary() const {
  const size_t n = pool_capacities.size();
  if (n < 2 || pool_peak_cells.size() != n || pool_windows.size() != n) return "";
  std::string out = " (";
  for (size_t p = 0; p < n; ++p) {
    if (p) out += ", ";
    out += pool_windows[p] ? "window-" + std::to_string(pool_windows[p]) + " pool"
                           : "full-attention pool";
    out += ": " + std::to_string(pool_peak_cells[p]) + " of " +
           std::to_string(pool_capacities[p]);
  }
  return out + ")";
}

double EngineStats::acceptance_rate() const {
  return proposed_tokens > 0 ? static_cast<double>(accepted_tokens) / proposed_tokens : 0.0;
}


Outcome<std::unique_ptr<Engine>> Engine::create(Forward& forward, EngineOptions options) {
  if (forward.max_tokens_per_step() < 1) {
    return user_error("the forward's max_tokens_per_step must be >= 1, got " +
                      std::to_string(forward.max_tokens_per_step()));
  }
  if (forward.vocab_size() < 1) {
    return user_error("the forward's vocab_size must be >= 1, got " +
                      std::to_string(forward.vocab_size()));
  }
  for (int64_t eos : forward.eos_ids()) {
    if (eos < 0 || eos >= forward.vocab_size()) {
      return user_error("the forward's EOS id " + std::to_string(eos) +
                        " is outside the vocabulary [0, " +
                        std::to_string(forward.vocab_size()) + ")");
    }
  }
  auto proposer = make_proposer(forward, options.speculative, options.draft, options.draft_name);
  if (!proposer.ok()) return proposer.error();
  std::unique_ptr<PrefixCache> prefix;
  if (options.prefix_cache) {
    auto created = PrefixCache::create(forward.cache(), options.prefix_cache_cells);
    if (!created.ok()) return created.error();
    prefix = std::move(created.value());
  } else if (options.prefix_cache_cells) {
    return user_error("prefix_cache_cells bounds the prefix cache, which prefix_cache=false "
                      "turns off; set one or the other");
  }
  return std::unique_ptr<Engine>(new Engine(forward, std::move(prefix),
                                            std::move(proposer.value()), options.hooks));
}

Engine::Engine(Forward& forward, std::unique_ptr<PrefixCache> prefix,
               std::unique_ptr<Proposer> proposer, StepHooks* hooks)
    : forward_(forward),
      prefix_(std::move(prefix)),
      proposer_(std::move(proposer)),
      hooks_(hooks),
      scheduler_(forward.cache(), forward.max_tokens_per_step(), forward.eos_ids(), prefix_.get(),
                 proposer_.get()),
      vocab_(forward.vocab_size()),
      capacity_(forward.cache().capacity()),
      pools_(pool_limits(forward.cache())),
      retained_margin_(forward.cache().retained_margin()),
      step_tokens_(forward.max_tokens_per_step()) {
  if (hooks_ != nullptr) {
    scheduler_.set_emit_hook([this](const Sample& s, int64_t token, bool stop_token) {
      return hooks_->ends_sample(s.request->id, s.index, token, stop_token);
    });
  }
  reset_stats();
}

Engine::~Engine() {
  // The cache outlives the engine: give back every cell and id it holds, and
  // end every request it accepted (FinishReason::kCancelled to its sink).
  apply_queued();
  std::vector<RequestId> ids;
  for (const Request* r : scheduler_.waiting()) ids.push_back(r->id);
  for (const Request* r : scheduler_.running()) ids.push_back(r->id);
  for (RequestId id : ids) scheduler_.cancel(id);
  try {
    deliver_events();
  } catch (...) {  // a sink that throws cannot stop the cells from being given back
  }
  if (prefix_ != nullptr) prefix_->clear();
  if (proposer_ != nullptr) proposer_->close();
}

Outcome<RequestId> Engine::submit(std::vector<int64_t> prompt, SamplingParams params,
                                  std::shared_ptr<Sink> sink, SubmitOptions options) {
  const std::string& label = options.label;
  if (sink == nullptr) return user_error("submit needs a sink to receive the request's tokens");
  if ((options.constrained || options.watched) && hooks_ == nullptr) {
    return user_error(label + " is " + (options.constrained ? "constrained" : "watched") +
                      " but the engine has no hooks (EngineOptions::hooks) to serve it");
  }
  if (auto ok = Scheduler::check_request(label, static_cast<int64_t>(prompt.size()), params,
                                         pools_, retained_margin_, step_tokens_);
      !ok.ok()) {
    return ok.error();
  }
  if (auto ok = check_ids(prompt, vocab_, label); !ok.ok()) return ok.error();
  if (auto ok = check_ids(params.stop_token_ids, vocab_, "stop_token_ids"); !ok.ok()) {
    return ok.error();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const RequestId id = next_id_++;
  live_.insert(id);
  queue_.emplace_back(
      QueuedSubmit{id, std::move(prompt), std::move(params), std::move(sink), std::move(options)});
  ++queued_submits_;
  return id;
}

Outcome<> Engine::cancel(RequestId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (live_.count(id) == 0) {
    return user_error("no request " + std::to_string(id) +
                      " is waiting or running (unknown, or already finished)");
  }
  if (!cancelling_.insert(id).second) {
    return user_error("request " + std::to_string(id) + " is already being cancelled");
  }
  queue_.emplace_back(QueuedCancel{id});
  return {};
}

int64_t Engine::live_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(live_.size());
}

int64_t Engine::waiting_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queued_submits_ + scheduler_waiting_;
}

Outcome<> Engine::abort(FinishReason reason) {
  if (stepping_) {
    return user_error("abort() was called while a step runs (from a sink callback, or "
                      "another thread); return from the step first");
  }
  apply_queued();
  scheduler_.abandon(reason);
  std::vector<RequestId> waiting;
  for (const Request* r : scheduler_.waiting()) waiting.push_back(r->id);
  for (RequestId id : waiting) scheduler_.cancel(id);
  note_waiting();
  deliver_events();
  return {};
}

void Engine::note_waiting() {
  std::lock_guard<std::mutex> lock(mutex_);
  scheduler_waiting_ = static_cast<int64_t>(scheduler_.waiting().size());
}

Outcome<> Engine::set_speculative(std::optional<SpeculativeOptions> speculative, Forward* draft,
                                  const std::string& draft_name) {
  if (stepping_) return user_error("set_speculative() was called from inside a sink callback");
  if (live_requests() > 0) {
    return user_error("speculative decoding can change only while no request is live (" +
                      std::to_string(live_requests()) + " are)");
  }
  auto proposer = make_proposer(forward_, speculative, draft, draft_name);
  if (!proposer.ok()) return proposer.error();
  if (proposer_ != nullptr) proposer_->close();
  proposer_ = std::move(proposer.value());
  scheduler_.set_proposer(proposer_.get());
  stats_.max_draft = proposer_ != nullptr ? proposer_->max_draft() : 0;
  return {};
}

bool Engine::idle() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.empty() && scheduler_.idle();
}

void Engine::reset_stats() {
  stats_ = EngineStats{};
  stats_.capacity = capacity_;
  for (const PoolLimit& pool : pools_) {
    stats_.pool_capacities.push_back(static_cast<int32_t>(pool.capacity));
    stats_.pool_windows.push_back(pool.window.value_or(0));
  }
  stats_.pool_peak_cells.assign(pools_.size(), 0);
  if (proposer_ != nullptr) stats_.max_draft = proposer_->max_draft();
}

void Engine::clear_prefix_cache() {
  if (prefix_ != nullptr) prefix_->clear();
}

void Engine::apply_queued() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    applying_.swap(queue_);
  }
  for (Queued& op : applying_) {
    if (auto* s = std::get_if<QueuedSubmit>(&op)) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --queued_submits_;
      }
      // Checked by submit(); the scheduler's own checks cannot refuse it.
      auto request = scheduler_.submit(s->id, std::move(s->prompt), std::move(s->params));
      if (!request.ok()) {
        for (int32_t j = 0; j < std::max(s->params.n, 1); ++j) {
          s->sink->on_finish({s->id, j, FinishReason::kError, {}});
        }
        std::lock_guard<std::mutex> lock(mutex_);
        live_.erase(s->id);
        continue;
      }
      Request& r = *request.value();
      r.speculate = s->options.speculate;
      r.constrained = s->options.constrained;
      r.watched = s->options.watched;
      r.rngs.reserve(static_cast<size_t>(r.params.n));
      for (int32_t j = 0; j < r.params.n; ++j) r.rngs.push_back(sample_generator(r.params, j));
      sinks_.emplace(s->id, std::move(s->sink));
    } else {
      scheduler_.cancel(std::get<QueuedCancel>(op).id);  // false: it finished meanwhile
    }
  }
  applying_.clear();
  note_waiting();
}

Outcome<> Engine::fill_masks() {
  mask_rows_.clear();
  mask_at_.assign(plan_.consumers.size(), -1);
  for (size_t c = 0; c < plan_.consumers.size(); ++c) {
    const RowConsumer& rc = plan_.consumers[c];
    const Request& req = rc.sample != nullptr ? *rc.sample->request : *rc.prompt_end;
    if (!req.constrained) continue;
    mask_at_[c] = static_cast<int32_t>(mask_rows_.size());
    const int32_t first = rc.sample != nullptr ? rc.sample->index : 0;
    // Constrained samples take no proposals: one pick per sample of the group.
    for (int32_t j = first; j < first + (rc.sample != nullptr ? 1 : rc.width()); ++j) {
      mask_rows_.push_back({req.id, j});
    }
  }
  if (mask_rows_.empty()) return {};
  const size_t vocab = static_cast<size_t>(vocab_);
  allowed_.assign(mask_rows_.size() * vocab, 0);
  if (auto filled = hooks_->masks(mask_rows_, allowed_); !filled.ok()) return filled;
  for (size_t r = 0; r < mask_rows_.size(); ++r) {
    const auto row = std::span<const uint8_t>(allowed_).subspan(r * vocab, vocab);
    if (std::none_of(row.begin(), row.end(), [](uint8_t a) { return a != 0; })) {
      return runtime_error("the constraint of request " + std::to_string(mask_rows_[r].request) +
                           " allows no token for sample " +
                           std::to_string(mask_rows_[r].sample));
    }
  }
  return {};
}

Outcome<> Engine::sample_rows(std::span<const float> logits) {
  const size_t vocab = static_cast<size_t>(vocab_);
  picks_.clear();
  if (hooks_ != nullptr) {
    if (auto masked = fill_masks(); !masked.ok()) return masked;
  }
  size_t at = 0;  // the group's first logits row
  auto pick = [&](const Request& req, int64_t token, size_t row) {
    if (req.params.logprobs) {
      if (pick_logprobs_.size() <= picks_.size()) pick_logprobs_.resize(picks_.size() + 1);
      pick_logprobs_[picks_.size()] =
          token_logprobs(logits.subspan(row * vocab, vocab), token, *req.params.logprobs);
    }
    picks_.push_back(token);
  };
  for (size_t ci = 0; ci < plan_.consumers.size(); ++ci) {
    const RowConsumer& c = plan_.consumers[ci];
    Request& req = c.sample != nullptr ? *c.sample->request : *c.prompt_end;
    if (c.sample != nullptr && c.draft_len > 0) {
      // A decode group with proposals: 1 + k rows, the sample's own generator.
      const size_t k = static_cast<size_t>(c.draft_len);
      const auto draft = std::span<const int64_t>(plan_.drafts).subspan(
          static_cast<size_t>(c.draft_begin), k);
      const auto probs = c.probs_begin < 0 ? std::span<const double>()
                                           : std::span<const double>(plan_.draft_probs)
                                                 .subspan(static_cast<size_t>(c.probs_begin),
                                                          k * vocab);
      verified_.clear();
      verify(logits.subspan(at * vocab, (k + 1) * vocab), draft, probs, req.params,
             req.rngs[c.sample->index], scratch_, verified_);
      for (size_t i = 0; i < verified_.size(); ++i) pick(req, verified_[i], at + i);
    } else {
      const auto row = logits.subspan(at * vocab, vocab);
      const int32_t first = c.sample != nullptr ? c.sample->index : 0;
      const int32_t mask = mask_at_.empty() ? -1 : mask_at_[ci];
      for (int32_t j = first; j < first + c.width(); ++j) {
        if (mask < 0) {
          pick(req, choose_token(row, req.params, req.rngs[j], scratch_), at);
          continue;
        }
        const size_t m = static_cast<size_t>(mask + (j - first));
        masked_.assign(row.begin(), row.end());
        for (size_t t = 0; t < vocab; ++t) {
          if (allowed_[m * vocab + t] == 0) masked_[t] = -std::numeric_limits<float>::infinity();
        }
        pick(req, choose_token(masked_, req.params, req.rngs[j], scratch_), at);
      }
    }
    at += static_cast<size_t>(c.rows());
  }
  return {};
}

RunError Engine::fail_step(RunError error) {
  scheduler_.abandon(FinishReason::kError);
  note_waiting();
  deliver_events();
  return error;
}

void Engine::deliver_events() {
  // Everything is taken out of the scheduler before any callback runs, so a
  // sink that throws, cancels or submits sees a consistent engine and nothing
  // is delivered twice; a finished request's id is no longer live, so its own
  // sink cannot cancel it.
  delivering_.clear();
  delivering_.swap(scheduler_.events());
  auto finished = scheduler_.take_finished();  // kept alive until the callbacks ran
  ending_.clear();
  if (!finished.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& r : finished) {
      live_.erase(r->id);
      cancelling_.erase(r->id);
    }
  }
  for (const auto& r : finished) {
    if (auto it = sinks_.find(r->id); it != sinks_.end()) {
      ending_.emplace(r->id, std::move(it->second));
      sinks_.erase(it);
    }
  }
  for (const SampleEvent& e : delivering_) {
    const Request& req = *e.request;
    Sink* sink = nullptr;
    if (auto it = sinks_.find(req.id); it != sinks_.end()) {
      sink = it->second.get();
    } else if (auto ended = ending_.find(req.id); ended != ending_.end()) {
      sink = ended->second.get();
    } else {
      continue;
    }
    if (e.token >= 0) {
      const TokenLogprobs* lp =
          req.params.logprobs && e.pick >= 0 ? &pick_logprobs_[e.pick] : nullptr;
      sink->on_token({req.id, e.sample, e.token, lp, e.stop_token, e.finish});
    }
    if (e.finish != FinishReason::kNone) {
      Usage usage;
      usage.prompt_tokens = static_cast<int64_t>(req.prompt.size());
      usage.cached_tokens = req.cached_tokens;
      if (e.sample < static_cast<int32_t>(req.samples.size())) {
        const Sample& s = req.samples[e.sample];
        usage.completion_tokens = static_cast<int64_t>(s.tokens.size());
        usage.proposed_tokens = s.proposed_tokens;
        usage.accepted_tokens = s.accepted_tokens;
      }
      sink->on_finish({req.id, e.sample, e.finish, usage});
    }
  }
  delivering_.clear();
  ending_.clear();
}

Outcome<bool> Engine::step() {
  if (stepping_) {
    return user_error("step() was called from inside a sink callback; return from the "
                      "callback and step again");
  }
  stepping_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{stepping_};
  const auto t_start = Clock::now();
  bool applied = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    applied = !queue_.empty();
  }
  if (applied) {
    apply_queued();
    deliver_events();
  }
  auto planned = scheduler_.plan(plan_);
  note_waiting();
  if (!planned.ok()) return planned.error();
  if (plan_.batch.tokens.empty()) {
    if (scheduler_.idle()) return applied;
    return runtime_error("no request can be admitted into the free cells (" +
                         std::to_string(cache().free_cells()) + " of " +
                         std::to_string(capacity_) + "); another user of this cache holds them");
  }
  // A step of prompt chunks that end no prompt needs no logits, but a
  // forward returns at least one row: take the last token's and ignore it.
  if (plan_.batch.logits_for.empty()) {
    plan_.batch.logits_for.push_back(static_cast<int64_t>(plan_.batch.tokens.size()) - 1);
  }
  const auto t0 = Clock::now();
  stats_.plan_seconds += std::chrono::duration<double>(t0 - t_start).count();
  auto logits = forward_.forward(plan_.batch);
  const double forward_seconds = seconds_since(t0);
  const size_t expected = plan_.batch.logits_for.size() * static_cast<size_t>(vocab_);
  if (logits.ok() && logits.value().size() != expected) {
    logits = runtime_error("the forward returned " + std::to_string(logits.value().size()) +
                           " logits, expected " + std::to_string(expected) + " (" +
                           std::to_string(plan_.batch.logits_for.size()) + " rows x " +
                           std::to_string(vocab_) + ")");
  }
  if (!logits.ok()) return fail_step(logits.error());
  stats_.steps += 1;
  stats_.peak_cells = std::max(stats_.peak_cells, capacity_ - cache().free_cells());
  for (size_t p = 0; p < stats_.pool_peak_cells.size(); ++p) {
    const PoolState pool = cache().pool_state(static_cast<int32_t>(p)).value();
    stats_.pool_peak_cells[p] =
        std::max(stats_.pool_peak_cells[p], pool.capacity - pool.free_cells);
  }
  stats_.prefill_tokens += plan_.n_prefill;
  stats_.decode_groups += plan_.n_decode;
  if (plan_.n_prefill) {
    stats_.prefill_seconds += forward_seconds;
  } else {
    stats_.decode_seconds += forward_seconds;
  }
  const auto t1 = Clock::now();
  if (auto sampled = sample_rows(logits.value()); !sampled.ok()) {
    return fail_step(sampled.error());
  }
  const auto t2 = Clock::now();
  stats_.sample_seconds += std::chrono::duration<double>(t2 - t1).count();
  const SpeculationStats before = scheduler_.speculation();
  const int64_t emitted_before = scheduler_.decode_emitted();
  if (auto committed = scheduler_.commit(plan_, picks_); !committed.ok()) {
    return fail_step(committed.error());
  }
  const int64_t emitted = scheduler_.decode_emitted() - emitted_before;
  stats_.decode_tokens += emitted;
  if (!plan_.n_prefill) stats_.decode_step_tokens += emitted;
  stats_.proposed_tokens += scheduler_.speculation().proposed - before.proposed;
  stats_.accepted_tokens += scheduler_.speculation().accepted - before.accepted;
  if (proposer_ != nullptr) stats_.speculation_failure = proposer_->failure();
  deliver_events();
  stats_.commit_seconds += seconds_since(t2);
  stats_.overhead_seconds += seconds_since(t_start) - forward_seconds;
  return true;
}

}  // namespace cellcache::runner
