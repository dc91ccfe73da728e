// Core tests: the step-batch checks (cellcache/step_batch.h), each rule's
// exact message and the order the rules are checked in.
#include <string>
#include <vector>

#include "cellcache/step_batch.h"
#include "check.h"

using namespace cellcache;

namespace {

using Ids = std::vector<int64_t>;

// The message of a refused batch ("" when it passes); checks the code.
std::string refusal(size_t n_seq_ids, const Ids& tokens, size_t n_positions, const Ids& logits_for,
                    int64_t max_tokens = 4, int64_t vocab = 10) {
  const Status s = check_step_batch(n_seq_ids, tokens, n_positions, logits_for, max_tokens, vocab);
  if (s.is_ok()) return "";
  if (s.code() != StatusCode::kInvalidConfig) return "wrong code";
  return s.message();
}

}  // namespace

TEST(step_batch_accepts_a_well_formed_step) {
  CHECK(refusal(3, {0, 5, 9}, 3, {2}).empty());
  CHECK(refusal(4, {1, 2, 3, 4}, 4, {0, 1, 2, 3}).empty());  // full budget, every row
  CHECK(refusal(1, {0}, 1, {0}, 1, 1).empty());
}

TEST(step_batch_refuses_lengths_that_differ) {
  CHECK(refusal(2, {5, 6, 7}, 3, {2}) ==
        "seq_ids (2), tokens (3) and positions (3) must have one entry per token");
  CHECK(refusal(3, {5, 6, 7}, 2, {2}) ==
        "seq_ids (3), tokens (3) and positions (2) must have one entry per token");
}

TEST(step_batch_refuses_a_step_outside_the_budget) {
  CHECK(refusal(0, {}, 0, {0}) == "a step carries 1 to 4 tokens, got 0");
  CHECK(refusal(5, {1, 1, 1, 1, 1}, 5, {0}) == "a step carries 1 to 4 tokens, got 5");
}

TEST(step_batch_refuses_bad_logits_rows) {
  const std::string prefix = "logits_for must hold 1 to 2 token indices in [0, 2), got ";
  CHECK(refusal(2, {5, 6}, 2, {}) == prefix + "[]");
  CHECK(refusal(2, {5, 6}, 2, {2}) == prefix + "[2]");
  CHECK(refusal(2, {5, 6}, 2, {-1}) == prefix + "[-1]");
  CHECK(refusal(2, {5, 6}, 2, {0, 1, 1}) == prefix + "[0, 1, 1]");
}

TEST(step_batch_names_the_first_five_tokens_outside_the_vocabulary) {
  CHECK(refusal(2, {5, 10}, 2, {1}) ==
        "tokens: token ids [10] are outside the vocabulary [0, 10)");
  CHECK(refusal(4, {-1, 3, 12, -7}, 4, {0}) ==
        "tokens: token ids [-1, 12, -7] are outside the vocabulary [0, 10)");
  CHECK(refusal(7, {10, 11, 12, 13, 14, 15, 16}, 7, {0}, 8) ==
        "tokens: token ids [10, 11, 12, 13, 14] are outside the vocabulary [0, 10)");
}

TEST(step_batch_checks_the_rules_in_order) {
  // Every rule broken at once: the lengths are reported; then the budget; then logits_for.
  CHECK(refusal(1, {99, 99, 99, 99, 99}, 2, {7}).starts_with("seq_ids (1)"));
  CHECK(refusal(5, {99, 99, 99, 99, 99}, 5, {7}).starts_with("a step carries"));
  CHECK(refusal(3, {99, 99, 99}, 3, {7}).starts_with("logits_for"));
}
