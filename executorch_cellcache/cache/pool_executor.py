"""Worker threads for the ExecuTorch runtime's thread pool that spin before
they sleep (cpp/kernels/pool_executor.h says why and how).

Loading this module loads ``lib/libcellcache_pool_executor.so`` into the
process's global symbol scope, so the pool ExecuTorch creates later (the one
XNNPACK, the optimized kernels and ``cellcache::attend`` run on) gets its
workers from it. The package imports it before anything else; in a process
that created the runtime's pool before importing the package, the pool stays
pthreadpool's own (``pools()`` stays 0).

``CELLCACHE_POOL_SPIN_US``: microseconds a worker spins between parallel
regions before it sleeps, an integer in [0, 1000000]; default 1000; 0 keeps
pthreadpool's own workers. Another value raises InvalidConfigError here.
"""

import ctypes
import os
from pathlib import Path

# PyTorch first: RTLD_GLOBAL puts this library's dependencies, ExecuTorch's
# libexecutorch_threadpool (pthreadpool and cpuinfo) among them, into the
# process's global symbol scope, where a library loaded afterwards looks first
# (Python loads extensions RTLD_NOW: at load). Loaded after it, PyTorch's libc10
# and libtorch_cpu took ExecuTorch's cpuinfo and pthreadpool instead of their
# own, and PyTorch's pool (QNNPACK's) came from this library's pthreadpool_create.
import torch  # noqa: F401  (isort: skip)

from executorch_cellcache.cache.errors import InvalidConfigError

ENV = "CELLCACHE_POOL_SPIN_US"
_PATH = Path(__file__).resolve().parent.parent / "lib" / "libcellcache_pool_executor.so"


def _load() -> ctypes.CDLL:
    if not _PATH.is_file():
        raise ImportError(f"{_PATH} is missing: the package's C++ build did not finish "
                          f"(reinstall it: scripts/setup.sh)")
    lib = ctypes.CDLL(str(_PATH), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    for name in ("cellcache_pool_executor_spin_us", "cellcache_pool_executor_pools",
                 "cellcache_pool_executor_workers"):
        getattr(lib, name).restype = ctypes.c_int64
    lib.cellcache_pool_executor_configure_from_env.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib


_lib = _load()


def configure_from_env() -> None:
    """Reads CELLCACHE_POOL_SPIN_US again: the workers' spin from now on (a
    pool created while it is 0 is pthreadpool's own); InvalidConfigError
    naming the value when it is not an integer in [0, 1000000]."""
    message = ctypes.create_string_buffer(256)
    if _lib.cellcache_pool_executor_configure_from_env(message, len(message)) != 0:
        raise InvalidConfigError(message.value.decode("utf-8", "replace"))


def spin_us() -> int:
    """The workers' spin, microseconds (0: pools created now are pthreadpool's own)."""
    return _lib.cellcache_pool_executor_spin_us()


def pools() -> int:
    """Thread pools created with these workers in this process so far."""
    return _lib.cellcache_pool_executor_pools()


def workers() -> int:
    """Worker threads running (one fewer than the largest pool's threads)."""
    return _lib.cellcache_pool_executor_workers()


configure_from_env()
