// Micro-benchmark of one cellcache::attend call at decode shapes, on one
// thread and on the ExecuTorch runtime's thread pool (what the kernel runs on
// in a program), beside an empty parallel_for over the same pool: what a
// call costs beyond its scoring work.
//
// Prints one tab-separated line per measurement:
//   name  median_us  p10_us  p90_us  ns_per_pair  description
// where a pair is one (query head, cell) scored. The after_N_us rows are
// differences of two medians (the gap with the call, the gap alone), so near
// zero they can come out negative. Built with the package
// (setup.py builds every target): build/python/cpp/cellcache_attend_bench.
// x86-64 only (it flushes cache lines with clflush). Not a test; nothing
// here asserts a speed.
//
// Usage: cellcache_attend_bench [--heads 9] [--kv-heads 3] [--head-dim 64]
//          [--dtype fp16|fp32|int8] [--cells 128] [--batch 1] [--threads 2]
//          [--calls 2000]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <random>
#include <string>
#include <vector>

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "attention/attend_core.h"
#include "kernel_threads.h"
#include "pool_executor.h"

using namespace cellcache;
using namespace cellcache::attention;

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "attend_bench: %s\n", what.c_str());
  std::exit(2);
}

struct Options {
  int64_t heads = 9, kv_heads = 3, head_dim = 64, cells = 128, batch = 1, threads = 2;
  int64_t calls = 2000;
  KvDtype dtype = KvDtype::kFloat16;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: cellcache_attend_bench [--heads N] [--kv-heads N] [--head-dim N] "
                  "[--dtype fp16|fp32|int8] [--cells N] [--batch N] [--threads N] "
                  "[--calls N]\n");
      std::exit(0);
    }
    if (i + 1 >= argc) die(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--dtype") {
      if (v == "fp16") o.dtype = KvDtype::kFloat16;
      else if (v == "fp32") o.dtype = KvDtype::kFloat32;
      else if (v == "int8") o.dtype = KvDtype::kInt8;
      else die("--dtype must be fp16, fp32 or int8, not " + v);
      continue;
    }
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    // 1 << 24 bounds every option: far above any model's heads or a cache's
    // cells, low enough that cells x batch x heads stays in range.
    if (end == v.c_str() || *end != '\0' || errno == ERANGE || n < 1 || n > (1 << 24)) {
      die(a + " must be an integer in [1, 16777216], not " + v);
    }
    if (a == "--heads") o.heads = n;
    else if (a == "--kv-heads") o.kv_heads = n;
    else if (a == "--head-dim") o.head_dim = n;
    else if (a == "--cells") o.cells = n;
    else if (a == "--batch") o.batch = n;
    else if (a == "--threads") o.threads = n;
    else if (a == "--calls") o.calls = n;
    else die("unknown option " + a + " (--help)");
  }
  if (o.heads % o.kv_heads != 0) die("--heads must be a multiple of --kv-heads");
  if (o.cells * o.batch > (1 << 24)) die("--cells x --batch must be at most 16777216");
  if (o.heads * o.head_dim * std::max(o.cells, o.batch) > (int64_t{1} << 30)) {
    die("--heads x --head-dim x max(--cells, --batch) must be at most 2^30 (buffers of GBs)");
  }
  return o;
}

volatile uint64_t sink = 0;  // keeps results observable

struct Stats {
  double median, p10, p90;
};

// Runs fn about `calls` times in rounds of 50 (5 rounds at least); returns the
// median, p10 and p90 of the rounds' per-call times (us).
template <typename Fn>
Stats time_calls(int64_t calls, Fn&& fn) {
  for (int i = 0; i < 100; ++i) fn();
  const int64_t per_round = 50;
  std::vector<double> us;
  const int64_t rounds = std::max<int64_t>(5, (calls + per_round - 1) / per_round);
  for (int64_t round = 0; round < rounds; ++round) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < per_round; ++i) fn();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
                 per_round);
  }
  std::sort(us.begin(), us.end());
  auto at = [&](double f) { return us[static_cast<size_t>(f * (us.size() - 1))]; };
  return {at(0.5), at(0.1), at(0.9)};
}

