// Worker threads for the ExecuTorch runtime's thread pool that wait for work
// longer before they sleep.
//
// The runtime's pool (ExecuTorch's libexecutorch_threadpool: pthreadpool) is
// shared by XNNPACK's operators, the optimized kernels and cellcache::attend.
// A decode step is many short parallel regions (a 135M model's B=1 step: ~90
// in 3-4 ms). pthreadpool's own workers spin 1000 pause instructions between
// regions on Linux (~10 us on a Xeon, where a pause is ~10 ns; Android builds
// spin 100x longer), then sleep on a futex; the next region's caller wakes
// them, and in a VM a sleeping vCPU takes tens of microseconds to run again,
// while the caller works alone. Measured (2-core Xeon VM, the bench's 135M
// 8da4w program): 23 context switches a B=1 step with the pool's own
// workers, 0.5 with these; decode 1.11-1.19x at B=1 and B=8 (docs/benchmarks.md).
//
// How: pthreadpool_create_v2 takes an executor (pthreadpool.h: `struct
// pthreadpool_executor`, num_threads + schedule) that provides the pool's
// threads; pthreadpool schedules a worker task on it at the start of a region
// when the worker is idle, and the task returns once the pool has had no work
// for a while. This file defines `pthreadpool_create` (the call ExecuTorch's
// ThreadPool makes, through the dynamic linker) as pthreadpool_create_v2 with
// such an executor, whose threads, between tasks, spin up to spin_us
// microseconds before they sleep. Every other pthreadpool function is
// ExecuTorch's own, so what runs where and the results are pthreadpool's.
//
// The definition must come first in the process's global symbol scope: the
// Python package loads libcellcache_pool_executor.so with RTLD_GLOBAL before
// anything creates the pool (executorch_cellcache/cache/pool_executor.py);
// executables link pool_executor.cpp and export the symbol
// (cellcache_use_pool_executor in cpp/CMakeLists.txt). Where it does not come
// first, the pool is pthreadpool's own, unchanged.
//
// Setting: CELLCACHE_POOL_SPIN_US, microseconds in [0, 1000000] (default
// 1000). 0: pools are pthreadpool's own (its threads, its spin).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

extern "C" {

// Reads CELLCACHE_POOL_SPIN_US (unset: the default). Returns 0, or -1 and
// writes a message (NUL-terminated, at most `capacity` bytes) naming the
// variable and the value when it is not an integer in [0, 1000000]; the
// setting is then unchanged. Whether a pool gets these workers is decided
// when it is created (a spin of 0 then: pthreadpool's own); the spin itself is
// read at every wait, so it also changes for pools that have these workers.
int cellcache_pool_executor_configure_from_env(char* message, size_t capacity);

// The spin (microseconds) of these workers from now on; 0: pools created from
// now on are pthreadpool's own.
int64_t cellcache_pool_executor_spin_us();

// Pools created with this executor so far, and its worker threads now
// running (introspection for tests).
int64_t cellcache_pool_executor_pools();
int64_t cellcache_pool_executor_workers();

}  // extern "C"

namespace cellcache::kernels {
inline constexpr int64_t kDefaultPoolSpinUs = 1000;
inline constexpr int64_t kMaxPoolSpinUs = 1000000;
inline constexpr const char* kPoolSpinEnv = "CELLCACHE_POOL_SPIN_US";

// cellcache_pool_executor_configure_from_env for C++ callers (the runner and
// the benches, before the runtime's pool exists): the error message, or none.
inline std::optional<std::string> configure_pool_spin_from_env() {
  char message[256];
  if (cellcache_pool_executor_configure_from_env(message, sizeof message) == 0) return std::nullopt;
  return std::string(message);
}
}  // namespace cellcache::kernels
