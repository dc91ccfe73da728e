#include "sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace cellcache::runner {

namespace {

// Shortest round-trip form (0.5, 1e-09, nan), as Python's repr prints it.
std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  for (int precision = 1; precision < 17; ++precision) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", precision, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

}  // namespace

Outcome<> SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    return user_error("temperature must be a number >= 0, got " + number(temperature));
  }
  if (top_k && *top_k < 1) {
    return user_error("top_k must be an integer >= 1, got " + std::to_string(*top_k));
  }
  if (top_p && !(*top_p > 0 && *top_p <= 1)) {
    return user_error("top_p must be a number in (0, 1], got " + number(*top_p));
  }
  if (n < 1) return user_error("n must be an integer >= 1, got " + std::to_string(n));
  if (max_new_tokens < 1) {
    return user_error("max_new_tokens must be an integer >= 1, got " +
                      std::to_string(max_new_tokens));
  }
  if (stop_token_ids.size() > kMaxStopTokenIds) {
    return user_error("stop_token_ids holds " + std::to_string(stop_token_ids.size()) +
                      " ids; at most " + std::to_string(kMaxStopTokenIds) + " are taken");
  }
  for (int64_t t : stop_token_ids) {
    if (t < 0) {
      return user_error("stop_token_ids must hold token ids >= 0, got " + std::to_string(t));
    }
  }
  if (logprobs && (*logprobs < 0 || *logprobs > kMaxTopLogprobs)) {
    return user_error("logprobs must be an integer in [0, " + std::to_string(kMaxTopLogprobs) +
                      "], got " + std::to_string(*logprobs));
  }
  return {};
}

std::mt19937_64 sample_generator(const SamplingParams& params, int32_t sample_index) {
  if (params.temperature == 0.0) return std::mt19937_64();  // greedy draws nothing
  const uint64_t seed = params.seed ? *params.seed
                                    : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                          std::random_device{}();
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(sample_index)};
  return std::mt19937_64(seq);
}

namespace {

// The index of the first largest logit (numpy's argmax for non-NaN logits).
// Eight running maxima, so the scan is eight short dependency chains.
int64_t first_argmax(std::span<const float> x) {
  const size_t n = x.size();
  float lane[8];
  std::fill(lane, lane + 8, x[0]);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) lane[l] = std::max(lane[l], x[i + l]);
  }
  float m = lane[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, lane[l]);
  for (; i < n; ++i) m = std::max(m, x[i]);
  for (size_t j = 0; j < n; ++j) {
    if (x[j] == m) return static_cast<int64_t>(j);
  }
  return 0;  // NaN at the start: nothing compares
}

// Tokens with z = (logit - max) / T below -kNegligibleZ are never drawn:
// their weight exp(z) < 2e-22 of the most likely token's, so even a million
// of them hold < 2e-16 of the probability (below double rounding).
constexpr float kNegligibleZ = 50.0f;

