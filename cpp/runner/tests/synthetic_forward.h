// A Forward without a model, for engine tests: it declares each step on a
// one-layer CellCache and serves the layer as a real program's place op
// would, and returns logits that are a fixed formula of (token, position)
// only, so greedy continuations can be computed independently
// (next_token below) and a request's tokens never depend on its batch.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "forward.h"

namespace cellcache::runner::testing {

class SyntheticForward final : public Forward {
 public:
  SyntheticForward(int32_t n_cells, int64_t vocab, int32_t max_tokens, std::vector<int64_t> eos)
      : vocab_(vocab), max_tokens_(max_tokens), eos_(std::move(eos)) {
    cache_ = std::move(CellCache::create({n_cells, 1, {std::nullopt}}).value());
  }

  // The logit of token v after `token` at `pos`: a hash, so the argmax looks random.
  static float logit(int64_t token, int64_t pos, int64_t v) {
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
      if (logit(token, pos, v) > logit(token, pos, best)) best = v;
    }
    return best;
  }

  CellCache& cache() override { return *cache_; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t max_tokens_per_step() const override { return max_tokens_; }
  const std::vector<int64_t>& eos_ids() const override { return eos_; }

  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    ++forwards;
    if (fail_next) {
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
        logits_[r * vocab_ + v] = logit(b.tokens[i], b.positions[i], v);
      }
    }
    if (record) batches.push_back(b);
    return std::span<const float>(logits_);
  }

  std::vector<StepBatch> batches;  // every step run (when record)
  bool record = true;
  int64_t forwards = 0;
  bool fail_next = false;

 private:
  std::unique_ptr<CellCache> cache_;
  int64_t vocab_;
  int32_t max_tokens_;
  std::vector<int64_t> eos_;
  std::vector<float> logits_;
};

}  // namespace cellcache::runner::testing
