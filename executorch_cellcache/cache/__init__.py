"""The cache's Python face: the C++ core's binding (``_core``: ``CellCache``,
``PlacedStep``, limits), its error classes, and the ``.pte`` metadata that
configures a cache and a runner (written by export, read by runtime).

Imports nothing else from this package; every other layer may import it.
Loading ``_core`` also registers the ExecuTorch kernels of the cell-cache ops;
``pool_executor`` (loaded first) gives the runtime's thread pool its workers.
"""

# First: the runtime's thread pool gets its workers from this library only if it
# is loaded before the pool exists (pool_executor.py).
from executorch_cellcache.cache import pool_executor  # noqa: F401  (isort: skip)
from executorch_cellcache.cache.errors import (
    BelowReclaimedError,
    CapacityError,
    CellCacheError,
    InvalidConfigError,
    LayerOutOfRangeError,
    PositionConflictError,
    StepInvalidatedError,
    StepNotDeclaredError,
    UnknownCacheError,
    UnknownSequenceError,
)
from executorch_cellcache.cache._core import (
    DEFAULT_RETAINED_MARGIN,
    MAX_CELLS,
    MAX_SEQUENCES,
    CellCache,
    PlacedStep,
    PoolState,
)

__all__ = [
    "CellCache", "PlacedStep", "PoolState", "MAX_CELLS", "MAX_SEQUENCES",
    "DEFAULT_RETAINED_MARGIN",
    "CellCacheError", "UnknownSequenceError", "PositionConflictError",
    "StepNotDeclaredError", "StepInvalidatedError", "LayerOutOfRangeError",
    "InvalidConfigError", "CapacityError", "UnknownCacheError", "BelowReclaimedError",
]
