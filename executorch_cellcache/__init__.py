"""executorch-cellcache: a multi-sequence cell KV cache for LLMs on ExecuTorch.

Importing the package loads the C++ core and registers the cell-cache ops
(cellcache::place, cellcache::mask, cellcache::attend and cellcache::write)
with PyTorch (for export) and with the ExecuTorch runtime (for running
exported programs in this process).

Layers, in the order data flows (each subpackage's docstring says what it may
import): ``cache`` (the core's Python face, errors, .pte metadata) -> ``graph``
(ops, attention, transformers integration) -> ``exporting`` -> ``runtime``
(runner, scheduler, sampling, tokenizers) -> ``serving`` -> ``cli`` and
``bench``. Nothing inside the package imports this file's names.
"""

from executorch_cellcache import cache
from executorch_cellcache.cache import *  # noqa: F403  CellCache, PlacedStep, limits, error classes
from executorch_cellcache.graph import ops  # noqa: F401  registers the cellcache:: ops

__all__ = ["export", "ExportOptions", "Runner", "evaluate", *cache.__all__]  # noqa: F405  (lazy: __getattr__)


def __getattr__(name):
    # export, ExportOptions, Runner and evaluate pull in transformers / executorch: load them on first use.
    if name == "export":
        from executorch_cellcache.exporting.exporter import export

        globals()["export"] = export
        return export
    if name == "ExportOptions":
        from executorch_cellcache.exporting.options import ExportOptions

        globals()["ExportOptions"] = ExportOptions
        return ExportOptions
    if name == "Runner":
        from executorch_cellcache.runtime.runner import Runner

        globals()["Runner"] = Runner
        return Runner
    if name == "evaluate":
        from executorch_cellcache.runtime.evaluate import evaluate

        globals()["evaluate"] = evaluate
        return evaluate
    raise AttributeError(name)
