// Per-request generation parameters and the next-token choice (the C++ face
// of executorch_cellcache/runtime/sampling.py; same fields, same rules).
//
// Greedy picks the first highest logit (numpy's argmax), so greedy output
// matches the Python runtime token for token. Sampling: logits shifted by
// their maximum and divided by the temperature, sorted (stable, descending),
// cut to top_k, then to the smallest head whose probability reaches top_p,
// renormalized, and one token drawn. Sample j of a request draws from its own
// std::mt19937_64 seeded with (seed, j) only: its tokens do not depend on the
// other requests of a batch, its place in it or when it arrived. Sampled
// tokens are not meant to equal the Python runtime's (another generator).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "run_status.h"

namespace cellcache::runner {

constexpr int32_t kMaxTopLogprobs = 20;    // OpenAI's limit for top_logprobs
constexpr size_t kMaxStopTokenIds = 1024;  // a bound on what one request may ask for

struct SamplingParams {
  double temperature = 0.0;              // 0 = greedy; finite and >= 0
  std::optional<int32_t> top_k;          // >= 1
  std::optional<double> top_p;           // in (0, 1]
  std::optional<uint64_t> seed;          // nullopt = fresh entropy per sample
  int32_t n = 1;                         // samples sharing the prompt's cells, >= 1
  int32_t max_new_tokens = 16;           // per sample, >= 1
  std::vector<int64_t> stop_token_ids;   // stop beside the program's EOS ids (always honoured)
  bool stop_on_eos = true;               // stop on the program's EOS ids
  std::optional<int32_t> logprobs;       // nullopt = none; k in [0, 20]: chosen + k most likely

  // A user error naming the first parameter out of range (the messages of
  // SamplingParams.validate in sampling.py).
  Outcome<> validate() const;
};

// Log-probabilities (natural log of the softmax of the raw logits, before
// temperature) of a chosen token and of the k most likely tokens.
struct TokenLogprobs {
  double logprob = 0.0;
  std::vector<std::pair<int64_t, double>> top;  // (token id, logprob), most likely first, ties by lower id
};

// The generator of sample `sample_index` of any request: a function of
// (seed, sample_index) only; fresh entropy when seed is nullopt.
std::mt19937_64 sample_generator(const SamplingParams& params, int32_t sample_index);

// logits: float32 [vocab] -> the next token id. `scratch` is reused between
// calls to avoid allocating per token.
int64_t choose_token(std::span<const float> logits, const SamplingParams& params,
                     std::mt19937_64& rng, std::vector<double>& scratch);

// logits: float32 [vocab] -> out float64 [vocab]: the probability
// choose_token draws each token with (the same arithmetic: exp_nonpositive
// weights over their block-wise total without top_k/top_p; else the kept
// candidates' probabilities over their mass), 0 for tokens never drawn; 1 at
// the first argmax when choose_token draws nothing (greedy). sampling.py's
// distribution, a draft model's q for verify.
void token_distribution(std::span<const float> logits, const SamplingParams& params,
                        std::vector<double>& out);

// Speculative decoding's acceptance rule (sampling.py verify): appends to
// `out` the tokens a decode group with k proposed tokens emits, 1..k+1 of
// them: draft[0, a) and one more token, never draft[a].
//   logits: float32 [(k + 1) * vocab]; row i scores the token after draft[0, i).
//   draft: the k proposed tokens (k >= 0).
//   draft_probs: empty for a deterministic proposal (prompt lookup, a greedy
//     draft), else float64 [k * vocab], row i the distribution draft[i] was
//     drawn from (token_distribution of the draft's logits).
// Greedy, or a deterministic proposal: row i's token is chosen as plain
// decoding chooses it (choose_token with the sample's generator), the
// proposal kept while they agree; so the same seed gives the same tokens with
// or without proposals (one draw per emitted token, as plain decoding).
// Sampled proposals (Leviathan et al. 2023, Chen et al. 2023): accept d_i when
// u * q(d_i) < p(d_i), u uniform in [0, 1) from the generator; on rejection
// draw from max(0, p - q) normalized (when rounding leaves it empty: p
// without d_i) and stop; after k acceptances choose the last token from row
// k. The output follows plain sampling's distribution exactly.
void verify(std::span<const float> logits, std::span<const int64_t> draft,
            std::span<const double> draft_probs, const SamplingParams& params,
            std::mt19937_64& rng, std::vector<double>& scratch, std::vector<int64_t>& out);

// logits: float32 [vocab] -> the log-softmax at `token` and the k largest.
TokenLogprobs token_logprobs(std::span<const float> logits, int64_t token, int32_t k);

}  // namespace cellcache::runner
