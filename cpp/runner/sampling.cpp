#include "sampling.h"

#include <algorithm>
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

int64_t choose_token(std::span<const float> logits, const SamplingParams& params,
                     std::mt19937_64& rng, std::vector<double>& scratch) {
  if (params.temperature == 0.0 || logits.size() == 1) {
    return std::max_element(logits.begin(), logits.end()) - logits.begin();
  }
  const size_t vocab = logits.size();
  const double top = *std::max_element(logits.begin(), logits.end());
  // z = (logit - max) / T; shifting first makes a tiny T give -inf, never inf - inf.
  scratch.resize(vocab);
  for (size_t i = 0; i < vocab; ++i) scratch[i] = (logits[i] - top) / params.temperature;
  const bool cut = params.top_k.has_value() || params.top_p.has_value();
  if (!cut) {
    // Plain temperature: draw over the whole vocabulary without sorting.
    double total = 0.0;
    for (double& z : scratch) total += (z = std::exp(z));
    double u = std::uniform_real_distribution<double>(0.0, total)(rng);
    for (size_t i = 0; i < vocab; ++i) {
      if (u < scratch[i]) return static_cast<int64_t>(i);
      u -= scratch[i];
    }
    for (size_t i = vocab; i-- > 0;) {
      if (scratch[i] > 0) return static_cast<int64_t>(i);
    }
    return 0;
  }
  // Stable descending order (ties by lower id), cut to top_k.
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  const size_t k = params.top_k ? std::min<size_t>(vocab, static_cast<size_t>(*params.top_k))
                                : vocab;
  auto by_z = [&](int64_t a, int64_t b) {
    return scratch[a] > scratch[b] || (scratch[a] == scratch[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    by_z);
  order.resize(k);
  std::vector<double> probs(k);
  double total = 0.0;
  for (size_t i = 0; i < k; ++i) total += (probs[i] = std::exp(scratch[order[i]] - scratch[order[0]]));
  for (double& p : probs) p /= total;
  size_t keep = k;
  if (params.top_p) {
    // The smallest head whose cumulative probability reaches top_p.
    double cum = 0.0;
    for (size_t i = 0; i < k; ++i) {
      cum += probs[i];
      if (cum >= *params.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double mass = 0.0;
  for (size_t i = 0; i < keep; ++i) mass += probs[i];
  double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  for (size_t i = 0; i < keep; ++i) {
    if (u < probs[i]) return order[i];
    u -= probs[i];
  }
  return order[keep - 1];
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
