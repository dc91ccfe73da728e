"""The ExecuTorch runtime's thread pool: one per process, shared by XNNPACK's
kernels, the optimized operators and ``cellcache::attend``. ExecuTorch sizes it
to the machine's (performance) cores; ``cellcache generate/serve/eval/bench
--threads N`` and ``cellcache_runner --threads N`` resize it.

Resize before any program loads: an XNNPACK delegate keeps the pool it was
loaded with, and a resize replaces the pool (``_core.set_runtime_thread_count``,
the C++ runner's ``--threads``: ExecuTorch's ``_unsafe_reset_threadpool``), so
a program loaded earlier would run on a freed one. PyTorch's own threads are another matter (``runtime/execute.py``
sets them to one around each forward). The pool's worker threads are the
package's (``cache/pool_executor.py``: they spin CELLCACHE_POOL_SPIN_US before
they sleep); a resize gives the new pool as many.
"""

import contextlib
import os
import sys

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import InvalidConfigError


def thread_pool_size() -> int:
    """Threads of the ExecuTorch runtime's pool (the one our kernels run on)."""
    return _core.runtime_thread_count()


def set_thread_pool_size(threads: int) -> None:
    """Resizes the runtime's pool to ``threads`` (1..1024) threads; a no-op when
    it has that many. Call it before loading any program (see the module)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or \
            not 1 <= threads <= _core.MAX_RUNTIME_THREADS:
        raise InvalidConfigError(f"threads must be an integer in [1, "
                                 f"{_core.MAX_RUNTIME_THREADS}], got {threads!r}")
    # ExecuTorch logs info lines to stderr as it creates the pool (CPU probing) and
    # resets it; the runner hides them the same way while a program loads.
    with _stderr_silenced():
        resized = _core.set_runtime_thread_count(threads)
        after = thread_pool_size()
    if not resized or after != threads:
        raise RuntimeError(f"the ExecuTorch thread pool did not resize to {threads} threads "
                           f"(it has {after})")


@contextlib.contextmanager
def _stderr_silenced():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
