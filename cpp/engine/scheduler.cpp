#include "scheduler.h"

#include <algorithm>
#include <string>

#include "cellcache/admission.h"
#include "proposer.h"

namespace cellcache::runner {

namespace {

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

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
    case FinishReason::kNone: break;
  }
  return "";
}

int64_t Request::worst_case_cells(int32_t cached) const {
  if (samples.empty()) {
    return request_worst_case_cells(static_cast<int64_t>(prompt.size()),
                                    std::max(prefilled, cached), params.n,
                                    params.max_new_tokens);
  }
  int64_t cells = 0;
  for (const Sample& s : samples) {
    if (!s.done()) cells += params.max_new_tokens - static_cast<int64_t>(s.tokens.size());
  }
  return cells;
}

std::vector<PoolLimit> pool_limits(const CellCache& cache) {
  std::vector<PoolLimit> limits;
  for (int32_t p = 0; p < cache.n_pools(); ++p) {
    const PoolState pool = cache.pool_state(p).value();  // p < n_pools: cannot fail
    limits.push_back({pool.reclaims ? pool.window : std::nullopt, pool.capacity});
  }
  return limits;
}

bool Request::finished() const {
  return cancelled || (!samples.empty() && std::all_of(samples.begin(), samples.end(),
                                                       [](const Sample& s) { return s.done(); }));
}

void StepPlan::clear() {
  batch.clear();
  consumers.clear();
  drafts.clear();
  draft_probs.clear();
  n_prefill = 0;
  n_decode = 0;
  n_proposed = 0;
}

Scheduler::Scheduler(CellCache& cache, int32_t max_tokens_per_step,
                     std::vector<int64_t> eos_ids, PrefixCache* prefix, Proposer* proposer)
    : cache_(cache), prefix_(prefix), budget_(max_tokens_per_step),
      pools_(pool_limits(cache)), eos_(eos_ids.begin(), eos_ids.end()), proposer_(proposer),
      no_cells_(pools_.size(), 0) {}

// ---------------------------------------------------------------- requests

Outcome<> Scheduler::check_request(const std::string& label, int64_t prompt_len,
                                   const SamplingParams& params,
                                   std::span<const PoolLimit> pools, int64_t retained_margin,
                                   int64_t step_tokens) {
  if (prompt_len == 0) return user_error(label + " is empty");
  if (auto valid = params.validate(); !valid.ok()) return valid.error();
  const Status fits = check_request_fits_pools(label, prompt_len, params.n,
                                               params.max_new_tokens, pools, retained_margin,
                                               step_tokens);
  if (!fits.is_ok()) return user_error(fits.message());
  return {};
}

Outcome<Request*> Scheduler::submit(RequestId id, std::vector<int64_t> prompt,
                                    SamplingParams params) {
  if (auto ok = check_request("the prompt", static_cast<int64_t>(prompt.size()), params, pools_,
                              cache_.retained_margin(), budget_);
      !ok.ok()) {
    return ok.error();
  }
  auto request = std::make_unique<Request>();
  request->id = id;
  request->prompt = std::move(prompt);
  request->params = std::move(params);
  Request* raw = request.get();
  owned_.push_back(std::move(request));
  waiting_.push_back(raw);
  return raw;
}

bool Scheduler::cancel(RequestId id) {
  auto waiting = std::find_if(waiting_.begin(), waiting_.end(),
                              [&](const Request* r) { return r->id == id; });
  Request* request = nullptr;
  if (waiting != waiting_.end()) {
    request = *waiting;
    waiting_.erase(waiting);
    for (int32_t j = 0; j < request->params.n; ++j) {
      events_.push_back({request, j, -1, -1, FinishReason::kCancelled, false});
    }
  } else {
    auto running = std::find_if(running_.begin(), running_.end(),
                                [&](const Request* r) { return r->id == id; });
    if (running == running_.end() || (*running)->finished()) return false;
    request = *running;
    if (request->samples.empty()) {
      (void)leave(request->prompt, {}, request->seq);
      for (int32_t j = 0; j < request->params.n; ++j) {
        events_.push_back({request, j, -1, -1, FinishReason::kCancelled, false});
      }
    }
    for (Sample& s : request->samples) {
      if (s.done()) continue;
      (void)end(s, FinishReason::kCancelled);
      events_.push_back({request, s.index, -1, -1, FinishReason::kCancelled, false});
    }
    running_.erase(running);
  }
  request->cancelled = true;
  finished_.push_back(request);
  return true;
}

