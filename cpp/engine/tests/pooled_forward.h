// A Forward over a pooled CellCache (issue #25) for engine tests, without a
// model: two layers, one full causal and one of sliding window W (the full
// one first, or with window_first the windowed one), or one windowed layer;
// one pool per window policy with reclaim. Each layer
// keeps a "K/V" buffer of its pool's cells holding the token stamped there;
// a token's logits depend on what its layers attend: for each layer the sum
// of (token * 31 + position) over the cells its mask row opens (the cells'
// positions read from the pool). The greedy oracle (next_token) computes the
// same sums from a sequence's whole token history, positions p-W+1..p for
// the windowed layer and 0..p for the full one, so a cell reclaimed too
// early, a stale one reused without its new token, or a mask that changed
// because of reclaim all change the tokens the engine emits.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "forward.h"

namespace cellcache::runner::testing {

class PooledForward : public Forward {
 public:
  // full_cells: the full pool's (unused without a full layer); window_cells:
  // the window-W pool's; margin: retained_margin R.
  // window_first: the windowed layer is layer 0 (as Gemma3's), so pool 0 is
  // the windowed pool.
  PooledForward(bool with_full_layer, int32_t window, int32_t full_cells, int32_t window_cells,
                int32_t margin, int64_t vocab, int32_t max_tokens, bool window_first = false)
      : window_(window), vocab_(vocab), max_tokens_(max_tokens) {
    std::vector<Window> windows{Window(window)};
    if (with_full_layer) {
      windows.insert(window_first ? windows.end() : windows.begin(), std::nullopt);
    }
    auto created = CellCache::create(CacheConfig(full_cells, static_cast<int32_t>(windows.size()),
                                                 windows, {{window, window_cells}}, margin));
    cache_ = std::move(created.value());
    for (int32_t l = 0; l < cache_->n_layers(); ++l) {
      const int32_t pool = cache_->pool_of(l).value();
      kv_.emplace_back(static_cast<size_t>(cache_->pool_state(pool).value().capacity), -1);
    }
  }

  // (token, position) -> its contribution to an attention sum.
  static int64_t contribution(int64_t token, int64_t pos) { return token * 31 + pos; }

  // The logits of v after `token` at `pos`, given the layers' sums.
  float logit(int64_t token, int64_t pos, std::span<const int64_t> sums, int64_t v) const {
    uint64_t h = static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ull ^
                 static_cast<uint64_t>(pos) * 0xC2B2AE3D27D4EB4Full ^
                 static_cast<uint64_t>(v) * 0x165667B19E3779F9ull;
    for (int64_t s : sums) h = (h ^ static_cast<uint64_t>(s)) * 0xBF58476D1CE4E5B9ull;
    if (salt != 0 && pos % salt_period == 0) h ^= static_cast<uint64_t>(salt);
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    return static_cast<float>(h % 100000) / 1000.0f;
  }

  // Greedy oracle: the token after history[0..p] (p = history.size() - 1),
  // from the history alone.
  int64_t next_token(std::span<const int64_t> history) const {
    const int64_t p = static_cast<int64_t>(history.size()) - 1;
    int64_t all = 0;
    for (int64_t q = 0; q <= p; ++q) all += contribution(history[q], q);
    int64_t in_window = 0;
    for (int64_t q = std::max<int64_t>(0, p - window_ + 1); q <= p; ++q) {
      in_window += contribution(history[q], q);
    }
    std::vector<int64_t> sums;  // in layer order
    for (int32_t l = 0; l < cache_->n_layers(); ++l) {
      sums.push_back(cache_->window(l).value() ? in_window : all);
    }
    int64_t best = 0;
    for (int64_t v = 1; v < vocab_; ++v) {
      if (logit(history[p], p, sums, v) > logit(history[p], p, sums, best)) best = v;
    }
    return best;
  }

  // Greedy continuation of prompt, max_new tokens (no stops).
  std::vector<int64_t> oracle(std::vector<int64_t> prompt, int32_t max_new) const {
    std::vector<int64_t> out;
    for (int32_t i = 0; i < max_new; ++i) {
      out.push_back(next_token(prompt));
      prompt.push_back(out.back());
    }
    return out;
  }

  CellCache& cache() override { return *cache_; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t max_tokens_per_step() const override { return max_tokens_; }
  const std::vector<int64_t>& eos_ids() const override { return eos_; }

  Outcome<std::span<const float>> forward(const StepBatch& b) override {
    if (b.tokens.empty() || static_cast<int32_t>(b.tokens.size()) > max_tokens_) {
      return user_error("bad step size");
    }
    auto declared = cache_->declare_step(b.seq_ids);
    if (!declared.is_ok() || !declared.value()) return user_error("step does not fit");
    const size_t n_tok = b.tokens.size();
    std::vector<std::vector<int64_t>> sums(n_tok);
    for (int32_t l = 0; l < cache_->n_layers(); ++l) {
      auto served = cache_->place_step(b.positions, l);
      if (!served.is_ok()) return runtime_error(served.status().message());
      const LayerStep step = served.value();
      std::vector<int64_t>& kv = kv_[static_cast<size_t>(l)];
      for (size_t i = 0; i < n_tok; ++i) kv[static_cast<size_t>(step.cells[i])] = b.tokens[i];
      const int32_t pool = cache_->pool_of(l).value();
      const auto positions = cache_->pool_state(pool).value().cell_positions;
      for (size_t i = 0; i < n_tok; ++i) {
        int64_t sum = 0;
        for (int32_t c = 0; c < step.used_end; ++c) {
          if (step.mask[i * static_cast<size_t>(step.used_end) + c]) {
            sum += contribution(kv[static_cast<size_t>(c)], positions[static_cast<size_t>(c)]);
          }
        }
        sums[i].push_back(sum);
      }
      peak_used_[static_cast<size_t>(pool)] =
          std::max(peak_used_[static_cast<size_t>(pool)],
                   cache_->pool_state(pool).value().capacity -
                       cache_->pool_state(pool).value().free_cells);
    }
    logits_.resize(b.logits_for.size() * static_cast<size_t>(vocab_));
    for (size_t r = 0; r < b.logits_for.size(); ++r) {
      const size_t i = static_cast<size_t>(b.logits_for[r]);
      for (int64_t v = 0; v < vocab_; ++v) {
        logits_[r * static_cast<size_t>(vocab_) + static_cast<size_t>(v)] =
            logit(b.tokens[i], b.positions[i], sums[i], v);
      }
    }
    tokens_run += static_cast<int64_t>(n_tok);
    batches.push_back(b);
    return std::span<const float>(logits_);
  }

  // Most occupied cells seen in each pool right after a layer placed.
  int32_t peak_used(int32_t pool) const { return peak_used_[static_cast<size_t>(pool)]; }

  // Nonzero: other logits at every salt_period-th position (a draft model
  // that is sometimes wrong, so its proposals are partly rejected; period 1:
  // always wrong, every proposal rejected whole).
  int64_t salt = 0;
  int64_t salt_period = 3;
  std::vector<StepBatch> batches;  // every step run
  int64_t tokens_run = 0;

 private:
  int32_t window_;
  int64_t vocab_;
  int32_t max_tokens_;
  std::vector<int64_t> eos_;
  std::unique_ptr<CellCache> cache_;
  std::vector<std::vector<int64_t>> kv_;  // [layer][its pool's cells] token stamped, -1 none
  std::vector<int32_t> peak_used_ = std::vector<int32_t>(2, 0);
  std::vector<float> logits_;
};

}  // namespace cellcache::runner::testing
