// Micro-benchmarks of the cell cache core (public CellCache API only).
//
// Prints one tab-separated line per measurement:
//   name  median_us  p10_us  p90_us  repeats  description
// scripts/bench_core.py builds this and prints the lines as a table. Times are
// wall clock (steady_clock) of the calls named in each description; setup and
// teardown of each repeat (creating sequences, prefilling history, rolling it
// back) are outside the timed region.
//
// Usage: cellcache_core_bench [--repeats N]   (default 101; the two large
// prefill measurements use N/4, at least 5)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "cellcache/cell_cache.h"

using namespace cellcache;

namespace {

using Clock = std::chrono::steady_clock;

volatile uint64_t g_sink = 0;  // keeps results observable

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "core_bench: %s\n", what.c_str());
  std::exit(1);
}

void ok(const Status& s, const char* what) {
  if (!s.is_ok()) die(std::string(what) + ": " + s.message());
}

template <typename T>
T ok(Result<T> r, const char* what) {
  if (!r.is_ok()) die(std::string(what) + ": " + r.status().message());
  return std::move(r.value());
}

std::unique_ptr<CellCache> make(int32_t n_cells, std::vector<Window> windows) {
  CacheConfig config{n_cells, static_cast<int32_t>(windows.size()), std::move(windows)};
  return ok(CellCache::create(config), "create");
}

void consume(const LayerStep& s) {
  uint64_t acc = static_cast<uint64_t>(s.cells.empty() ? 0 : s.cells.back());
  if (!s.mask.empty()) acc += s.mask[s.mask.size() / 2] + s.mask.back();
  g_sink = g_sink + acc;
}

// declare_step(seqs), then place_step(positions, l) for every layer.
void run_step(CellCache& c, const std::vector<seq_t>& seqs,
              const std::vector<int64_t>& positions) {
  if (!ok(c.declare_step(seqs), "declare_step")) die("declare_step: not admitted");
  for (int32_t l = 0; l < c.n_layers(); ++l) consume(ok(c.place_step(positions, l), "place"));
}

// `n_seqs` sequences each holding positions 0..len-1, placed in one step.
std::vector<seq_t> prefill_history(CellCache& c, int32_t n_seqs, int32_t len) {
  std::vector<seq_t> ids;
  std::vector<seq_t> seqs;
  std::vector<int64_t> pos;
  for (int32_t i = 0; i < n_seqs; ++i) {
    ids.push_back(ok(c.seq_new(), "seq_new"));
    for (int32_t p = 0; p < len; ++p) {
      seqs.push_back(ids.back());
      pos.push_back(p);
    }
  }
  if (!seqs.empty()) run_step(c, seqs, pos);
  return ids;
}

struct Stats {
  double median = 0, p10 = 0, p90 = 0;
};

// Runs setup(); times body(); runs teardown(); `repeats` times (+2 warm-ups).
Stats measure(int repeats, const std::function<void()>& setup,
              const std::function<void()>& body, const std::function<void()>& teardown) {
  std::vector<double> us;
  for (int r = 0; r < repeats + 2; ++r) {
    setup();
    const auto t0 = Clock::now();
    body();
    const auto t1 = Clock::now();
    teardown();
    if (r >= 2) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[static_cast<size_t>(q * (us.size() - 1) + 0.5)]; };
  return {at(0.5), at(0.1), at(0.9)};
}

void report(const char* name, const Stats& s, int repeats, const std::string& what) {
  std::printf("%s\t%.2f\t%.2f\t%.2f\t%d\t%s\n", name, s.median, s.p10, s.p90, repeats,
              what.c_str());
  std::fflush(stdout);
}

const Window kFull = std::nullopt;
const Window kSliding = 128;

}  // namespace