Outcome<> Scheduler::finish_sample(Request& request, int32_t sample_index, FinishReason reason) {
  if (sample_index < 0 || sample_index >= static_cast<int32_t>(request.samples.size())) {
    return user_error("the request has no sample " + std::to_string(sample_index) +
                      " (it has " + std::to_string(request.samples.size()) + ")");
  }
  Sample& s = request.samples[sample_index];
  if (!s.done()) {
    if (auto ended = end(s, reason); !ended.ok()) return ended;
    events_.push_back({&request, sample_index, -1, -1, reason, false});
  }
  retire();
  return {};
}

void Scheduler::abandon(FinishReason reason) {
  for (Request* req : running_) {
    if (req->samples.empty()) {
      (void)cache_.seq_free(req->seq);
      for (int32_t j = 0; j < req->params.n; ++j) {
        events_.push_back({req, j, -1, -1, reason, false});
      }
    }
    for (Sample& s : req->samples) {
      if (s.done()) continue;
      (void)end(s, reason, /*keep=*/false);
      events_.push_back({req, s.index, -1, -1, reason, false});
    }
    req->cancelled = true;
    finished_.push_back(req);
  }
  running_.clear();
  if (prefix_ != nullptr) prefix_->enforce_bound();  // cells the freed ones shared are the cache's now
}

Outcome<> Scheduler::end(Sample& sample, FinishReason reason, bool keep) {
  if (sample.done()) return {};
  sample.finish = reason;
  if (proposer_ != nullptr) proposer_->release(sample);
  if (keep) return leave(sample.request->prompt, sample.tokens, sample.seq);
  if (Status freed = cache_.seq_free(sample.seq); !freed.is_ok()) {
    return cache_failure("seq_free", freed);
  }
  return {};
}

Outcome<> Scheduler::leave(std::span<const int64_t> prompt, std::span<const int64_t> generated,
                           seq_t seq) {
  if (prefix_ == nullptr) {
    if (Status freed = cache_.seq_free(seq); !freed.is_ok()) return cache_failure("seq_free", freed);
    return {};
  }
  auto held = cache_.next_pos(seq);
  if (!held.is_ok()) return cache_failure("next_pos", held.status());
  const int64_t n_tokens = static_cast<int64_t>(prompt.size() + generated.size());
  if (held.value() > n_tokens) {
    // A stop inside an accepted run: the proposals after it were placed too.
    if (Status rm = cache_.seq_rm(seq, static_cast<pos_t>(n_tokens)); !rm.is_ok()) {
      return cache_failure("seq_rm", rm);
    }
    held = cache_.next_pos(seq);
    if (!held.is_ok()) return cache_failure("next_pos", held.status());
  }
  // The sequence holds the K/V of the first next_pos(seq) of prompt + generated.
  std::vector<int64_t> tokens(prompt.begin(), prompt.end());
  tokens.insert(tokens.end(), generated.begin(), generated.end());
  tokens.resize(std::min<size_t>(tokens.size(), static_cast<size_t>(held.value())));
  return prefix_->insert(tokens, seq);
}

void Scheduler::retire() {
  auto it = std::stable_partition(running_.begin(), running_.end(),
                                  [](const Request* r) { return !r->finished(); });
  finished_.insert(finished_.end(), it, running_.end());
  running_.erase(it, running_.end());
}

std::vector<std::unique_ptr<Request>> Scheduler::take_finished() {
  std::vector<std::unique_ptr<Request>> out;
  if (finished_.empty()) return out;
  for (Request* r : finished_) {
    auto it = std::find_if(owned_.begin(), owned_.end(),
                           [&](const std::unique_ptr<Request>& p) { return p.get() == r; });
    out.push_back(std::move(*it));
    owned_.erase(it);
  }
  finished_.clear();
  return out;
}

// ---------------------------------------------------------------- steps

