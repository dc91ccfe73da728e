// Shared helpers of the core's C++ tests (sequence_verbs_test.cpp, step_test.cpp,
// mask_test.cpp): cache construction, one-call steps, and what a token attends.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "cellcache/cell_cache.h"
#include "graph/registry.h"
#include "check.h"

namespace cellcache_test {
using namespace cellcache;

inline const Window kFull = std::nullopt;

inline std::unique_ptr<CellCache> make(int32_t n_cells, std::vector<Window> windows = {kFull},
                                int32_t n_layers = 0) {
  CacheConfig config{n_cells, n_layers ? n_layers : static_cast<int32_t>(windows.size()),
                     windows};
  auto r = CellCache::create(config);
  if (!r.is_ok()) return nullptr;
  return std::move(r.value());
}

#define CHECK_OK(expr) CHECK((expr).is_ok())
#define CHECK_CODE(expr, want) CHECK_EQ(static_cast<int>((expr).status().code()), \
                                        static_cast<int>(want))
#define CHECK_STATUS(expr, want) CHECK_EQ(static_cast<int>((expr).code()), static_cast<int>(want))
#define CHECK_INVARIANTS(cache) CHECK((cache).check_invariants().is_ok())

inline seq_t new_seq(CellCache& c) { return c.seq_new().value(); }

inline bool declare(CellCache& c, std::vector<seq_t> seqs) {
  auto r = c.declare_step(seqs);
  return r.is_ok() && r.value();
}

// Declares and places one step on every layer; CHECKs each gate separately so
// an admission refusal cannot pass for a placement refusal.
inline void step(CellCache& c, std::vector<seq_t> seqs, std::vector<int64_t> positions) {
  auto admitted = c.declare_step(seqs);
  CHECK(admitted.is_ok() && admitted.value());
  for (int32_t l = 0; l < c.n_layers(); ++l) CHECK_OK(c.place_step(positions, l));
}

// Positions of the cells token i of a layer step may attend, sorted.
inline std::vector<pos_t> attended(const CellCache& c, const LayerStep& s, int32_t i) {
  std::vector<pos_t> out;
  for (int32_t j = 0; j < s.used_end; ++j) {
    if (s.mask[static_cast<size_t>(i) * s.used_end + j]) out.push_back(c.cell_positions()[j]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline bool same(const std::vector<pos_t>& a, std::vector<pos_t> b) { return a == b; }

}  // namespace cellcache_test
