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

// Introspection for tests: the pool's thread count, and how many distinct
// pool threads ran work items since the last reset.
int64_t runtime_thread_count();
int64_t threads_used();
void reset_threads_used();

}  // namespace cellcache::kernels