bool Scheduler::room(std::span<const int64_t> cells, int64_t ids, std::optional<seq_t> keep) {
  if (prefix_ != nullptr) return prefix_->evict(cells, ids, keep);
  for (size_t p = 0; p < cells.size(); ++p) {
    if (cache_.pool_state(static_cast<int32_t>(p)).value().free_cells < cells[p]) return false;
  }
  return kMaxSequences - cache_.n_sequences() >= ids;
}

namespace {

int64_t saturating_add(int64_t a, int64_t b) { return b > INT64_MAX - a ? INT64_MAX : a + b; }

}  // namespace

void Scheduler::add_reserve(std::vector<int64_t>& cells, const Request& request) {
  const int64_t remaining = request.worst_case_cells();
  live_seqs_.clear();
  int64_t n_seqs = request.params.n;  // while prefilling: the clones it will make count
  if (request.samples.empty()) {
    live_seqs_.push_back(request.seq);
  } else {
    for (const Sample& s : request.samples) {
      if (!s.done()) live_seqs_.push_back(s.seq);
    }
    n_seqs = static_cast<int64_t>(live_seqs_.size());
  }
  for (size_t p = 0; p < pools_.size(); ++p) {
    if (!pools_[p].window || remaining <= 0) {
      cells[p] = saturating_add(cells[p], std::max<int64_t>(remaining, 0));
      continue;
    }
    // B: the most cells n_seqs sequences own at once here, however long they grow.
    const int64_t bound = request_worst_case_cells_in_pool(
        0, 0, n_seqs, INT64_MAX, pools_[p].window, cache_.retained_margin(), budget_);
    auto owned = cache_.cells_owned_only_by(live_seqs_, static_cast<int32_t>(p));
    const int64_t x = owned.is_ok() ? owned.value() : 0;  // live ids: cannot fail
    cells[p] = saturating_add(cells[p], std::max<int64_t>(0, std::min(remaining, bound - x)));
  }
}

void Scheduler::add_worst_case(std::vector<int64_t>& cells, const Request& request,
                               int32_t cached) const {
  for (size_t p = 0; p < pools_.size(); ++p) {
    cells[p] = saturating_add(
        cells[p], request_worst_case_cells_in_pool(
                      static_cast<int64_t>(request.prompt.size()), cached, request.params.n,
                      request.params.max_new_tokens, pools_[p].window,
                      cache_.retained_margin(), budget_));
  }
}

Outcome<PrefixMatch> Scheduler::clone_cached_prefix(const Request& head, int64_t ids) {
  if (prefix_ == nullptr) return PrefixMatch{};
  const PrefixMatch found = prefix_->match(head.prompt);
  if (found.length == 0 || !room(no_cells_, ids + 1, found.seq)) return PrefixMatch{};
  auto clone = cache_.seq_clone(found.seq, found.length);
  if (!clone.is_ok()) return cache_failure("seq_clone", clone.status());
  return PrefixMatch{clone.value(), found.length};
}

