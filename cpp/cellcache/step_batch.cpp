#include "cellcache/step_batch.h"

#include <string>
#include <vector>

namespace cellcache {

namespace {

// "[a, b, c]", the way Python prints a list of ints.
std::string int_list(std::span<const int64_t> values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

}  // namespace

Status check_step_batch(size_t n_seq_ids, std::span<const int64_t> tokens, size_t n_positions,
                        std::span<const int64_t> logits_for, int64_t max_tokens_per_step,
                        int64_t vocab_size) {
  using detail::error;
  const size_t n_tok = tokens.size();
  const std::string n = std::to_string(n_tok);
  if (n_seq_ids != n_tok || n_positions != n_tok) {
    return error(StatusCode::kInvalidConfig,
                 "seq_ids (" + std::to_string(n_seq_ids) + "), tokens (" + n +
                     ") and positions (" + std::to_string(n_positions) +
                     ") must have one entry per token");
  }
  if (n_tok < 1 || static_cast<int64_t>(n_tok) > max_tokens_per_step) {
    return error(StatusCode::kInvalidConfig, "a step carries 1 to " +
                                                 std::to_string(max_tokens_per_step) +
                                                 " tokens, got " + n);
  }
  bool indices_ok = !logits_for.empty() && logits_for.size() <= n_tok;
  for (int64_t i : logits_for) indices_ok = indices_ok && i >= 0 && i < static_cast<int64_t>(n_tok);
  if (!indices_ok) {
    return error(StatusCode::kInvalidConfig, "logits_for must hold 1 to " + n +
                                                 " token indices in [0, " + n + "), got " +
                                                 int_list(logits_for));
  }
  std::vector<int64_t> bad;
  for (int64_t t : tokens) {
    if ((t < 0 || t >= vocab_size) && bad.size() < 5) bad.push_back(t);
  }
  if (!bad.empty()) {
    return error(StatusCode::kInvalidConfig, "tokens: token ids " + int_list(bad) +
                                                 " are outside the vocabulary [0, " +
                                                 std::to_string(vocab_size) + ")");
  }
  return Status::ok();
}

}  // namespace cellcache
