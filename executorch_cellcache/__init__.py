"""executorch-cellcache: a multi-sequence cell KV cache for LLMs on ExecuTorch.

Importing the package loads the C++ core and registers the cellcache::place and
cellcache::mask ops with PyTorch (for export) and with the ExecuTorch runtime
(for running exported programs in this process).
"""

from executorch_cellcache.errors import (
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
from executorch_cellcache._core import CellCache, MAX_SEQUENCES, PlacedStep
from executorch_cellcache import ops  # registers cellcache::place / cellcache::mask

__all__ = [
    "CellCache",
    "PlacedStep",
    "MAX_SEQUENCES",
    "CellCacheError",
    "UnknownSequenceError",
    "PositionConflictError",
    "StepNotDeclaredError",
    "StepInvalidatedError",
    "LayerOutOfRangeError",
    "InvalidConfigError",
    "CapacityError",
    "UnknownCacheError",
]
