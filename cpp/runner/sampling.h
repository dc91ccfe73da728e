// Next-token choice: greedy, or seeded temperature sampling.
//
// Greedy picks the first highest logit (numpy's argmax), so greedy output
// matches the Python runner token for token. Each sample draws from its own
// std::mt19937_64 seeded with (seed, prompt index, sample index), so its
// tokens do not depend on how requests were batched; sampled tokens are not
// meant to equal the Python runner's (a different generator).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>

namespace cellcache::runner {

struct Sampling {
  double temperature = 0.0;        // 0 = greedy; finite and >= 0
  std::optional<uint64_t> seed;    // nullopt = nondeterministic
};

// The generator of one sample.
std::mt19937_64 sample_generator(const Sampling& sampling, int32_t prompt_index,
                                 int32_t sample_index);

// logits: float32 [vocab] -> the next token id.
int64_t choose_token(std::span<const float> logits, const Sampling& sampling,
                     std::mt19937_64& rng);

}  // namespace cellcache::runner
