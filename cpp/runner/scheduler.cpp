#include "scheduler.h"

#include <algorithm>
#include <string>

#include "cellcache/cell_table.h"

namespace cellcache::runner {
namespace {

RunError cache_failure(const char* verb, const Status& status) {
  return runtime_error(std::string(verb) + ": [" + status_code_name(status.code()) + "] " +
                       status.message());
}

void add_token(StepPlan& plan, seq_t seq, int64_t token, int64_t pos, RowConsumer consumer) {
  if (consumer.sample != nullptr || consumer.prompt_end != nullptr) {
    plan.batch.logits_for.push_back(static_cast<int64_t>(plan.batch.tokens.size()));
    plan.consumers.push_back(consumer);
  }
  plan.batch.seq_ids.push_back(seq);
  plan.batch.tokens.push_back(token);
  plan.batch.positions.push_back(pos);
}

}  // namespace

int64_t Request::worst_case_cells() const {
  if (samples.empty()) {
    return static_cast<int64_t>(prompt.size()) - prefilled +
           static_cast<int64_t>(n) * (max_new_tokens - 1);
  }
  int64_t cells = 0;
  for (const Sample& s : samples) {
    if (!s.done) cells += max_new_tokens - static_cast<int64_t>(s.tokens.size());
  }
  return cells;
}

bool Request::finished() const {
  return !samples.empty() &&
         std::all_of(samples.begin(), samples.end(), [](const Sample& s) { return s.done; });
}

Scheduler::Scheduler(CellCache& cache, int32_t max_tokens_per_step, Sampling sampling,
                     const std::vector<int64_t>& eos_ids, bool stop_on_eos)
    : cache_(cache), budget_(max_tokens_per_step), sampling_(sampling) {
  if (stop_on_eos) eos_.insert(eos_ids.begin(), eos_ids.end());
}

Outcome<> Scheduler::submit(int32_t index, std::vector<int64_t> prompt, int32_t n,
                            int32_t max_new_tokens) {
  const int64_t need =
      static_cast<int64_t>(prompt.size()) + static_cast<int64_t>(n) * (max_new_tokens - 1);
  if (need > cache_.capacity()) {
    return user_error("prompt " + std::to_string(index) + " needs up to " +
                      std::to_string(need) + " cells (" + std::to_string(prompt.size()) +
                      " prompt tokens + n=" + std::to_string(n) + " x " +
                      std::to_string(max_new_tokens - 1) + " generated) but the cache has " +
                      std::to_string(cache_.capacity()) +
                      "; lower --max-new-tokens or --n, or export with more --cells");
  }
  if (n > kMaxSequences) {
    return user_error("n=" + std::to_string(n) + " samples exceed the " +
                      std::to_string(kMaxSequences) + " sequence ids");
  }
  auto request = std::make_unique<Request>();
  request->index = index;
  request->prompt = std::move(prompt);
  request->n = n;
  request->max_new_tokens = max_new_tokens;
  waiting_.push_back(request.get());
  requests_.push_back(std::move(request));
  return {};
}

Outcome<> Scheduler::admit() {
  // Ids: those live in the cache plus the sample clones that running prompts
  // will still take (the same rule as scheduler.py).
  int64_t spare_cells = cache_.free_cells();
  int64_t spare_ids = kMaxSequences - cache_.n_sequences();
  for (const Request* r : running_) {
    spare_cells -= r->worst_case_cells();
    if (r->samples.empty()) spare_ids -= r->n - 1;
  }
  while (!waiting_.empty()) {
    Request* head = waiting_.front();
    if (head->worst_case_cells() > spare_cells || head->n > spare_ids) {
      return {};  // FIFO: later prompts wait behind it
    }
    waiting_.pop_front();
    auto seq = cache_.seq_new();
    if (!seq.is_ok()) return cache_failure("seq_new", seq.status());
    head->seq = seq.value();
    spare_cells -= head->worst_case_cells();
    spare_ids -= head->n;
    running_.push_back(head);
  }
  return {};
}

Outcome<StepPlan> Scheduler::plan() {
  if (auto admitted = admit(); !admitted.ok()) return admitted.error();
  StepPlan plan;
  std::vector<Sample*> active;
  for (Request* req : running_) {
    for (Sample& s : req->samples) {
      if (!s.done) active.push_back(&s);
    }
  }
  if (!active.empty()) {
    const int64_t n_active = static_cast<int64_t>(active.size());
    const int64_t start = next_decode_ % n_active;
    std::rotate(active.begin(), active.begin() + start, active.end());
    const int64_t n_decode = std::min<int64_t>(n_active, budget_);
    for (int64_t i = 0; i < n_decode; ++i) {
      Sample* s = active[i];
      const int64_t pos =
          static_cast<int64_t>(s->request->prompt.size() + s->tokens.size()) - 1;
      add_token(plan, s->seq, s->tokens.back(), pos, {s, nullptr});
    }
    plan.n_decode = static_cast<int32_t>(n_decode);
    next_decode_ = start + n_decode;
  }
  for (Request* req : running_) {
    if (!req->samples.empty()) continue;
    const int32_t prompt_len = static_cast<int32_t>(req->prompt.size());
    const int32_t room = budget_ - static_cast<int32_t>(plan.batch.tokens.size());
    const int32_t take = std::min(room, prompt_len - req->prefilled);
    for (int32_t i = req->prefilled; i < req->prefilled + take; ++i) {
      const bool last = i == prompt_len - 1;
      add_token(plan, req->seq, req->prompt[i], i, {nullptr, last ? req : nullptr});
    }
    plan.n_prefill += take;
  }
  return plan;
}

Outcome<> Scheduler::commit(const StepPlan& plan, std::span<const float> logits,
                            int64_t vocab) {
  for (Request* req : running_) {
    if (!req->samples.empty()) continue;
    req->prefilled += static_cast<int32_t>(
        std::count(plan.batch.seq_ids.begin(), plan.batch.seq_ids.end(), req->seq));
  }
  for (size_t i = 0; i < plan.consumers.size(); ++i) {
    const auto row = logits.subspan(i * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    const RowConsumer& c = plan.consumers[i];
    auto done = c.prompt_end != nullptr ? start_samples(*c.prompt_end, row) : emit(*c.sample, row);
    if (!done.ok()) return done;
  }
  std::vector<Request*> still_running;
  for (Request* req : running_) {
    (req->finished() ? finished_ : still_running).push_back(req);
  }
  running_ = std::move(still_running);
  return {};
}

Outcome<> Scheduler::start_samples(Request& req, std::span<const float> row) {
  std::vector<seq_t> seqs{req.seq};
  for (int32_t j = 1; j < req.n; ++j) {
    auto clone = cache_.seq_clone(req.seq);
    if (!clone.is_ok()) return cache_failure("seq_clone", clone.status());
    seqs.push_back(clone.value());
  }
  req.samples.resize(seqs.size());
  for (int32_t j = 0; j < req.n; ++j) {
    Sample& s = req.samples[j];
    s.index = j;
    s.seq = seqs[j];
    s.rng = sample_generator(sampling_, j);
    s.request = &req;
  }
  for (Sample& s : req.samples) {
    if (auto emitted = emit(s, row); !emitted.ok()) return emitted;
  }
  return {};
}

Outcome<> Scheduler::emit(Sample& sample, std::span<const float> row) {
  const int64_t token = choose_token(row, sampling_, sample.rng);
  sample.tokens.push_back(token);
  if (eos_.count(token) ||
      static_cast<int64_t>(sample.tokens.size()) >= sample.request->max_new_tokens) {
    sample.done = true;
    if (Status freed = cache_.seq_free(sample.seq); !freed.is_ok()) {
      return cache_failure("seq_free", freed);
    }
  }
  return {};
}

}  // namespace cellcache::runner
