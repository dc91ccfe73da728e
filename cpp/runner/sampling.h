// Next-token choice: greedy, or seeded temperature sampling.
//
// Greedy picks the first highest logit (numpy's argmax), so greedy output
// matches the Python runner token for token. Sample j of a prompt draws from
// its own std::mt19937_64 seeded with (seed, j) only, the rule of
// executorch_cellcache/runtime/sampling.py: a prompt's tokens do not depend on
// its index or on the other prompts of the batch (the same prompt and seed give
// the same tokens wherever it sits). Sampled tokens are not meant to equal the
// Python runner's (a different generator).
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

// The generator of sample sample_index of any prompt: a function of
// (seed, sample_index) only; fresh entropy when seed is nullopt.
std::mt19937_64 sample_generator(const Sampling& sampling, int32_t sample_index);

// logits: float32 [vocab] -> the next token id.
int64_t choose_token(std::span<const float> logits, const Sampling& sampling,
                     std::mt19937_64& rng);

}  // namespace cellcache::runner
