#include "graph/registry.h"

#include <mutex>
#include <string>
#include <unordered_map>

namespace cellcache {

namespace {

struct Registry {
  std::mutex mutex;
  int64_t next_handle = 1;
  std::unordered_map<int64_t, CellCache*> caches;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: kernels may run at exit
  return *r;
}

}  // namespace

int64_t register_cache(CellCache* cache) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t handle = r.next_handle++;
  r.caches[handle] = cache;
  return handle;
}

void unregister_cache(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.caches.erase(handle);
}

Result<CellCache*> lookup_cache(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.caches.find(handle);
  if (it == r.caches.end()) {
    return Status(StatusCode::kUnknownCache,
                  "cache handle " + std::to_string(handle) +
                      " names no live CellCache (destroyed, or from another process); "
                      "create the Runner/CellCache before running the program");
  }
  return it->second;
}

}  // namespace cellcache