int main(int argc, char** argv) {
  int repeats = 101;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--repeats") == 0 && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else {
      die(std::string("unknown argument ") + argv[i] + " (usage: [--repeats N])");
    }
  }
  const int big_repeats = std::max(5, repeats / 4);
  const std::string two_layers = "layers: full + sliding W=128";

  // (a1) one 512-token prefill step made of 8 sequences x 64 tokens.
  {
    auto c = make(4096, {kFull, kSliding});
    std::vector<seq_t> seqs;
    std::vector<int64_t> pos;
    auto setup = [&] {
      c->clear();
      seqs.clear();
      pos.clear();
      for (int i = 0; i < 8; ++i) {
        const seq_t s = ok(c->seq_new(), "seq_new");
        for (int p = 0; p < 64; ++p) {
          seqs.push_back(s);
          pos.push_back(p);
        }
      }
    };
    auto s = measure(repeats, setup, [&] { run_step(*c, seqs, pos); }, [] {});
    report("prefill_8x64", s, repeats,
           "declare + place layer 0 + place layer 1 (2 masks 512 x 512) of ONE step: 8 "
           "sequences x 64 new tokens = 512 tokens, empty 4096-cell cache, " + two_layers);
  }

  // (a2) 8 sequences each prefilling 512 tokens, one sequence per step: 8 steps
  // of 512 tokens that fill all 4096 cells (mask rows grow to 4096 columns).
  {
    auto c = make(4096, {kFull, kSliding});
    std::vector<seq_t> ids;
    std::vector<int64_t> pos(512);
    std::iota(pos.begin(), pos.end(), 0);
    auto setup = [&] {
      c->clear();
      ids.clear();
      for (int i = 0; i < 8; ++i) ids.push_back(ok(c->seq_new(), "seq_new"));
    };
    auto body = [&] {
      for (int i = 0; i < 8; ++i) run_step(*c, std::vector<seq_t>(512, ids[i]), pos);
    };
    auto s = measure(big_repeats, setup, body, [&] {
      if (c->free_cells() != 0) die("a2: cache not full after 8 x 512 tokens");
    });
    report("prefill_8steps_x512", s, big_repeats,
           "8 steps, each declare + place 2 layers of one sequence's 512-token prefill "
           "(4096 tokens total, fills the 4096-cell cache), " + two_layers);
    Stats per{ s.median / 8, s.p10 / 8, s.p90 / 8 };
    report("prefill_8steps_x512_per_step", per, big_repeats,
           "the line above divided by 8 (mean step; mask width grows 512 -> 4096)");
  }

  // (b) one decode step: 64 sequences x 1 token, each already holding 32.
  {
    auto c = make(4096, {kFull, kSliding});
    const auto ids = prefill_history(*c, 64, 32);
    const std::vector<int64_t> pos(64, 32);
    auto s = measure(
        repeats, [] {}, [&] { run_step(*c, ids, pos); },
        [&] {
          for (seq_t q : ids) ok(c->seq_rm(q, 32), "seq_rm");  // roll back the decode
        });
    report("decode_64", s, repeats,
           "declare + place 2 layers of ONE decode step: 64 sequences x 1 token, each holding "
           "32 positions (2048 cells used), 4096-cell cache, " + two_layers);
  }

  // (c) placement only: declare + the first place_step (which also builds that
  // layer's mask over used_end columns), one full-causal layer, at 4096 vs
  // 65536 cells with the same occupied prefix; work should follow used_end,
  // not capacity.
  for (const auto& [n_seqs, hist] : {std::pair{64, 32}, std::pair{1, 128}}) {
    for (int32_t n_cells : {4096, 65536}) {
      auto c = make(n_cells, {kFull});
      const auto ids = prefill_history(*c, n_seqs, hist);
      const std::vector<int64_t> pos(n_seqs, hist);
      auto s = measure(
          repeats, [] {},
          [&] {
            if (!ok(c->declare_step(ids), "declare_step")) die("c: not admitted");
            consume(ok(c->place_step(pos, 0), "place"));
          },
          [&] {
            for (seq_t q : ids) ok(c->seq_rm(q, hist), "seq_rm");
          });
      // The admission and cell choice alone (a new declaration replaces the last).
      auto d = measure(
          repeats, [] {},
          [&] {
            if (!ok(c->declare_step(ids), "declare_step")) die("c: not admitted");
          },
          [] {});
      const std::string suffix = std::to_string(n_seqs) + "tok_" + std::to_string(n_cells);
      report(("declare_" + suffix).c_str(), d, repeats,
             "declare_step only (admission + choosing " + std::to_string(n_seqs) +
                 " free cells), " + std::to_string(n_seqs * hist) + " cells used of " +
                 std::to_string(n_cells));
      const std::string name = "place_" + suffix;
      report(name.c_str(), s, repeats,
             "declare + first place_step, " + std::to_string(n_seqs) + " decode token(s), " +
                 std::to_string(n_seqs * hist) + " cells used of " + std::to_string(n_cells) +
                 ", 1 full layer");
    }
  }
  return g_sink == 0xdeadbeef ? 2 : 0;
}
