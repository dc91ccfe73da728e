#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cellcache::runner {

std::mt19937_64 sample_generator(const Sampling& sampling, int32_t sample_index) {
  if (sampling.temperature == 0.0) return std::mt19937_64();  // greedy draws nothing
  const uint64_t seed = sampling.seed ? *sampling.seed : std::random_device{}();
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(sample_index)};
  return std::mt19937_64(seq);
}

int64_t choose_token(std::span<const float> logits, const Sampling& sampling,
                     std::mt19937_64& rng) {
  if (sampling.temperature == 0.0) {
    return std::max_element(logits.begin(), logits.end()) - logits.begin();
  }
  // probs ~ exp((logit - max) / T)
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> weights(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp((logits[i] - top) / sampling.temperature);
    total += weights[i];
  }
  double u = std::uniform_real_distribution<double>(0.0, total)(rng);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (u < weights[i]) return static_cast<int64_t>(i);
    u -= weights[i];
  }
  // Rounding left u just above the last weight: the last token with any mass.
  for (size_t i = weights.size(); i-- > 0;) {
    if (weights[i] > 0) return static_cast<int64_t>(i);
  }
  return 0;
}

}  // namespace cellcache::runner