Outcome<> Scheduler::admit() {
  if (waiting_.empty()) return {};  // (reserves cost a scan of each reclaiming pool)
  cells_.assign(pools_.size(), 0);  // per pool: what the running requests may still take
  // Ids: those live in the cache (ours and anyone else's) plus the sample
  // clones that running prompts will still take.
  int64_t ids = 0;
  for (const Request* r : running_) {
    add_reserve(cells_, *r);
    if (r->samples.empty()) ids += r->params.n - 1;
  }
  while (!waiting_.empty()) {
    Request* head = waiting_.front();
    auto cloned = clone_cached_prefix(*head, ids);
    if (!cloned.ok()) return cloned.error();
    PrefixMatch prefix = cloned.value();
    // With the prefix cloned, its cells are the head's: eviction may now take
    // the entry it came from (freeing only that entry's tail).
    const int64_t taken = prefix.seq >= 0 ? 1 : 0;
    head_cells_ = cells_;
    add_worst_case(head_cells_, *head, prefix.length);
    if (!room(head_cells_, ids + head->params.n - taken, std::nullopt)) {
      if (prefix.seq >= 0) {
        // Drops owner bits only: the entry holds the cells.
        if (Status freed = cache_.seq_free(prefix.seq); !freed.is_ok()) {
          return cache_failure("seq_free", freed);
        }
      }
      // FIFO: later prompts wait behind it, for running requests to end.
      if (prefix.seq < 0 || !running_.empty()) return {};
      // With nothing running, cold instead: in a reclaiming pool a clone can
      // cost more than it saves (the worst case there is the sequences' bound
      // whatever is cached, and the clone's cells stay the entry's until it
      // is evicted), so the head would wait forever. With one pool this fails
      // exactly when the clone did (the clone saves as many cells as it
      // holds): nothing changes there.
      prefix = PrefixMatch{};
      head_cells_ = cells_;
      add_worst_case(head_cells_, *head, 0);
      if (!room(head_cells_, ids + head->params.n, std::nullopt)) return {};
    }
    waiting_.pop_front();
    if (prefix.seq >= 0) {
      head->seq = prefix.seq;
    } else {
      auto seq = cache_.seq_new();
      if (!seq.is_ok()) return cache_failure("seq_new", seq.status());
      head->seq = seq.value();
    }
    head->prefilled = head->cached_tokens = prefix.length;
    if (prefix_ != nullptr) {
      prefix_->record(static_cast<int32_t>(head->prompt.size()), prefix.length);
    }
    cells_.swap(head_cells_);  // the head's worst case with its cached prefix, as scheduler.py
    ids += head->params.n - 1;
    running_.push_back(head);
  }
  return {};
}

Outcome<> Scheduler::plan(StepPlan& plan) {
  plan.clear();
  if (auto admitted = admit(); !admitted.ok()) return admitted.error();
  active_.clear();
  for (Request* req : running_) {
    for (Sample& s : req->samples) {
      if (!s.done()) active_.push_back(&s);
    }
  }
  decode_.clear();
  if (!active_.empty()) {
    const int64_t n_active = static_cast<int64_t>(active_.size());
    const int64_t start = next_decode_ % n_active;
    const int64_t n_decode = std::min<int64_t>(n_active, budget_);
    for (int64_t i = 0; i < n_decode; ++i) decode_.push_back(active_[(start + i) % n_active]);
    plan.n_decode = static_cast<int32_t>(n_decode);
    next_decode_ = start + n_decode;
  }
  int32_t left = budget_ - plan.n_decode;
  chunks_.clear();
  for (Request* req : running_) {
    if (!req->samples.empty()) continue;
    const int32_t take = std::min(left, static_cast<int32_t>(req->prompt.size()) - req->prefilled);
    chunks_.emplace_back(req, take);
    left -= take;
  }
  propose(decode_, left);
  for (size_t i = 0; i < decode_.size(); ++i) {
    Sample* s = decode_[i];
    const Proposal& proposal = proposals_[i];
    const int64_t pos = static_cast<int64_t>(s->request->prompt.size() + s->tokens.size()) - 1;
    RowConsumer consumer{s, nullptr};
    consumer.draft_begin = static_cast<int32_t>(plan.drafts.size());
    consumer.draft_len = static_cast<int32_t>(proposal.tokens.size());
    if (!proposal.tokens.empty() && !proposal.probs.empty()) {
      consumer.probs_begin = static_cast<int64_t>(plan.draft_probs.size());
      plan.draft_probs.insert(plan.draft_probs.end(), proposal.probs.begin(),
                              proposal.probs.end());
    }
    add_token(plan, s->seq, s->tokens.back(), pos, consumer);
    for (size_t j = 0; j < proposal.tokens.size(); ++j) {
      // A proposal's row: part of the group opened by the decode token.
      plan.batch.logits_for.push_back(static_cast<int64_t>(plan.batch.tokens.size()));
      plan.batch.seq_ids.push_back(s->seq);
      plan.batch.tokens.push_back(proposal.tokens[j]);
      plan.batch.positions.push_back(pos + 1 + static_cast<int64_t>(j));
      plan.drafts.push_back(proposal.tokens[j]);
    }
    plan.n_proposed += consumer.draft_len;
  }
  for (const auto& [req, take] : chunks_) {
    const int32_t prompt_len = static_cast<int32_t>(req->prompt.size());
    for (int32_t i = req->prefilled; i < req->prefilled + take; ++i) {
      const bool last = i == prompt_len - 1;
      add_token(plan, req->seq, req->prompt[i], i, {nullptr, last ? req : nullptr});
    }
    plan.n_prefill += take;
  }
  return {};
}

