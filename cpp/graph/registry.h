// Cache handles: how an exported graph names the CellCache its kernels serve.
//
// A forward receives its cache's handle as an int64 graph input; the place and
// mask kernels look the cache up here. Handles are never reused within a
// process, so a handle kept after its cache was destroyed fails with
// kUnknownCache instead of reaching another cache's cells. Thread-safe.
#pragma once

#include <cstdint>

#include "cellcache/cell_cache.h"
#include "cellcache/status.h"

namespace cellcache {

// Registers a live cache; returns its handle (>= 1). The caller unregisters
// it before destroying the cache.
int64_t register_cache(CellCache* cache);
void unregister_cache(int64_t handle);
// kUnknownCache for a handle never registered or already unregistered.
Result<CellCache*> lookup_cache(int64_t handle);

}  // namespace cellcache
