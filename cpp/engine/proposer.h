// Proposer: what the scheduler (scheduler.h) asks for speculative
// decoding's proposals, and what answers (speculative.h: PromptLookup,
// DraftModel). The scheduler asks once per step for the decode samples that
// may propose, each with its limit, and tells the proposer when a sample
// ends.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cellcache::runner {

struct Sample;

// One sample asking for proposals: at most `limit` (>= 1) tokens.
struct ProposalAsk {
  Sample* sample = nullptr;
  int32_t limit = 0;
};

// A proposer's answer for one ask: up to limit tokens, and either no
// distributions (a deterministic proposal: prompt lookup, or a greedy
// draft) or probs float64 [tokens.size() * vocab], row i the distribution
// tokens[i] was drawn from (sampling.h token_distribution).
struct Proposal {
  std::vector<int64_t> tokens;
  std::vector<double> probs;
  void clear() {
    tokens.clear();
    probs.clear();
  }
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual int32_t max_draft() const = 0;
  // out: resized to asks.size(), out[i] answers asks[i] (empty: nothing to
  // propose). Never fails: a proposer that cannot propose answers nothing.
  virtual void propose(std::span<const ProposalAsk> asks, std::vector<Proposal>& out) = 0;
  // The sample ended: drop what is kept for it.
  virtual void release(const Sample& sample) = 0;
  // Drops everything kept (a draft's cache is empty afterwards).
  virtual void close() = 0;
  // Why proposing stopped early (a draft that failed); "" when it did not.
  virtual const std::string& failure() const = 0;
};

}  // namespace cellcache::runner