void print(const char* name, const Stats& s, double pairs, const std::string& what) {
  std::printf("%s\t%.2f\t%.2f\t%.2f\t%.2f\t%s\n", name, s.median, s.p10, s.p90,
              pairs > 0 ? s.median * 1e3 / pairs : 0.0, what.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  // Before the runtime's pool exists (kernels/pool_executor.h): this program
  // links the pool executor, so it reads CELLCACHE_POOL_SPIN_US like the runner.
  if (auto error = cellcache::kernels::configure_pool_spin_from_env()) die(*error);
  if (!kernels::set_runtime_thread_count(o.threads)) die("the thread pool refused the size");
  const int64_t n_cells = o.cells * o.batch;
  const int64_t row_bytes = kv_head_bytes(o.dtype, o.head_dim) * o.kv_heads;
  std::vector<uint8_t> k(row_bytes * n_cells), v(row_bytes * n_cells);
  std::mt19937 rng(7);
  if (o.dtype == KvDtype::kInt8) {
    const int64_t stored = kv_stored_dim(o.dtype, o.head_dim);
    for (int64_t r = 0; r < n_cells * o.kv_heads; ++r) {
      for (int64_t i = 0; i < o.head_dim; ++i) {
        k[r * stored + i] = static_cast<uint8_t>(rng() % 200);
        v[r * stored + i] = static_cast<uint8_t>(rng() % 200);
      }
      const float scale = 0.01f;
      std::memcpy(&k[r * stored + o.head_dim], &scale, 4);
      std::memcpy(&v[r * stored + o.head_dim], &scale, 4);
    }
  } else if (o.dtype == KvDtype::kFloat16) {
    auto* kh = reinterpret_cast<uint16_t*>(k.data());
    auto* vh = reinterpret_cast<uint16_t*>(v.data());
    for (size_t i = 0; i < k.size() / 2; ++i) kh[i] = 0x3000 + rng() % 0x800, vh[i] = 0x3000 + rng() % 0x800;
  } else {
    auto* kf = reinterpret_cast<float*>(k.data());
    auto* vf = reinterpret_cast<float*>(v.data());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < k.size() / 4; ++i) kf[i] = u(rng), vf[i] = u(rng);
  }
  // One decode token per sequence; sequence b owns cells [b * cells, (b + 1) * cells).
  std::vector<cell_t> cells(n_cells);
  for (int64_t c = 0; c < n_cells; ++c) cells[c] = static_cast<cell_t>(c);
  std::vector<int32_t> group_begin, tok_group, tok_begin, tok_end;
  for (int64_t b = 0; b <= o.batch; ++b) group_begin.push_back(static_cast<int32_t>(b * o.cells));
  for (int64_t b = 0; b < o.batch; ++b) {
    tok_group.push_back(static_cast<int32_t>(b));
    tok_begin.push_back(static_cast<int32_t>(b * o.cells));
    tok_end.push_back(static_cast<int32_t>((b + 1) * o.cells));
  }
  const AttendPlan plan{cells, group_begin, tok_group, tok_begin, tok_end, {}};
  std::vector<float> q(o.batch * o.heads * o.head_dim), out(q.size());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : q) x = u(rng);
  const Query query{q.data(), o.batch, o.heads, o.head_dim};
  const KvBuffers kv{k.data(), v.data(), o.dtype, n_cells, o.kv_heads, o.head_dim};
  const Params params{0.125f, 0.0f};
  const Threads pool = kernels::runtime_threads();
  const Threads serial{};
  auto call = [&](const Threads& t) {
    const Status s = attend(query, kv, plan, params, out, t);
    if (!s.is_ok()) die(s.message());
  };
  const double pairs = static_cast<double>(o.batch * o.heads * o.cells);
  const std::string shape = std::to_string(o.batch) + " x " + std::to_string(o.heads) + "/" +
                            std::to_string(o.kv_heads) + " heads x " + std::to_string(o.cells) +
                            " cells, head_dim " + std::to_string(o.head_dim);
  // A busy gap on the calling thread before each call: the pool's threads
  // fall asleep in a long one, and the call then waits for them to wake.
  auto busy = [](double us) {
    const auto until = Clock::now() + std::chrono::duration<double, std::micro>(us);
    while (Clock::now() < until) {
    }
  };
  for (double gap : {5.0, 20.0, 50.0, 200.0}) {
    const Stats with = time_calls(o.calls / 4, [&] { busy(gap); call(pool); });
    const Stats alone = time_calls(o.calls / 4, [&] { busy(gap); });
    const Stats d{with.median - alone.median, with.p10 - alone.p10, with.p90 - alone.p90};
    print(("attend_pool_after_" + std::to_string(static_cast<int>(gap)) + "us").c_str(), d, pairs,
          "the pool call after a busy gap of that many us on the calling thread");
  }
  // Cold: K/V in memory, not in any cache, as in a program, where every
  // layer's weights pass through the caches between a layer's two steps.
  // Before each timed call both pool threads read 2 MB (the L2 caches' worth:
  // the code stays in L3, as in a program) and flush the K/V lines, so the
  // threads are awake when the call starts, as after a GEMM.
  std::vector<uint8_t> sweep(2 << 20, 1);
  auto cold = [&](auto&& fn) {
    std::vector<double> us;
    for (int64_t i = 0; i < std::max<int64_t>(o.calls / 10, 21); ++i) {
      executorch::extension::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
        for (int64_t part = begin; part < end; ++part) {
          uint64_t acc = 0;
          const size_t half = sweep.size() / 2, kv_half = k.size() / 2;
          for (size_t j = part * half; j < (part + 1) * half; j += 64) acc += sweep[j];
          for (size_t j = part * kv_half; j < (part + 1) * kv_half; j += 64) {
            _mm_clflush(k.data() + j);
            _mm_clflush(v.data() + j);
          }
          _mm_mfence();
          sink = sink + acc;
        }
      });
      const auto t0 = Clock::now();
      fn();
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    auto at = [&](double f) { return us[static_cast<size_t>(f * (us.size() - 1))]; };
    return Stats{at(0.5), at(0.1), at(0.9)};
  };
  print("attend_serial_cold", cold([&] { call(serial); }), pairs,
        "on the calling thread, K/V not in cache");
  print("attend_pool_cold", cold([&] { call(pool); }), pairs, "on the pool, K/V not in cache");
  print("read_kv_cold", cold([&] {
          uint64_t acc = 0;
          const auto* k64 = reinterpret_cast<const uint64_t*>(k.data());
          const auto* v64 = reinterpret_cast<const uint64_t*>(v.data());
          for (size_t j = 0; j < k.size() / 8; ++j) acc += k64[j] + v64[j];
          sink = sink + acc;
        }), 0, "a sum of every K/V byte on one thread, not in cache: the memory floor");
  print("attend_serial", time_calls(o.calls, [&] { call(serial); }), pairs,
        "one attend call on the calling thread: " + shape);
  print("attend_pool", time_calls(o.calls, [&] { call(pool); }), pairs,
        "one attend call on the runtime pool (" + std::to_string(kernels::runtime_thread_count()) +
            " threads): " + shape);
  print("parallel_for_empty", time_calls(o.calls, [&] {
          executorch::extension::parallel_for(0, 2, 1,
                                              [&](int64_t b, int64_t e) { sink = sink + e - b; });
        }), 0, "an empty parallel_for of 2 items on the runtime pool");
  return 0;
}
