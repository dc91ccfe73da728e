// A Forward without a model, for engine tests: it declares each step on a
// one-layer CellCache and serves the layer as a real program's place op
// would, and returns logits that are a fixed formula of (token, position)
// only, so greedy continuations can be computed independently
// (next_token below) and a request's tokens never depend on its batch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "forward.h"

namespace cellcache::runner::testing {

class SyntheticForward : public Forward {
 public:
  // The logit of token v after `token` at `pos`.
  using Logit = std::function<float(int64_t token, int64_t pos, int64_t v)>;

  SyntheticForward(int32_t n_cells, int64_t vocab, int32_t max_tokens, std::vector<int64_t> eos,
                   Logit logit = hash_logit)
      : vocab_(vocab), max_tokens_(max_tokens), eos_(std::move(eos)), logit_(std::move(logit)) {
    cache_ = std::move(CellCache::create({n_cells, 1, {std::nullopt}}).value());
  }

  // The default logits: a hash, so the argmax looks random.
  static float hash_logit(int64_t token, int64_t pos, int64_t v) {
    uint64_t h = static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ull ^
                 static_cast<uint64_t>(pos) * 0xC2B2AE3D27D4EB4Full ^
                 static_cast<uint64_t>(v) * 0x165667B19E3779F9ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return static_cast<float>(h % 100000) / 1000.0f;
  }
  // Greedy oracle: the token after `token` at `pos`.
  int64_t next_token(int64_t token, int64_t pos) const {
    int64_t best = 0;
    for (int64_t v = 1; v < vocab_; ++v) {
      if (logit_(token, pos, v) > logit_(token, pos, best)) best = v;
    }
    return best;
  }

  CellCache& cache() override { return *cache_; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t max_tokens_per_step() const override { return max_tokens_; }
  const std::vector<int64_t>& eos_ids() const override { return eos_; }
  std::string_view tokenizer_json() const override { return tokenizer; }

  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    const int64_t index = forwards++;
    if (fail_next || index == fail_at) {
      fail_next = false;
      return runtime_error("synthetic failure");
    }
    if (b.tokens.empty() || static_cast<int32_t>(b.tokens.size()) > max_tokens_) {
      return user_error("bad step size");
    }
    auto declared = cache_->declare_step(b.seq_ids);
    if (!declared.is_ok() || !declared.value()) return user_error("step does not fit");
    auto served = cache_->serve_layer(b.positions, 0);
    if (!served.is_ok()) return runtime_error(served.status().message());
    logits_.resize(b.logits_for.size() * static_cast<size_t>(vocab_));
    for (size_t r = 0; r < b.logits_for.size(); ++r) {
      const int64_t i = b.logits_for[r];
      for (int64_t v = 0; v < vocab_; ++v) {
        logits_[r * vocab_ + v] = logit_(b.tokens[i], b.positions[i], v);
      }
    }
    tokens_run += static_cast<int64_t>(b.tokens.size());
    if (record) batches.push_back(b);
    return std::span<const float>(logits_);
  }

  std::vector<StepBatch> batches;  // every step run (when record)
  bool record = true;
  int64_t forwards = 0;            // forward calls, failed ones too
  bool fail_next = false;          // the next forward fails
  int64_t fail_at = -1;            // the forward with this index (from 0) fails
  int64_t tokens_run = 0;          // tokens of the forwards that ran
  std::string tokenizer;           // tokenizer_json()

 private:
  std::unique_ptr<CellCache> cache_;
  int64_t vocab_;
  int32_t max_tokens_;
  std::vector<int64_t> eos_;
  Logit logit_;
  std::vector<float> logits_;
};

}  // namespace cellcache::runner::testing