// exp(z) for z in [-kNegligibleZ, 0], in float arithmetic only and without
// branches, so the loop over a vocabulary vectorizes (SSE2 and up): z = n ln2
// + r with |r| <= ln2 / 2 (n rounded by the 1.5 * 2^23 trick), exp(r) by
// Cephes' expf polynomial, times 2^n built in the exponent bits. Relative
// error below 2e-7 (float rounding). tests/test_engine_differential.py
// repeats these operations in numpy float32 to model the C++ draw exactly
// (built without FMA contraction, as the package builds it).
inline float exp_nonpositive(float z) {
  const float n = (z * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (z - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  return e * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// w[i] = exp((logits[i] - top) * inv_t), 0 where that is below
// exp(-kNegligibleZ). On x86-64 with GCC compiled for AVX-512, AVX2 and the
// baseline, the best the CPU has chosen at load (function multiversioning);
// never with FMA, so every instance rounds exactly as the baseline does.
// Not under ThreadSanitizer: GCC instruments the clones' resolver, which the
// loader runs before TSan starts (a crash at load).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define CELLCACHE_SAMPLING_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CELLCACHE_SAMPLING_CLONES  // other CPUs (phones: aarch64): one instance
#endif
CELLCACHE_SAMPLING_CLONES
void temperature_weights(const float* logits, double* w, size_t vocab, float top, float inv_t) {
  for (size_t i = 0; i < vocab; ++i) {
    // Selects, not branches, so this vectorizes; NaN compares false.
    const float z = (logits[i] - top) * inv_t;
    const float e = exp_nonpositive(z >= -kNegligibleZ ? z : -kNegligibleZ);
    w[i] = z >= -kNegligibleZ ? e : 0.0f;
  }
}

}  // namespace

namespace {

// Plain temperature's weights: w = scratch[0, vocab) (temperature_weights),
// summed per block of kBlock tokens into scratch[vocab, vocab + n_blocks)
// (four interleaved lanes per block, (l0 + l1) + (l2 + l3): four short
// dependency chains instead of one long one). Returns the total, blocks
// summed in order.
constexpr size_t kBlock = 256;

double plain_weights(std::span<const float> logits, float top, float inv_t,
                     std::vector<double>& scratch) {
  const size_t vocab = logits.size();
  const size_t n_blocks = (vocab + kBlock - 1) / kBlock;
  scratch.resize(vocab + n_blocks);
  double* w = scratch.data();
  double* block_sum = w + vocab;
  temperature_weights(logits.data(), w, vocab, top, inv_t);
  double total = 0.0;
  for (size_t b = 0; b < n_blocks; ++b) {
    double l0 = 0.0, l1 = 0.0, l2 = 0.0, l3 = 0.0;
    const size_t start = b * kBlock, end = std::min(vocab, start + kBlock);
    size_t i = start;
    for (; i + 4 <= end; i += 4) {
      l0 += w[i];
      l1 += w[i + 1];
      l2 += w[i + 2];
      l3 += w[i + 3];
    }
    for (size_t k = 0; i < end; ++i, ++k) (k == 0 ? l0 : k == 1 ? l1 : l2) += w[i];
    block_sum[b] = (l0 + l1) + (l2 + l3);
    total += block_sum[b];
  }
  return total;
}

// With top_k or top_p: the candidates (all but the negligible) in stable
// descending order (ties by lower id), cut to top_k, into `order`, their
// probabilities renormalized into `probs`; returns how many of them top_p
// keeps (the smallest head whose cumulative probability reaches top_p), 0
// for NaN logits.
size_t cut_candidates(std::span<const float> logits, const SamplingParams& params, float top,
                      float inv_t, std::vector<int64_t>& order, std::vector<double>& probs) {
  const size_t vocab = logits.size();
  order.clear();
  for (size_t i = 0; i < vocab; ++i) {
    if ((logits[i] - top) * inv_t >= -kNegligibleZ) order.push_back(static_cast<int64_t>(i));
  }
  if (order.empty()) return 0;  // NaN logits
  const size_t k = params.top_k ? std::min<size_t>(order.size(), static_cast<size_t>(*params.top_k))
                                : order.size();
  auto by_logit = [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    by_logit);
  order.resize(k);
  probs.assign(k, 0.0);
  double total = 0.0;
  for (size_t i = 0; i < k; ++i) {
    total += (probs[i] = std::exp(static_cast<double>((logits[order[i]] - top) * inv_t)));
  }
  for (double& p : probs) p /= total;
  size_t keep = k;
  if (params.top_p) {
    double cum = 0.0;
    for (size_t i = 0; i < k; ++i) {
      cum += probs[i];
      if (cum >= *params.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  return keep;
}

// Whether choose_token picks the argmax without drawing.
bool draws_nothing(std::span<const float> logits, const SamplingParams& params) {
  // Below this temperature every z but the maxima's is -inf: greedy.
  return params.temperature == 0.0 || logits.size() == 1 || params.temperature < 1e-30;
}

}  // namespace

int64_t choose_token(std::span<const float> logits, const SamplingParams& params,
                     std::mt19937_64& rng, std::vector<double>& scratch) {
  const int64_t best = first_argmax(logits);
  if (draws_nothing(logits, params)) return best;
  const size_t vocab = logits.size();
  const float top = logits[best];
  const float inv_t = static_cast<float>(1.0 / params.temperature);
  const bool cut = params.top_k.has_value() || params.top_p.has_value();
  if (!cut) {
    // Plain temperature: weights over the whole vocabulary, no sorting; the
    // draw walks blocks, then one block's tokens, instead of a serial pass
    // over the vocabulary.
    const double total = plain_weights(logits, top, inv_t, scratch);
    const size_t n_blocks = (vocab + kBlock - 1) / kBlock;
    const double* w = scratch.data();
    const double* block_sum = w + vocab;
    double u = std::uniform_real_distribution<double>(0.0, total)(rng);
    for (size_t b = 0; b < n_blocks; ++b) {
      if (u < block_sum[b]) {
        const size_t end = std::min(vocab, (b + 1) * kBlock);
        for (size_t i = b * kBlock; i < end; ++i) {
          if (u < w[i]) return static_cast<int64_t>(i);
          u -= w[i];
        }
        for (size_t i = end; i-- > b * kBlock;) {  // rounding left u past the block's last weight
          if (w[i] > 0) return static_cast<int64_t>(i);
        }
      }
      u -= block_sum[b];
    }
    for (size_t i = vocab; i-- > 0;) {  // rounding left u past the last weight
      if (w[i] > 0) return static_cast<int64_t>(i);
    }
    return best;
  }
  std::vector<int64_t> order;
  std::vector<double> probs;
  const size_t keep = cut_candidates(logits, params, top, inv_t, order, probs);
  if (keep == 0) return best;  // NaN logits
  double mass = 0.0;
  for (size_t i = 0; i < keep; ++i) mass += probs[i];
  double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  for (size_t i = 0; i < keep; ++i) {
    if (u < probs[i]) return order[i];
    u -= probs[i];
  }
  return order[keep - 1];
}

void token_distribution(std::span<const float> logits, const SamplingParams& params,
                        std::vector<double>& out) {
  const size_t vocab = logits.size();
  out.assign(vocab, 0.0);
  const int64_t best = first_argmax(logits);
  if (draws_nothing(logits, params)) {
    out[static_cast<size_t>(best)] = 1.0;
    return;
  }
  const float top = logits[best];
  const float inv_t = static_cast<float>(1.0 / params.temperature);
  if (!params.top_k && !params.top_p) {
    std::vector<double> scratch;
    const double total = plain_weights(logits, top, inv_t, scratch);
    for (size_t i = 0; i < vocab; ++i) out[i] = scratch[i] / total;
    return;
  }
  std::vector<int64_t> order;
  std::vector<double> probs;
  const size_t keep = cut_candidates(logits, params, top, inv_t, order, probs);
  if (keep == 0) {
    out[static_cast<size_t>(best)] = 1.0;
    return;
  }
  double mass = 0.0;
  for (size_t i = 0; i < keep; ++i) mass += probs[i];
  for (size_t i = 0; i < keep; ++i) out[static_cast<size_t>(order[i])] = probs[i] / mass;
}

namespace {

// A draw from weights w (>= 0, summing to total > 0), in id order.
int64_t draw(std::span<const double> w, double total, std::mt19937_64& rng) {
  double u = std::uniform_real_distribution<double>(0.0, total)(rng);
  for (size_t i = 0; i < w.size(); ++i) {
    if (u < w[i]) return static_cast<int64_t>(i);
    u -= w[i];
  }
  for (size_t i = w.size(); i-- > 0;) {  // rounding left u past the last weight
    if (w[i] > 0) return static_cast<int64_t>(i);
  }
  return 0;
}

}  // namespace

void verify(std::span<const float> logits, std::span<const int64_t> draft,
            std::span<const double> draft_probs, const SamplingParams& params,
            std::mt19937_64& rng, std::vector<double>& scratch, std::vector<int64_t>& out) {
  const size_t k = draft.size();
  const size_t vocab = logits.size() / (k + 1);
  const bool deterministic = draft_probs.empty() || params.temperature == 0.0;
  std::vector<double> p;
  for (size_t i = 0; i <= k; ++i) {
    const auto row = logits.subspan(i * vocab, vocab);
    if (i == k || deterministic) {
      const int64_t token = choose_token(row, params, rng, scratch);
      out.push_back(token);
      if (i == k || token != draft[i]) return;
      continue;
    }
    token_distribution(row, params, p);
    const auto q = draft_probs.subspan(i * vocab, vocab);
    const size_t d = static_cast<size_t>(draft[i]);
    if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) * q[d] < p[d]) {
      out.push_back(draft[i]);
      continue;
    }
    double total = 0.0;
    for (size_t v = 0; v < vocab; ++v) total += (p[v] = std::max(p[v] - q[v], 0.0));
    if (total <= 0) {  // p <= q everywhere yet p(d) < q(d): only through rounding
      token_distribution(row, params, p);
      p[d] = 0.0;
      total = 0.0;
      for (double v : p) total += v;
    }
    out.push_back(draw(p, total, rng));
    return;
  }
}

TokenLogprobs token_logprobs(std::span<const float> logits, int64_t token, int32_t k) {
  const double top = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (float l : logits) total += std::exp(static_cast<double>(l) - top);
  const double log_total = std::log(total);
  auto logprob = [&](int64_t t) { return static_cast<double>(logits[t]) - top - log_total; };
  TokenLogprobs out;
  out.logprob = logprob(token);
  const size_t kk = std::min<size_t>(static_cast<size_t>(std::max(k, 0)), logits.size());
  if (kk > 0) {
    std::vector<int64_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kk), order.end(),
                      [&](int64_t a, int64_t b) {
                        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                      });
    for (size_t i = 0; i < kk; ++i) out.top.emplace_back(order[i], logprob(order[i]));
  }
  return out;
}

}  // namespace cellcache::runner
