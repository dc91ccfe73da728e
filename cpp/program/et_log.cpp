#include "et_log.h"

#include <executorch/runtime/platform/platform.h>

#include <atomic>
#include <cstdio>

namespace cellcache::runner {
namespace {

std::atomic<bool> g_show{false};

void emit(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*,
          size_t line, const char* message, size_t length) {
  if (!g_show.load(std::memory_order_relaxed)) return;
  std::fprintf(stderr, "[executorch %c %s:%zu] %.*s\n", static_cast<char>(level), filename,
               line, static_cast<int>(length), message);
}

}  // namespace

void route_executorch_log(bool show) {
  g_show.store(show, std::memory_order_relaxed);
  executorch::runtime::register_pal(executorch::runtime::PalImpl::create(emit, __FILE__));
}

}  // namespace cellcache::runner
