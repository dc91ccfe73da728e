// The rules a forward's inputs obey before a step is declared: one home for
// them, used by the C++ program (cpp/program/program.cpp) and, through the
// binding (_core.check_step_batch), by the Python Runner.step
// (executorch_cellcache/runtime/runner.py).
//
// A step carries n_tok tokens in graph order: per token a sequence id, a
// token id and a position; and logits_for, the token indices whose logits
// come back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "cellcache/status.h"

namespace cellcache {

// kInvalidConfig, checked in this order, when:
//  - seq_ids, tokens and positions differ in length (n_seq_ids and n_positions
//    are their lengths);
//  - the step carries fewer than 1 or more than max_tokens_per_step tokens;
//  - logits_for holds fewer than 1 or more than n_tok indices, or one outside
//    [0, n_tok);
//  - a token id lies outside [0, vocab_size) (the message names the first 5).
// ok otherwise. Says nothing about sequences or positions: declare_step and
// the placement check those.
Status check_step_batch(size_t n_seq_ids, std::span<const int64_t> tokens, size_t n_positions,
                        std::span<const int64_t> logits_for, int64_t max_tokens_per_step,
                        int64_t vocab_size);

}  // namespace cellcache
