#include "pool_executor.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

// pthreadpool's C API as the ExecuTorch wheel's libexecutorch_threadpool
// exports it (the wheel installs no pthreadpool.h): the executor interface
// and the constructor that takes one.
extern "C" {
struct pthreadpool;
struct pthreadpool_executor {
  int (*num_threads)(void* executor_context);
  void (*schedule)(void* executor_context, void* context, void (*task)(void* context));
};
pthreadpool* pthreadpool_create_v2(pthreadpool_executor* executor, void* executor_context,
                                   size_t max_num_threads);
}

namespace cellcache::kernels {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

// Tasks pthreadpool schedules (a worker's loop over the pool's regions) and
// the threads that run them. One per process, shared by every pool (a pool
// asks for at most threads - 1 tasks at a time).
class Workers {
 public:
  // Starts threads until `count` run (a pool of count + 1 threads).
  void ensure(int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    target_ = std::max(target_, count);
    start_missing_locked();
  }

  void schedule(void (*task)(void*), void* context) {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.emplace_back(task, context);
    queued_.fetch_add(1, std::memory_order_release);
    start_missing_locked();  // none run in a child after fork(): start them there
    if (sleeping_ > 0) wake_.notify_one();
  }

  int64_t running() {
    std::lock_guard<std::mutex> lock(mutex_);
    return running_;
  }

  // Before fork(): waits (a bounded while) until no task runs and none is
  // queued, then holds the lock through the fork, so no task starts. A task
  // is pthreadpool's worker loop over one pool: one running in the parent at
  // the fork would be lost in the child, where that pool (ExecuTorch's, which
  // the child destroys at exit unless it made a new one) would wait for it
  // forever. Between regions a task returns within pthreadpool's spin (~1000
  // pauses); during one (another thread's region) the wait times out and the
  // child inherits what pthreadpool's own threads would leave it.
  void before_fork() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (running_ > 0) {
      forking_ = true;
      idle_.wait_for(lock, std::chrono::milliseconds(50),
                     [this] { return in_task_ == 0 && tasks_.empty(); });
      forking_ = false;
    }
    lock.release();  // held through fork(); after_fork_in_parent unlocks it
  }

  void after_fork_in_parent() { mutex_.unlock(); }

  // In a child after fork(): the parent's threads do not exist here, and the
  // lock is held (before_fork). Called with no other thread.
  void forget_threads_after_fork() {
    new (&mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    new (&idle_) std::condition_variable();
    running_ = 0;
    sleeping_ = 0;
    in_task_ = 0;
    forking_ = false;
  }

 private:
  void start_missing_locked() {
    while (running_ < target_) {
      std::thread([this] { loop(); }).detach();
      ++running_;
    }
  }

  void loop() {
    for (;;) {
      wait_for_task();
      void (*task)(void*) = nullptr;
      void* context = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (tasks_.empty()) continue;  // another thread took it
        std::tie(task, context) = tasks_.front();
        tasks_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
        ++in_task_;
      }
      task(context);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --in_task_;
        if (forking_) idle_.notify_all();
      }
    }
  }

  // Spins up to the spin setting, then sleeps until a task is queued. The
  // spin yields the core every few microseconds, so it only takes time no
  // other thread wants (another process's forward, a test run's other worker).
  void wait_for_task() {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + std::chrono::microseconds(spin_us.load());
    for (unsigned round = 1; queued_.load(std::memory_order_acquire) == 0; ++round) {
      for (int i = 0; i < 32; ++i) cpu_relax();
      if (round % 16 == 0) sched_yield();
      if (Clock::now() < deadline) continue;
      std::unique_lock<std::mutex> lock(mutex_);
      ++sleeping_;
      wake_.wait(lock, [this] { return !tasks_.empty(); });
      --sleeping_;
      return;
    }
  }

 public:
  std::atomic<int64_t> spin_us{kDefaultPoolSpinUs};
  std::atomic<int64_t> pools{0};

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;  // before_fork waits on it
  std::deque<std::pair<void (*)(void*), void*>> tasks_;
  std::atomic<int64_t> queued_{0};
  int target_ = 0;
  int running_ = 0;
  int sleeping_ = 0;
  int in_task_ = 0;  // tasks running now
  bool forking_ = false;
};

// Never destroyed: pools (ExecuTorch's is a static) may be destroyed at exit,
// after this file's statics, and wait for their tasks to return.
Workers& workers() {
  static Workers* w = [] {
    auto* created = new Workers();
    pthread_atfork([] { workers().before_fork(); }, [] { workers().after_fork_in_parent(); },
                   [] { workers().forget_threads_after_fork(); });
    return created;
  }();
  return *w;
}

// Each pool's executor context: how many extra threads it may use.
int pool_extra_threads(void* context) { return *static_cast<int*>(context); }

void pool_schedule(void*, void* context, void (*task)(void*)) {
  workers().schedule(task, context);
}

pthreadpool_executor kExecutor{pool_extra_threads, pool_schedule};

}  // namespace
}  // namespace cellcache::kernels

using cellcache::kernels::workers;

extern "C" pthreadpool* pthreadpool_create(size_t threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  // pthreadpool_create is pthreadpool_create_v2 without an executor: with the
  // spin off, or one thread (nothing to schedule), the pool is exactly that.
  if (workers().spin_us.load() == 0 || threads == 1) {
    return pthreadpool_create_v2(nullptr, nullptr, threads);
  }
  const int extra = static_cast<int>(std::min<size_t>(threads - 1, 1 << 20));
  workers().ensure(extra);
  auto* context = new int(extra);  // lives as long as the pool; pools are few
  pthreadpool* pool = pthreadpool_create_v2(&cellcache::kernels::kExecutor, context, threads);
  if (pool == nullptr) {
    delete context;
    return nullptr;
  }
  workers().pools.fetch_add(1);
  return pool;
}

extern "C" int cellcache_pool_executor_configure_from_env(char* message, size_t capacity) {
  using namespace cellcache::kernels;
  const char* text = std::getenv(kPoolSpinEnv);
  if (text == nullptr || *text == '\0') return 0;  // unset or empty: the default
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  const bool digits_only = std::isdigit(static_cast<unsigned char>(text[0])) && *end == '\0';
  if (!digits_only || errno == ERANGE || value < 0 || value > kMaxPoolSpinUs) {
    if (message != nullptr && capacity > 0) {
      std::snprintf(message, capacity,
                    "%s must be an integer number of microseconds in [0, %lld] (0: the thread "
                    "pool's own workers), got '%s'",
                    kPoolSpinEnv, static_cast<long long>(kMaxPoolSpinUs), text);
    }
    return -1;
  }
  workers().spin_us.store(value);
  return 0;
}

extern "C" int64_t cellcache_pool_executor_spin_us() { return workers().spin_us.load(); }
extern "C" int64_t cellcache_pool_executor_pools() { return workers().pools.load(); }
extern "C" int64_t cellcache_pool_executor_workers() { return workers().running(); }
