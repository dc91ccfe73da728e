#include "kernel_threads.h"

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#ifndef ET_USE_THREADPOOL
#error "the cellcache kernels need ExecuTorch's thread pool: link executorch::runtime from the wheel's CMake config (it defines ET_USE_THREADPOOL)"
#endif

// The executorch wheel installs no extension/threadpool/threadpool.h; these are
// the two members of its ThreadPool that set_runtime_thread_count calls, as
// ExecuTorch 1.5 declares them (defined in libexecutorch_threadpool, which
// executorch::runtime links).
namespace executorch::extension::threadpool {
class ThreadPool final {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace cellcache::kernels {
namespace {
std::atomic<uint64_t> used_bits{0};  // bit t: pool thread t ran a work item
}  // namespace

bool set_runtime_thread_count(int64_t threads) {
  if (threads < 1 || threads > kMaxRuntimeThreads) return false;
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool == nullptr) return false;
  if (static_cast<int64_t>(pool->get_thread_count()) == threads) return true;
  return pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads)) &&
         static_cast<int64_t>(pool->get_thread_count()) == threads;
}

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