Outcome<> Scheduler::commit(const StepPlan& plan, std::span<const int64_t> picks) {
  // Each group's length: n for a prompt end; for a decode sample its picks
  // while they equal its proposals, then one.
  takes_.clear();
  size_t at = 0;
  for (const RowConsumer& c : plan.consumers) {
    int32_t take = 0;
    if (c.prompt_end != nullptr) {
      take = c.prompt_end->params.n;
    } else {
      take = 1;
      while (take <= c.draft_len && at + static_cast<size_t>(take) <= picks.size() &&
             picks[at + static_cast<size_t>(take) - 1] ==
                 plan.drafts[static_cast<size_t>(c.draft_begin + take - 1)]) {
        ++take;
      }
    }
    takes_.push_back(take);
    at += static_cast<size_t>(take);
  }
  if (at != picks.size()) {
    return runtime_error("commit needs " + std::to_string(at) + " picks for the step's " +
                         std::to_string(plan.consumers.size()) + " logits groups, got " +
                         std::to_string(picks.size()));
  }
  for (Request* req : running_) {
    if (!req->samples.empty()) continue;
    req->prefilled += static_cast<int32_t>(
        std::count(plan.batch.seq_ids.begin(), plan.batch.seq_ids.end(), req->seq));
  }
  at = 0;
  for (size_t i = 0; i < plan.consumers.size(); ++i) {
    const RowConsumer& c = plan.consumers[i];
    const size_t take = static_cast<size_t>(takes_[i]);
    const int32_t first = static_cast<int32_t>(at);
    Outcome<> done;
    if (c.prompt_end != nullptr) {
      if (!c.prompt_end->cancelled) done = start_samples(*c.prompt_end, picks, first);
    } else if (c.draft_len > 0) {
      done = emit_run(*c.sample, c.draft_len, picks.subspan(at, take), first);
    } else if (!c.sample->done()) {
      ++decode_emitted_;
      done = emit(*c.sample, picks[at], first);
    }
    if (!done.ok()) return done;
    at += take;
  }
  retire();
  return {};
}

Outcome<> Scheduler::start_samples(Request& req, std::span<const int64_t> picks,
                                   int32_t first_pick) {
  std::vector<seq_t> seqs{req.seq};
  for (int32_t j = 1; j < req.params.n; ++j) {
    auto clone = cache_.seq_clone(req.seq);
    if (!clone.is_ok()) return cache_failure("seq_clone", clone.status());
    seqs.push_back(clone.value());
  }
  req.samples.resize(seqs.size());
  for (int32_t j = 0; j < req.params.n; ++j) {
    Sample& s = req.samples[j];
    s.index = j;
    s.seq = seqs[j];
    s.request = &req;
  }
  for (int32_t j = 0; j < req.params.n; ++j) {
    if (auto emitted = emit(req.samples[j], picks[first_pick + j], first_pick + j);
        !emitted.ok()) {
      return emitted;
    }
  }
  return {};
}

Outcome<> Scheduler::emit(Sample& sample, int64_t token, int32_t pick) {
  const SamplingParams& params = sample.request->params;
  sample.tokens.push_back(token);
  const bool stop_token =
      (params.stop_on_eos && eos_.count(token) != 0) ||
      std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) !=
          params.stop_token_ids.end();
  bool ends = stop_token;
  if (sample.request->watched && emit_hook_) {
    auto ended = emit_hook_(sample, token, stop_token);
    if (!ended.ok()) return ended.error();
    ends = ends || ended.value();
  }
  FinishReason finish = FinishReason::kNone;
  if (ends) {
    finish = FinishReason::kStop;
  } else if (static_cast<int64_t>(sample.tokens.size()) >= params.max_new_tokens) {
    finish = FinishReason::kLength;
  }
  if (finish != FinishReason::kNone) {
    if (auto ended = end(sample, finish); !ended.ok()) return ended;
  }
  events_.push_back({sample.request, sample.index, token, pick, finish, stop_token});
  return {};
}

}  // namespace cellcache::runner
