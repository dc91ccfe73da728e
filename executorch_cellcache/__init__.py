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
from executorch_cellcache import ops  # noqa: F401  registers cellcache::place / cellcache::mask

__all__ = [
    "export",
    "Runner",
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


def __getattr__(name):
    # export and Runner pull in transformers / executorch: load them on first use.
    if name == "export":
        from executorch_cellcache.exporter import export

        globals()["export"] = export
        return export
    if name == "Runner":
        from executorch_cellcache.runner import Runner

        globals()["Runner"] = Runner
        return Runner
    raise AttributeError(name)
