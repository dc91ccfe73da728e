#include "kernel_threads.h"

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <atomic>
#include <bit>

#ifndef ET_USE_THREADPOOL
#error "the cellcache kernels need ExecuTorch's thread pool: link executorch::runtime from the wheel's CMake config (it defines ET_USE_THREADPOOL)"
#endif

namespace cellcache::kernels {
namespace {
std::atomic<uint64_t> used_bits{0};  // bit t: pool thread t ran a work item
}  // namespace

attention::Threads runtime_threads() {
  attention::Threads t;
  t.count = executorch::extension::get_thread_count();
  t.run = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    executorch::extension::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      const int64_t tid = executorch::extension::get_thread_num();
      used_bits.fetch_or(uint64_t{1} << (tid & 63), std::memory_order_relaxed);
      body(begin, end);
    });
  };
  return t;
}

int64_t runtime_thread_count() { return executorch::extension::get_thread_count(); }
int64_t threads_used() { return std::popcount(used_bits.load()); }
void reset_threads_used() { used_bits.store(0); }

}  // namespace cellcache::kernels
