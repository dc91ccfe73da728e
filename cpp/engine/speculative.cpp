#include "speculative.h"

#include <algorithm>

#include "cellcache/admission.h"
#include "draft_length.h"

namespace cellcache::runner {

namespace {

size_t common_prefix(std::span<const int64_t> a, std::span<const int64_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

void context_of(const Sample& sample, std::vector<int64_t>& out) {
  const Request& req = *sample.request;
  out.assign(req.prompt.begin(), req.prompt.end());
  out.insert(out.end(), sample.tokens.begin(), sample.tokens.end());
}

RunError draft_failure(const char* verb, const Status& status) {
  return runtime_error(std::string("the draft's ") + verb + " failed: [" +
                       status_code_name(status.code()) + "] " + status.message());
}

}  // namespace

Outcome<SpeculativeMethod> speculative_method(const std::string& name) {
  if (name == "lookup") return SpeculativeMethod::kLookup;
  if (name == "draft") return SpeculativeMethod::kDraft;
  return user_error("speculative method must be one of lookup, draft, got '" + name + "'");
}

Outcome<> SpeculativeOptions::validate(int32_t max_tokens_per_step, bool has_draft) const {
  if (max_tokens_per_step < 2) {
    return user_error(
        "speculative decoding needs a program whose max_tokens_per_step holds a decode token "
        "and a proposal (>= 2); this one's is " + std::to_string(max_tokens_per_step));
  }
  if (max_draft && (*max_draft < 1 || *max_draft > max_tokens_per_step - 1)) {
    const std::string m = std::to_string(max_tokens_per_step);
    return user_error("max_draft (--draft-max, tokens proposed per step) must be an integer "
                      "in [1, " + std::to_string(max_tokens_per_step - 1) + "] (the program's "
                      "max_tokens_per_step " + m + " minus the decode token), got " +
                      std::to_string(*max_draft));
  }
  if (min_ngram < 1) {
    return user_error("min_ngram must be an integer >= 1, got " + std::to_string(min_ngram));
  }
  if (max_ngram < 1) {
    return user_error("max_ngram must be an integer >= 1, got " + std::to_string(max_ngram));
  }
  if (min_ngram > max_ngram) {
    return user_error("min_ngram (" + std::to_string(min_ngram) + ") must not exceed max_ngram (" +
                      std::to_string(max_ngram) + ")");
  }
  if (method == SpeculativeMethod::kDraft && !has_draft) {
    return user_error("speculative method 'draft' needs a draft model (--draft-model D.pte)");
  }
  if (method == SpeculativeMethod::kLookup && has_draft) {
    return user_error("a draft model is used by speculative method 'draft', not 'lookup'");
  }
  return {};
}

std::vector<int64_t> lookup(std::span<const int64_t> context, int32_t limit, int32_t min_ngram,
                            int32_t max_ngram) {
  const int64_t n = static_cast<int64_t>(context.size());
  if (n < 2 || limit <= 0) return {};
  for (int64_t m = std::min<int64_t>(max_ngram, n - 1); m >= std::max<int64_t>(min_ngram, 1);
       --m) {
    const auto tail = context.subspan(static_cast<size_t>(n - m));
    // Candidate starts i in [0, n - m - 1]: the match must end before the tail does.
    for (int64_t i = 0; i + m < n; ++i) {
      if (std::equal(tail.begin(), tail.end(), context.begin() + i)) {
        const int64_t start = i + m;
        const int64_t end = std::min<int64_t>(n, start + limit);
        return {context.begin() + start, context.begin() + end};
      }
    }
  }
  return {};
}

std::mt19937_64 draft_generator(const SamplingParams& params, int32_t sample_index) {
  const uint64_t seed = params.seed ? *params.seed
                                    : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                          std::random_device{}();
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(sample_index), kDraftStream};
  return std::mt19937_64(seq);
}

// ---------------------------------------------------------------- PromptLookup

void PromptLookup::propose(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) {
  out.resize(asks.size());
  for (size_t i = 0; i < asks.size(); ++i) {
    context_of(*asks[i].sample, context_);
    out[i].probs.clear();
    out[i].tokens = lookup(context_, asks[i].limit, options_.min_ngram, options_.max_ngram);
  }
}

// ---------------------------------------------------------------- DraftModel

DraftModel::DraftModel(const SpeculativeOptions& options, Forward& draft)
    : options_(options), draft_(draft) {}

DraftModel::~DraftModel() { close(); }

void DraftModel::release(const Sample& sample) {
  const auto it = mirrors_.find({sample.request->id, sample.index});
  if (it == mirrors_.end()) return;
  if (failure_.empty()) (void)draft_.cache().seq_free(it->second.seq);
  mirrors_.erase(it);
}

void DraftModel::close() {
  mirrors_.clear();
  draft_.cache().clear();
}

void DraftModel::stop(const std::string& why) {
  failure_ = why.empty() ? "the draft model failed" : why;
  mirrors_.clear();
  draft_.cache().clear();  // the draft is unusable now; the target's run goes on
}

void DraftModel::propose(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) {
  out.resize(asks.size());
  for (Proposal& p : out) p.clear();
  if (!failure_.empty()) return;
  if (auto done = propose_all(asks, out); !done.ok()) {
    stop(done.error().message);
    for (Proposal& p : out) p.clear();
  }
}

Outcome<DraftModel::Mirror*> DraftModel::mirror(const Sample& sample,
                                                std::span<const int64_t> context) {
  const Request& req = *sample.request;
  if (auto it = mirrors_.find({req.id, sample.index}); it != mirrors_.end()) return &it->second;
  // The sibling mirror sharing the longest prefix with this context (the first such).
  const Mirror* sibling = nullptr;
  size_t shared = 0;
  for (const Sample& o : req.samples) {
    const auto it = mirrors_.find({req.id, o.index});
    if (it == mirrors_.end()) continue;
    const size_t c = common_prefix(it->second.fed, context);
    if (sibling == nullptr || c > shared) {
      sibling = &it->second;
      shared = c;
    }
  }
  CellCache& cache = draft_.cache();
  if (cache.n_sequences() >= kMaxSequences) return static_cast<Mirror*>(nullptr);
  Mirror m;
  size_t upto = 0;
  if (sibling != nullptr && shared > 0) {
    upto = std::min(shared, context.size() - 1);
    // A pooled draft cache may have reclaimed the sibling's window below upto
    // (issue #25): the mirror then starts empty and catches up instead.
    auto holds = cache.holds_prefix(sibling->seq, static_cast<pos_t>(upto));
    if (!holds.is_ok()) return draft_failure("holds_prefix", holds.status());
    if (!holds.value()) upto = 0;
  }
  if (upto > 0) {
    auto clone = cache.seq_clone(sibling->seq, static_cast<pos_t>(upto));
    if (!clone.is_ok()) return draft_failure("seq_clone", clone.status());
    m.seq = clone.value();
    m.fed.assign(context.begin(), context.begin() + static_cast<std::ptrdiff_t>(upto));
  } else {
    auto seq = cache.seq_new();
    if (!seq.is_ok()) return draft_failure("seq_new", seq.status());
    m.seq = seq.value();
  }
  if (req.params.temperature > 0) m.rng = draft_generator(req.params, sample.index);
  return &mirrors_.emplace(Key{req.id, sample.index}, std::move(m)).first->second;
}

Outcome<> DraftModel::propose_all(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) {
  CellCache& cache = draft_.cache();
  work_.clear();
  // Per pool, cells not yet promised to an earlier sample of this call.
  const std::vector<PoolLimit> pools = pool_limits(cache);
  std::vector<int64_t> free(pools.size());
  auto pool_free = [&](size_t p) {
    return static_cast<int64_t>(cache.pool_state(static_cast<int32_t>(p)).value().free_cells);
  };
  for (size_t p = 0; p < pools.size(); ++p) free[p] = pool_free(p);
  std::vector<int64_t> need(pools.size());
  for (size_t i = 0; i < asks.size(); ++i) {
    const Sample& s = *asks[i].sample;
    context_of(s, context_);
    auto made = mirror(s, context_);
    if (!made.ok()) return made.error();
    Mirror* m = made.value();
    if (m == nullptr) continue;  // no free sequence id in the draft's cache
    const size_t keep = std::min(common_prefix(m->fed, context_), context_.size() - 1);
    if (keep < m->fed.size()) {
      std::vector<int64_t> before(pools.size());
      for (size_t p = 0; p < pools.size(); ++p) before[p] = pool_free(p);
      // Within a pooled draft's retained margin: Engine::create bounds
      // max_draft so that the fed proposals (at most max_draft - 1, one per
      // step) roll back (max_draft_within_margin).
      if (Status rm = cache.seq_rm(m->seq, static_cast<pos_t>(keep)); !rm.is_ok()) {
        return draft_failure("seq_rm", rm);
      }
      for (size_t p = 0; p < pools.size(); ++p) free[p] += pool_free(p) - before[p];
      m->fed.resize(keep);
    }
    // Cells this sample takes now: the catch-up, then every proposal but the
    // last; in a windowed pool that reclaims, at most what one sequence holds
    // there (cellcache/admission.h, the draft's step budget).
    const int64_t fed = static_cast<int64_t>(context_.size() - keep) + asks[i].limit - 1;
    bool fits = true;
    for (size_t p = 0; p < pools.size(); ++p) {
      need[p] = request_worst_case_cells_in_pool(0, 0, 1, fed + 1, pools[p].window,
                                                 cache.retained_margin(),
                                                 draft_.max_tokens_per_step());
      fits = fits && need[p] <= free[p];
    }
    if (!fits) continue;  // the draft's cache is full: no proposal for this sample now
    for (size_t p = 0; p < pools.size(); ++p) free[p] -= need[p];
    Work w;
    w.ask = i;
    w.mirror = m;
    w.params = &s.request->params;
    w.limit = asks[i].limit;
    w.pending.assign(context_.begin() + static_cast<std::ptrdiff_t>(keep), context_.end());
    work_.push_back(std::move(w));
  }
  const size_t budget = static_cast<size_t>(draft_.max_tokens_per_step());
  const size_t vocab = static_cast<size_t>(draft_.vocab_size());
  std::vector<double> q;
  while (std::any_of(work_.begin(), work_.end(), [](const Work& w) { return !w.pending.empty(); })) {
    batch_.clear();
    owners_.clear();
    for (Work& w : work_) {
      if (w.pending.empty()) continue;
      const size_t take = std::min(w.pending.size(), budget - batch_.tokens.size());
      if (take == 0) break;
      Mirror& m = *w.mirror;
      for (size_t j = 0; j < take; ++j) {
        batch_.seq_ids.push_back(m.seq);
        batch_.positions.push_back(static_cast<int64_t>(m.fed.size()));
        batch_.tokens.push_back(w.pending[j]);
        m.fed.push_back(w.pending[j]);
      }
      w.pending.erase(w.pending.begin(), w.pending.begin() + static_cast<std::ptrdiff_t>(take));
      if (w.pending.empty()) {  // fed everything: this row scores its next proposal
        batch_.logits_for.push_back(static_cast<int64_t>(batch_.tokens.size()) - 1);
        owners_.push_back(&w);
      }
    }
    if (owners_.empty()) {  // a forward of catch-up chunks only still returns one row
      batch_.logits_for.push_back(static_cast<int64_t>(batch_.tokens.size()) - 1);
    }
    auto logits = draft_.forward(batch_);
    if (!logits.ok()) return logits.error();
    if (logits.value().size() != batch_.logits_for.size() * vocab) {
      return runtime_error("the draft's forward returned " +
                           std::to_string(logits.value().size()) + " logits, expected " +
                           std::to_string(batch_.logits_for.size() * vocab));
    }
    for (size_t r = 0; r < owners_.size(); ++r) {
      Work& w = *owners_[r];
      const auto row = logits.value().subspan(r * vocab, vocab);
      Proposal& p = out[w.ask];
      int64_t token = 0;
      if (w.params->temperature == 0.0) {
        token = choose_token(row, *w.params, greedy_rng_, scratch_);  // the argmax, no draw
      } else {
        token = choose_token(row, *w.params, *w.mirror->rng, scratch_);
        token_distribution(row, *w.params, q);
        p.probs.insert(p.probs.end(), q.begin(), q.end());
      }
      p.tokens.push_back(token);
      if (static_cast<int32_t>(p.tokens.size()) < w.limit) {
        w.pending.assign(1, token);  // fed next round; the last proposal is never fed
      }
    }
  }
  return {};
}

// ---------------------------------------------------------------- checks

std::optional<int32_t> max_draft_within_margin(const CellCache& draft_cache) {
  for (const PoolLimit& pool : pool_limits(draft_cache)) {
    if (pool.window) {
      const int64_t most = int64_t{draft_cache.retained_margin()} + 2;
      return static_cast<int32_t>(std::min<int64_t>(most, INT32_MAX));
    }
  }
  return std::nullopt;
}

Outcome<> check_draft(Forward& target, Forward& draft, const std::string& name) {
  if (&draft.cache() == &target.cache()) {
    return user_error(name + " shares the target's cache; a draft needs a cache of its own");
  }
  if (draft.vocab_size() != target.vocab_size()) {
    return user_error(name + " has a vocabulary of " + std::to_string(draft.vocab_size()) +
                      " tokens, the target " + std::to_string(target.vocab_size()) +
                      ": speculative decoding needs the same vocabulary");
  }
  const std::string_view a = draft.tokenizer_json(), b = target.tokenizer_json();
  if ((!a.empty() || !b.empty()) && a != b) {
    return user_error(name + " embeds another tokenizer than the target: speculative decoding "
                      "needs the same tokenizer");
  }
  return {};
}

namespace {

// The k the proposers use: the one given, or (auto) draft_length.h's choice
// from this forward's measured step costs (and the draft's 1-token step),
// kDefaultMaxDraft within the budget when the cache has no room to measure.
Outcome<int32_t> resolve_max_draft(Forward& forward, const SpeculativeOptions& spec,
                                   Forward* draft) {
  if (spec.max_draft) return *spec.max_draft;
  const int32_t budget = forward.max_tokens_per_step();
  auto seconds = measure_step_seconds(forward, std::min(budget, kMaxAutoDraftTokens));
  if (!seconds.ok()) {
    if (seconds.error().kind == ErrorKind::kRuntime) return seconds.error();
    return std::min(kDefaultMaxDraft, budget - 1);
  }
  double proposal = 0.0;
  if (spec.method == SpeculativeMethod::kDraft && draft != nullptr) {
    auto one = measure_step_seconds(*draft, 1);
    if (!one.ok()) {
      if (one.error().kind == ErrorKind::kRuntime) return one.error();
      return std::min(kDefaultMaxDraft, budget - 1);
    }
    proposal = one.value()[0];
  }
  return choose_max_draft(seconds.value(), proposal);
}

}  // namespace

Outcome<std::unique_ptr<Proposer>> make_proposer(Forward& forward,
                                                 const std::optional<SpeculativeOptions>& options,
                                                 Forward* draft, const std::string& draft_name) {
  if (!options) {
    if (draft != nullptr) {
      return user_error(draft_name + " is given but speculative decoding is off; a draft "
                        "model is used by speculative method 'draft'");
    }
    return std::unique_ptr<Proposer>();
  }
  const SpeculativeOptions& spec = *options;
  if (auto valid = spec.validate(forward.max_tokens_per_step(), draft != nullptr); !valid.ok()) {
    return valid.error();
  }
  if (spec.method == SpeculativeMethod::kDraft) {
    if (auto fits = check_draft(forward, *draft, draft_name); !fits.ok()) return fits.error();
    draft->cache().clear();
  }
  // A pooled draft rolls its mirrors back across steps, within its retained
  // margin (max_draft_within_margin): a max_draft beyond it is refused; an
  // auto one is capped to it. (The target's own rollback removes only
  // proposals of its latest step, which every pool keeps whatever R is.)
  std::optional<int32_t> most;
  if (spec.method == SpeculativeMethod::kDraft) most = max_draft_within_margin(draft->cache());
  if (most && spec.max_draft && *spec.max_draft > *most) {
    return user_error("max_draft " + std::to_string(*spec.max_draft) + " exceeds what " +
                      draft_name + "'s windowed pools keep for a rollback: at most " +
                      std::to_string(*most) + " (retained_margin " +
                      std::to_string(draft->cache().retained_margin()) +
                      " + 2); lower max_draft (--draft-max) or export the draft with a "
                      "larger retained_margin");
  }
  auto k = resolve_max_draft(forward, spec, draft);
  if (!k.ok()) return k.error();
  SpeculativeOptions resolved = spec;
  resolved.max_draft = most ? std::min(k.value(), *most) : k.value();
  if (spec.method == SpeculativeMethod::kDraft) {
    return std::unique_ptr<Proposer>(std::make_unique<DraftModel>(resolved, *draft));
  }
  return std::unique_ptr<Proposer>(std::make_unique<PromptLookup>(resolved));
}


}  // namespace cellcache::runner
