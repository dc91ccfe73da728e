// How many tokens speculative decoding proposes per sample and step when the
// user does not say (max_draft "auto": SpeculativeOptions::max_draft nullopt,
// Speculative(max_draft=None), --draft-max auto, the default): chosen from
// what a step carrying n tokens of one sequence costs on this program and
// this machine, measured once before the first request.
//
// Why measure: a verify step's cost is a staircase in its token count, not a
// line. The GEMMs run in tiles of rows (XNNPACK's f32 kernels take 7 rows on
// AVX-512, its int8 ones 8), so on the default model a step of 8 tokens costs
// 1.25x one of 7 while 9..14 cost about the same as 8; an ARM core's tiles
// differ. A fixed k would sit just past a stair on some machines and
// programs and stop short of a free one on others.
//
// The rule (Leviathan et al. 2023, "Fast Inference from Transformers via
// Speculative Decoding", section 3.3): when each proposal is accepted with
// probability alpha given the ones before it, a step carrying n tokens (the
// decode token and n - 1 proposals) emits on average
//   E(n) = (1 - alpha^n) / (1 - alpha)
// tokens; k = n - 1 for the n in [2, N] that maximizes
//   rate(n) = E(n) / (step_seconds[n - 1] + (n - 1) * proposal_seconds)
// (the smallest such n on ties), where proposal_seconds is what making one
// proposal costs (0 for prompt lookup; a draft model's 1-token step). With
// free proposals (prompt lookup) the largest n whose rate is within
// kAutoDraftLookupTolerance of the best is taken instead: the geometric E
// undervalues proposals accepted in runs, and the per-sample schedule cuts a
// proposal that keeps failing down below k anyway. Measured on SmolLM2-135M
// 8da4w (2-core AVX2 VM, steps of 1 | 2-3 | 4-6 | 7-9 tokens cost 9.5 | 14.7
// | 26 | 39 ms): rate(3) and rate(6) lie within 3% of each other, so the
// strict rule chose k = 2 or 5 from one measurement to the next; on the
// grounded edit task (docs/benchmarks.md) k = 2 ran 1.51x plain decoding, k
// = 5 1.66x, k = 8 1.57x (six alternated runs each).
// alpha = kAutoDraftAcceptance: prompt lookup's proposals are accepted in
// runs (where the output quotes its context, the whole quote is), so the
// rule should reach for the top of a stair. On the default model (2-core
// AVX-512 VM) it picks 10 to 13 for the fp32 program and 7 to 15 for the
// 8da4w one from one measurement to the next (6 with another process on a
// core), each within noise of the best fixed k there; on the copy task
// (B=1, interleaved per prompt) that ran 2.02x / 1.97x plain decoding
// against 1.85x / 1.80x with the fixed k = 7 used before.
//
// The per-sample schedule (scheduler.h: +2 after a fully accepted proposal,
// -1 after a rejection) still adapts below the chosen k.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "forward.h"
#include "run_status.h"

namespace cellcache::runner {

constexpr double kAutoDraftAcceptance = 0.9;
constexpr double kAutoDraftLookupTolerance = 0.04;
constexpr int32_t kMaxAutoDraftTokens = 32;  // N: step sizes measured (k <= 31)
constexpr int32_t kStepCostRounds = 7;       // medians of this many timings per size
constexpr int32_t kStepCostContext = 32;     // tokens the measured sequence holds first

// k by the rule above over step_seconds[n - 1], n = 1 .. step_seconds.size()
// (>= 2 entries). User errors: fewer than 2 sizes, a time that is not a
// positive finite number, proposal_seconds negative or not finite, acceptance
// outside (0, 1).
Outcome<int32_t> choose_max_draft(std::span<const double> step_seconds,
                                  double proposal_seconds = 0.0,
                                  double acceptance = kAutoDraftAcceptance);

// Seconds of forward.forward() for a step of n = 1 .. max_tokens tokens of
// one sequence (logits for each token, as a verify step asks), after a
// context of kStepCostContext tokens; the sizes take turns within each of
// `rounds` rounds; medians. Runs on a new sequence of forward.cache(),
// freed at the end (the cache is left as found). User errors: max_tokens
// outside [1, forward.max_tokens_per_step()], rounds < 1, no free sequence
// id, fewer free cells than kStepCostContext + max_tokens. A failed forward's
// error is returned (the sequence freed).
Outcome<std::vector<double>> measure_step_seconds(Forward& forward, int32_t max_tokens,
                                                  int32_t rounds = kStepCostRounds);

}  // namespace cellcache::runner
