// The ExecuTorch runtime's thread pool as the attention core's Threads
// (attention/attend_core.h): work items go through
// executorch::extension::parallel_for, which the wheel's
// libexecutorch_threadpool runs on its pool (ET_USE_THREADPOOL; without it
// parallel_for silently runs serially, so the kernels refuse to build).
#pragma once

#include <cstdint>

#include "attention/attend_core.h"

namespace cellcache::kernels {

// Threads backed by the runtime's pool (count = its thread count).
attention::Threads runtime_threads();

// The most threads set_runtime_thread_count takes: far above any core count
// these programs run on, low enough that a typo cannot ask for a million threads.
constexpr int64_t kMaxRuntimeThreads = 1024;

// Resizes the runtime's pool (process-wide: XNNPACK, the optimized kernels and
// ours run on it) to `threads` threads; false when threads is outside [1,
// kMaxRuntimeThreads] or the pool did not take the size. A no-op when it has that many already. Call it before any
// program loads: an XNNPACK delegate keeps the pool it was loaded with, and a
// resize replaces the pool.
bool set_runtime_thread_count(int64_t threads);

// Introspection for tests: the pool's thread count, and how many distinct
// pool threads ran work items since the last reset.
int64_t runtime_thread_count();
int64_t threads_used();
void reset_threads_used();

}  // namespace cellcache::kernels
